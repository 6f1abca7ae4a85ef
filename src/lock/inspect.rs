//! Reading who holds what, for operators (`inspect`, `held_locks`,
//! `force_unlock`), and the check that the server will not evict locks.

use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::aio::ConnectionLike;

use super::{Locker, WAITERS};
use crate::error::{Error, Result};
use crate::keys;

/// The holder of a lock, as read by [`Locker::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Holder {
    /// The holder's random token.
    pub token: String,
    /// The holder's fencing token (`None` for a value lockgate did not write).
    pub fence: Option<u64>,
    /// How long the lock still lives (`None` without expiry, never set).
    pub remaining: Option<Duration>,
}

impl Holder {
    /// From a lock's value, `<token>[:<fence>][!]`, and its PTTL.
    fn read(value: &str, pttl: i64) -> Self {
        let value = value.strip_suffix('!').unwrap_or(value);
        let (token, fence) = value
            .split_once(':')
            .map_or((value, None), |(token, fence)| (token, fence.parse().ok()));
        Holder {
            token: token.to_owned(),
            fence,
            remaining: u64::try_from(pttl).ok().map(Duration::from_millis),
        }
    }
}

/// The server's `maxmemory-policy`, as read by [`Locker::check_eviction`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionPolicy {
    name: String,
    /// Whether `maxmemory` is set: without a limit (`maxmemory 0`, the
    /// default) nothing is ever evicted, whatever the policy says.
    limited: bool,
}

impl EvictionPolicy {
    /// `CONFIG GET maxmemory*`; the `Worker` warns on it too.
    pub(crate) async fn read(conn: &mut (impl ConnectionLike + Send)) -> Result<Self> {
        let attempted = "reading the server's maxmemory-policy";
        let reply: Vec<String> = redis::cmd("CONFIG")
            .arg(&["GET", "maxmemory*"])
            .query_async(conn)
            .await
            .map_err(Error::redis(attempted))?;
        // Pairs of name and value, in no promised order.
        let value = |name: &str| reply.chunks_exact(2).find(|p| p[0] == name).map(|p| &p[1]);
        let Some(name) = value("maxmemory-policy") else {
            return Err(Error::reply(attempted, format_args!("{reply:?}")));
        };
        Ok(EvictionPolicy {
            name: name.clone(),
            limited: value("maxmemory").is_some_and(|m| m != "0"),
        })
    }

    /// The policy's name, as the server reports it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the server may evict lock keys under memory pressure, which
    /// breaks mutual exclusion: when `maxmemory` is set and the policy is not
    /// `noeviction` (`volatile-ttl` evicts locks first; any other may).
    pub fn may_evict_locks(&self) -> bool {
        self.limited && self.name != "noeviction"
    }
}

impl<C> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Reads the server's `maxmemory-policy` (see [`EvictionPolicy`]); each
    /// configuration also checks it in the background on its first acquire,
    /// and warns (`tracing`) when the policy may evict locks.
    pub async fn check_eviction(&self) -> Result<EvictionPolicy> {
        EvictionPolicy::read(&mut self.conn.clone()).await
    }

    /// Starts [`check_eviction`](Self::check_eviction) in the background the
    /// first time this configuration is used, so the acquire is not delayed.
    pub(super) fn check_eviction_once(&self) {
        if self.config.eviction_checked.load(Ordering::Relaxed)
            || self.config.eviction_checked.swap(true, Ordering::Relaxed)
        {
            return;
        }
        // Outside a tokio runtime (a caller driving the future elsewhere)
        // there is nothing to run the check on: it is skipped, not a panic.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let locker = self.clone();
        runtime.spawn(async move {
            match locker.check_eviction().await {
                Ok(policy) if policy.may_evict_locks() => tracing::warn!(
                    policy = policy.name(),
                    "the server's maxmemory-policy is not `noeviction`: under memory pressure \
                     Redis may evict lock keys (volatile-ttl evicts them first; any volatile-* \
                     or allkeys-* policy may), and an evicted lock is free for a second holder: \
                     mutual exclusion breaks. Set `maxmemory-policy noeviction`."
                ),
                Ok(_) => {}
                Err(error) => tracing::debug!(%error, "could not read maxmemory-policy"),
            }
        });
    }

    /// How long the lock on `key` still lives: `None` when it is free (or
    /// held without expiry, which lockgate never does).
    pub async fn remaining(&self, key: &str) -> Result<Option<Duration>> {
        Ok(self.inspect(key).await?.and_then(|held| held.remaining))
    }

    /// Who holds the lock on `key`, with what fence (if one was issued), for
    /// how long: `None` when it is free. One round trip.
    pub async fn inspect(&self, key: &str) -> Result<Option<Holder>> {
        let lock_key = self.lock_key(key);
        let (value, pttl): (Option<String>, i64) = redis::pipe()
            .get(&lock_key)
            .pttl(&lock_key)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("reading lock `{key}`")))?;
        Ok(value.map(|value| Holder::read(&value, pttl)))
    }

    /// The locks held now whose user keys match the glob `pattern` (`*` for
    /// all, `order:*`), with their holders, sorted by key. Found with `SCAN`,
    /// so a lock taken or released meanwhile may or may not be listed; on a
    /// Redis Cluster, call it with a connection to each master in turn.
    pub async fn held_locks(&self, pattern: &str) -> Result<Vec<(String, Holder)>> {
        let mut held = Vec::new();
        // One key at a time: on a cluster, a pipeline's keys share a slot.
        for key in self.scan_keys("lock", "locks", pattern).await? {
            if let Some(holder) = self.inspect(&key).await? {
                held.push((key, holder));
            }
        }
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    /// The user keys of this locker's `<prefix>:<kind>:{<key>}` keys whose
    /// user key matches the glob `pattern` (`listing` names them in errors).
    pub(super) async fn scan_keys(
        &self,
        kind: &str,
        listing: &str,
        pattern: &str,
    ) -> Result<Vec<String>> {
        let mut conn = self.conn.clone();
        keys::scan_tagged(&mut conn, &self.config.prefix, kind, pattern)
            .await
            .map_err(Error::redis(format_args!(
                "listing {listing} matching `{pattern}`"
            )))
    }

    /// Deletes the lock on `key` whoever holds it, and its line of waiters:
    /// **an operator's emergency tool**. The holder goes on running until its
    /// next renewal finds the lock gone; meanwhile another caller can take the
    /// key, so two may run at once. Fences still increase: the next holder's
    /// is above every earlier one. Returns whether a lock was held.
    pub async fn force_unlock(&self, key: &str) -> Result<bool> {
        let lock_key = self.lock_key(key);
        // UNLINK: a line can be long (waiters of dead processes stay until a
        // release looks at them), and DEL frees it while the server waits.
        let (deleted, _): (u32, u32) = redis::pipe()
            .del(&lock_key)
            .unlink(format!("{lock_key}{WAITERS}"))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("deleting lock `{key}`")))?;
        Ok(deleted == 1)
    }
}
