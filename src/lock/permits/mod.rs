//! Permits: at most n holders of a key at a time (a lock is the case n = 1).
//!
//! A key's permits are one sorted set, `<prefix>:permits:{<key>}`: each
//! member is a holder's random token, scored by the end of its lease in
//! milliseconds by the server's clock. Taking a permit (`acquire.lua`) adds
//! the caller's token if fewer than n are in the set; a full set first drops
//! the leases that ran out and counts again. So a holder that died gives its
//! permit back when its lease ends, and never before. Releases, renewals
//! and fences compare the token, as for locks, and the set lives as long as
//! its longest lease.
//!
//! Waiters are handed permits as locks are: one that listens joins the
//! key's line of waiters (`<prefix>:permits:{<key>}:waiters`), and a release
//! hands its permit to the first of them (leased for the hand-off time, made
//! a whole lease by the waiter's next try or watchdog) and publishes its
//! token on the channel named after the set. Fences are issued on first use
//! (`fence.lua`), from the same clock-and-record rule as a lock's, kept in
//! `<prefix>:permits:{<key>}:fences`. All three keys share the key's hash
//! slot. The functions that take and give back permits are in
//! `permits.lua`, shared with the keyed queue's scripts.
//!
//! The limit is the caller's: each acquire says how many holders it admits,
//! so callers that disagree on n for one key each apply their own (a caller
//! with n = 5 enters while 4 hold permits, even if others use n = 3).
//! Permits and locks are separate keys: a permit on `k` does not exclude a
//! lock on `k`.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::{Acquisition, Contended, FENCE_GRACE, Lease, Locker, Released, Ticket, millis};
use crate::error::{Error, Result};
use crate::keys::{self, KeyName};
use crate::script;

/// The permit functions, prepended to the scripts that take or give back
/// permits (also the keyed queue's scripts).
pub(crate) const PERMITS_LUA: &str = concat!(
    include_str!("../line.lua"),
    "\n",
    include_str!("permits.lua")
);

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| with_permits(include_str!("acquire.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| with_permits(include_str!("release.lua")));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("extend.lua")));
static FENCE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("fence.lua")));

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

/// The Redis keys of a key's permits: `<set>`, `<set>:waiters` (the line
/// of waiters) and `<set>:fences`. Written straight into commands: they
/// are named on every acquire and release.
pub(crate) struct PermitKeys<'a> {
    pub(crate) set: &'a str,
    pub(crate) line: KeyName<'a>,
    pub(crate) fences: KeyName<'a>,
}

impl<'a> PermitKeys<'a> {
    /// The keys of the set named `set`.
    pub(crate) fn of(set: &'a str) -> Self {
        Self {
            set,
            line: KeyName(set, ":waiters"),
            fences: KeyName(set, ":fences"),
        }
    }

    /// The keys of a ticket's permits.
    fn of_ticket(ticket: &'a Ticket) -> Self {
        Self::of(ticket.lock_key())
    }
}

/// `<prefix>:permits:{<key>}`, built without `format!`: it is made on every
/// acquire.
pub(crate) fn permits_key(prefix: &str, key: &str) -> String {
    let tag = keys::tag(key);
    let mut set = String::with_capacity(prefix.len() + tag.len() + 12);
    set.push_str(prefix);
    set.push_str(":permits:{");
    set.push_str(&tag);
    set.push('}');
    set
}

