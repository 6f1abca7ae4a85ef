//! Permits: at most n holders of a key at a time (a lock is the case n = 1).
//!
//! A key's permits are one sorted set, `<prefix>:permits:{<key>}`, of holder
//! tokens scored by the end of their leases (server clock, ms), with its line
//! of waiters `<set>:waiters` and its fences `<set>:fences`. A holder that
//! died gives its permit back when its lease ends, and never before.
//! Waiters, hand-offs, fences and resends work as for locks (see
//! docs/limits.md, "Permits"). Each acquire says how many holders it
//! admits, so callers that disagree on n for one key each apply their own.
//! A permit on `k` does not exclude a lock on `k`.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

use super::{Acquisition, Lease, Locker, Released, Ticket, WAITERS, millis};
use crate::error::{Error, Result};
use crate::keys::{self, KeyName};
use crate::script::{self, Program};

/// The permit functions, prepended to the scripts (also the keyed queue's)
/// that take or give back permits.
pub(crate) const PERMITS_LUA: &str = concat!(
    include_str!("../line.lua"),
    "\n",
    include_str!("permits.lua")
);

pub(super) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| with_permits(include_str!("acquire.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| with_permits(include_str!("release.lua")));
pub(super) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("extend.lua")));
pub(super) static FENCE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("fence.lua")));

/// The suffix of a permits set's fences, `<set>:fences` (see `fence.lua`).
pub(super) const FENCES: &str = ":fences";

fn with_permits(body: &str) -> Script {
    Script::new(&format!("{PERMITS_LUA}\n{body}"))
}

/// The most permits a key may have: far beyond any useful concurrency, and
/// exact in the scripts' numbers.
pub const MAX_PERMITS: u32 = 1 << 20;

/// Checks a permit count: 1 to [`MAX_PERMITS`].
pub(crate) fn check_permits(permits: u32) -> Result<u32> {
    if permits == 0 {
        return Err(Error::Config(
            "permits must be at least 1 (a key with no permits admits nobody)".into(),
        ));
    }
    if permits > MAX_PERMITS {
        return Err(Error::Config(format!(
            "permits must be at most {MAX_PERMITS}, got {permits}"
        )));
    }
    Ok(permits)
}

/// A holder of one of a key's permits, as read by [`Locker::permit_holders`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PermitHolder {
    /// The holder's random token.
    pub token: String,
    /// The holder's fencing token, if one was issued.
    pub fence: Option<u64>,
    /// How long its lease still lives.
    pub remaining: Duration,
}

pub(crate) fn permits_key(prefix: &str, key: &str) -> String {
    keys::tagged_key(prefix, "permits", key)
}

impl<C> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Tries once (one script) to take one of `permits` permits on `key`: at
    /// most that many holders at a time, cluster-wide (see [the module](self)).
    /// The lease lasts the locker's TTL, and is renewed, fenced and released
    /// as a lock's. When all are taken, the [`Contended`](super::Contended)
    /// says when the first holder's lease ends. Errors on an empty key, on
    /// `permits` of 0 or above [`MAX_PERMITS`], and on a Redis failure.
    pub async fn acquire_permit(&self, key: &str, permits: u32) -> Result<Acquisition> {
        let ticket = self.permit_ticket(key.to_owned(), permits)?;
        self.contend(&ticket, super::Line::Outside).await
    }

    /// The Redis key of `key`'s permits set, `<prefix>:permits:{<key>}`
    /// (the key's hash tag in braces; see [`lock_key`](Self::lock_key)).
    pub fn permits_key(&self, key: &str) -> String {
        permits_key(&self.config.prefix, key)
    }

    /// The current holders of `key`'s permits, with their fences and how
    /// long their leases still live (leases that ran out are left out).
    pub async fn permit_holders(&self, key: &str) -> Result<Vec<PermitHolder>> {
        let set = self.permits_key(key);
        type Reply = ((u64, u64), Vec<(String, f64)>, Vec<(String, String)>);
        let (time, members, fences): Reply = redis::pipe()
            .cmd("TIME")
            .zrange_withscores(&set, 0, -1)
            .cmd("HGETALL")
            .arg(KeyName(&set, FENCES))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("reading the permits of `{key}`")))?;
        let now = time.0 * 1000 + time.1 / 1000;
        let fences: std::collections::HashMap<String, u64> = fences
            .into_iter()
            .filter_map(|(token, fence)| Some((token, fence.parse().ok()?)))
            .collect();
        Ok(members
            .into_iter()
            .filter(|(_, until)| *until as u64 > now)
            .map(|(token, until)| PermitHolder {
                fence: fences.get(&token).copied(),
                remaining: Duration::from_millis(until as u64 - now),
                token,
            })
            .collect())
    }

    /// The keys with permits held whose key matches the glob `pattern`, with
    /// their holders, sorted by key; as [`held_locks`](Self::held_locks).
    pub async fn held_permits(&self, pattern: &str) -> Result<Vec<(String, Vec<PermitHolder>)>> {
        let mut held = Vec::new();
        for key in self.scan_keys("permits", "permits", pattern).await? {
            let holders = self.permit_holders(&key).await?;
            if !holders.is_empty() {
                held.push((key, holders));
            }
        }
        held.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(held)
    }

    /// Prepares an attempt at one of `permits` permits on `key`.
    pub(crate) fn permit_ticket(&self, key: String, permits: u32) -> Result<Arc<Ticket>> {
        super::check_key(&key)?;
        let permits = check_permits(permits)?;
        let token = (super::Token::random(), false);
        Ok(self.held_ticket(key, token, Some(permits)))
    }

    pub(crate) async fn release_permit(
        &self,
        ticket: &Ticket,
        publish: &'static str,
    ) -> Result<Released> {
        let set = ticket.lock_key();
        let fenced = ticket.issued_fence().map_or("0", |_| "1");
        let mut cmd = RELEASE.call(3);
        cmd.arg(set)
            .arg(KeyName(set, WAITERS))
            .arg(KeyName(set, FENCES))
            .arg(ticket.token)
            .arg(ticket.permits.unwrap_or(1))
            .arg(publish)
            .arg(fenced)
            .arg(millis(super::HANDOFF));
        let key = &ticket.key;
        let released: i64 = script::run(&RELEASE, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("releasing a permit of `{key}`")))?;
        // 1: free now; 2: free and handed to a waiter in line.
        Ok(match released {
            1.. => Released::Now,
            _ => Released::Gone,
        })
    }
}

impl Lease {
    /// How many permits the lease's key admitted when taken (`None`: a lock).
    pub fn permits(&self) -> Option<u32> {
        self.ticket.permits()
    }
}