impl<C> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Tries once to take one of `permits` permits on `key`: at most that
    /// many holders at a time, cluster-wide (see [the module](self)).
    ///
    /// One round trip, one script. The lease lasts the locker's TTL, and is
    /// renewed, fenced and released with the same methods as a lock's
    /// ([`extend`](Self::extend), [`fence`](Self::fence),
    /// [`release`](Self::release)); a holder that dies gives its permit back
    /// when its lease ends. When all are taken, the [`Contended`] says when
    /// the first holder's lease ends. Errors on an empty key, on `permits`
    /// of 0 or above [`MAX_PERMITS`], and on a Redis failure.
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
        let keys = PermitKeys::of(&set);
        type Reply = ((u64, u64), Vec<(String, f64)>, Vec<(String, String)>);
        let (time, members, fences): Reply = redis::pipe()
            .cmd("TIME")
            .cmd("ZRANGE")
            .arg(keys.set)
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .cmd("HGETALL")
            .arg(keys.fences)
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

    /// The keys with permits held whose key matches the glob `pattern`
    /// (`*` for all), with their holders, sorted by key. Found with `SCAN`
    /// (on a Redis Cluster, call it with a connection to each master: `SCAN`
    /// walks one node's keys). Keys whose leases all ran out are left out.
    pub async fn held_permits(&self, pattern: &str) -> Result<Vec<(String, Vec<PermitHolder>)>> {
        let attempted = || format!("listing permits matching `{pattern}`");
        let prefix = keys::glob_escape(&self.config.prefix);
        let sets = keys::scan(
            &mut self.conn.clone(),
            &format!("{prefix}:permits:{{{pattern}}}"),
        )
        .await
        .map_err(|e| Error::redis(attempted())(e))?;
        let start = format!("{}:permits:{{", self.config.prefix);
        let mut held = Vec::new();
        for set in &sets {
            let Some(tag) = set.strip_prefix(&start).and_then(|r| r.strip_suffix('}')) else {
                continue;
            };
            let key = keys::untag(tag);
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
        if key.is_empty() {
            return Err(Error::InvalidKey("lock key must not be empty".into()));
        }
        let permits = check_permits(permits)?;
        Ok(Arc::new(Ticket {
            lock_key: permits_key(&self.config.prefix, &key),
            key,
            token: super::Token::random(),
            fence: std::sync::OnceLock::new(),
            permits: Some(permits),
        }))
    }

    /// The acquire script for a permit ticket (see `Locker::contend`).
    pub(crate) async fn contend_permit(
        &self,
        ticket: &Arc<Ticket>,
        permits: u32,
        line: super::Line,
    ) -> Result<Acquisition> {
        let started = Instant::now();
        let keys = PermitKeys::of_ticket(ticket);
        let mark = line.arg();
        let mut cmd = script::evalsha(&ACQUIRE, 2);
        cmd.arg(keys.set)
            .arg(keys.line)
            .arg(ticket.token)
            .arg(millis(self.config.ttl))
            .arg(permits)
            .arg(mark);
        let reply: Vec<i64> = self
            .send_acquire(Some(&ACQUIRE), &cmd, ticket, |reply: &Vec<i64>| {
                reply.first() == Some(&1)
            })
            .await?;
        let [acquired, left] = reply[..] else {
            return Err(Error::reply(
                format_args!("acquiring a permit of `{}`", ticket.key),
                format_args!("expected 2 integers, got {reply:?}"),
            ));
        };
        let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
        Ok(if acquired == 1 {
            self.lease(ticket, started, Some(left))
        } else {
            Acquisition::Contended(Contended {
                key: ticket.key.clone(),
                retry_after: left,
                permits: Some(permits),
            })
        })
    }

    /// The release script for a permit ticket (see `Locker::release_ticket`).
    pub(crate) async fn release_permit(
        &self,
        ticket: &Ticket,
        publish: &'static str,
    ) -> Result<Released> {
        let keys = PermitKeys::of_ticket(ticket);
        let permits = ticket.permits.unwrap_or(1);
        let handoff = millis(super::HANDOFF);
        let fenced = if ticket.issued_fence().is_some() {
            "1"
        } else {
            "0"
        };
        let mut cmd = script::evalsha(&RELEASE, 3);
        cmd.arg(keys.set)
            .arg(keys.line)
            .arg(keys.fences)
            .arg(ticket.token)
            .arg(permits)
            .arg(publish)
            .arg(fenced)
            .arg(handoff);
        let script = &*RELEASE;
        let released: i64 = script::run(script, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "releasing a permit of `{}`",
                ticket.key
            )))?;
        // 1: free now; 2: free and handed to a waiter in line.
        Ok(if released >= 1 {
            Released::Now
        } else {
            Released::Gone
        })
    }

    /// The renewal script for a permit ticket (see `Locker::extend_ticket`).
    pub(crate) fn extend_permit_cmd(
        &self,
        ticket: &Ticket,
        ttl: Duration,
    ) -> (&'static Script, redis::Cmd) {
        let mut cmd = script::evalsha(&EXTEND, 1);
        cmd.arg(ticket.lock_key())
            .arg(ticket.token)
            .arg(millis(ttl));
        (&EXTEND, cmd)
    }

    /// The fence script for a permit ticket (see `Locker::fence_ticket`).
    pub(crate) fn fence_permit_cmd(&self, ticket: &Ticket) -> (&'static Script, redis::Cmd) {
        let keys = PermitKeys::of_ticket(ticket);
        let mut cmd = script::evalsha(&FENCE, 2);
        cmd.arg(keys.set)
            .arg(keys.fences)
            .arg(ticket.token)
            .arg(millis(FENCE_GRACE));
        (&FENCE, cmd)
    }

    /// How long until the first holder's lease of a permit ticket's key
    /// ends (zero when a permit is free or unknown).
    pub(crate) async fn remaining_permit(&self, ticket: &Ticket) -> Result<Duration> {
        let (time, leases): ((u64, u64), Vec<(String, f64)>) = redis::pipe()
            .cmd("TIME")
            .cmd("ZRANGE")
            .arg(ticket.lock_key())
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "reading the permits of `{}`",
                ticket.key
            )))?;
        let now = time.0 * 1000 + time.1 / 1000;
        // Sorted by the end of their leases: the first live one ends first.
        let live: Vec<u64> = leases
            .iter()
            .map(|(_, until)| *until as u64)
            .filter(|until| *until > now)
            .collect();
        let permits = ticket.permits.unwrap_or(1) as usize;
        Ok(match live.first() {
            Some(first) if live.len() >= permits => Duration::from_millis(first - now),
            _ => Duration::ZERO,
        })
    }
}

impl Lease {
    /// The number of permits the lease's key admitted when it was taken
    /// (`None` for a lock).
    pub fn permits(&self) -> Option<u32> {
        self.ticket.permits()
    }
}
