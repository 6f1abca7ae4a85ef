//! Distributed per-key locks with fencing tokens.
//!
//! A lock is one Redis string, `<prefix>:lock:{<key>}`, set with
//! `SET NX PX <ttl>` to a random token that identifies its holder. Release
//! and renewal compare that token inside a Lua script, so a holder whose lock
//! expired and was taken by someone else can never delete or extend the new
//! holder's lock.
//!
//! Each successful acquisition also returns a **fencing token**: a number that
//! strictly increases for the key across holders, lockers and processes
//! (it is kept in `<prefix>:fence:{<key>}`, in the same hash slot). A lock
//! with a TTL cannot by itself stop a holder that paused past its TTL from
//! writing late; passing the fence to the storage you write to, and having it
//! refuse fences lower than the highest it has seen, can.
//!
//! ```no_run
//! # async fn demo(conn: redis::aio::ConnectionManager) -> lockgate::Result<()> {
//! use std::time::Duration;
//! use lockgate::{Acquisition, Locker};
//!
//! let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
//! match locker.acquire("account-42").await? {
//!     Acquisition::Acquired(lease) => {
//!         // ... write, passing lease.fence() along ...
//!         locker.release(&lease).await?;
//!     }
//!     Acquisition::Contended(busy) => {
//!         println!("busy, try again in {:?}", busy.retry_after());
//!     }
//! }
//! # Ok(()) }
//! ```

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::keys;
use crate::script;

static ACQUIRE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("acquire.lua")));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("release.lua")));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("extend.lua")));

/// The key prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "lockgate";
/// The lock TTL used when none is configured.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// A fence counter lives this long after it was seeded (then it is seeded
/// again from the clock; see acquire.lua).
const FENCE_KEEP: Duration = Duration::from_secs(3600);

/// Acquires, renews and releases per-key locks on Redis.
///
/// Generic over any redis-rs async connection: a
/// [`ConnectionManager`](redis::aio::ConnectionManager), a
/// [`MultiplexedConnection`](redis::aio::MultiplexedConnection) or a cluster
/// connection. Cloning a `Locker` is cheap and shares the connection.
#[derive(Clone)]
pub struct Locker<C> {
    /// The connection every command goes through (cloned per call, as
    /// redis-rs' multiplexed connections are meant to be).
    conn: C,
    /// Prefix and TTL, shared by all clones.
    config: Arc<LockerConfig>,
}

#[derive(Debug)]
struct LockerConfig {
    /// First segment of every key this locker touches.
    prefix: String,
    /// TTL of a freshly acquired lock.
    ttl: Duration,
}

impl<C> std::fmt::Debug for Locker<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker")
            .field("prefix", &self.config.prefix)
            .field("ttl", &self.config.ttl)
            .finish_non_exhaustive()
    }
}

/// The result of [`Locker::acquire`]: the lock, or who holds it for how long.
#[derive(Debug)]
#[must_use = "an acquired lease must be released (or it is held until its TTL)"]
pub enum Acquisition {
    /// The lock is ours until it is released or its TTL runs out.
    Acquired(Lease),
    /// Someone else holds the lock.
    Contended(Contended),
}

impl Acquisition {
    /// The lease, if the lock was acquired.
    pub fn lease(self) -> Option<Lease> {
        match self {
            Acquisition::Acquired(lease) => Some(lease),
            Acquisition::Contended(_) => None,
        }
    }
}

/// A lock is held by someone else.
///
/// Also the error returned by [`LockLayer`](crate::LockLayer) under
/// `OnConflict::fail()`; downcast a `BoxError` to it to read when to retry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lock `{key}` is held by another holder; retry after {retry_after:?}")]
pub struct Contended {
    /// The user's key.
    key: String,
    /// How long the current holder's lock still lives (zero if unknown).
    retry_after: Duration,
}

impl Contended {
    pub(crate) fn new(key: String, retry_after: Duration) -> Self {
        Self { key, retry_after }
    }

    /// The contended key, as the caller named it.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How long the current holder's lock still lives: the earliest moment a
    /// retry can succeed without the holder releasing early.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }
}

/// A held lock.
///
/// Dropping a `Lease` does not release it (that needs a round trip): call
/// [`Locker::release`], or let the TTL run out. The
/// [`LockLayer`](crate::LockLayer) releases for you.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Key, Redis key and token (shared with the layer's release guard).
    ticket: Arc<Ticket>,
    /// Fencing token: strictly increasing per key across holders.
    fence: u64,
    /// When the lock runs out by the caller's clock (conservative: measured
    /// from before the acquire command was sent).
    expires_at: Instant,
}

/// One attempt at a lock: the key, its Redis key and the random token,
/// made before anything is sent, so that whoever may hold the lock can
/// always release it (a release with a token that never acquired is a
/// harmless no-op).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ticket {
    /// The user's key.
    key: String,
    /// The lock's Redis key followed by its fence key, in one allocation.
    keys: String,
    /// Where the fence key starts in `keys`.
    split: usize,
    /// Random token proving ownership: 32 hex digits.
    token: String,
}

impl Ticket {
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    fn lock_key(&self) -> &str {
        &self.keys[..self.split]
    }

    fn fence_key(&self) -> &str {
        &self.keys[self.split..]
    }
}

impl Lease {
    /// The user's key.
    pub fn key(&self) -> &str {
        &self.ticket.key
    }

    /// The random token stored in the lock; only its holder knows it.
    pub fn token(&self) -> &str {
        &self.ticket.token
    }

    /// The fencing token: strictly greater than the fence of every earlier
    /// holder of this key. Hand it to the storage you write to, and have it
    /// refuse writes carrying a lower fence than it has seen.
    pub fn fence(&self) -> u64 {
        self.fence
    }

    /// When the lock expires by this process's clock, measured conservatively
    /// from the moment before the acquire (or last extend) was sent.
    pub fn expires_at(&self) -> Instant {
        self.expires_at
    }

    pub(crate) fn ticket(&self) -> &Arc<Ticket> {
        &self.ticket
    }

    /// Whether the lock's TTL has run out by this process's clock.
    pub fn is_expired(&self) -> bool {
        Instant::now() >= self.expires_at
    }
}

impl<C> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A locker with the default prefix (`lockgate`) and TTL (30 s).
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            config: Arc::new(LockerConfig {
                prefix: DEFAULT_PREFIX.to_owned(),
                ttl: DEFAULT_TTL,
            }),
        }
    }

    /// Sets the TTL of acquired locks. Errors on a TTL under one millisecond.
    pub fn ttl(self, ttl: Duration) -> Result<Self> {
        check_ttl(ttl)?;
        Ok(self.with_config(|c| c.ttl = ttl))
    }

    /// Sets the key prefix. Errors on an empty prefix or one with braces.
    pub fn prefix(self, prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        keys::check_prefix(&prefix)?;
        Ok(self.with_config(|c| c.prefix = prefix))
    }

    fn with_config(self, edit: impl FnOnce(&mut LockerConfig)) -> Self {
        let mut config = LockerConfig {
            prefix: self.config.prefix.clone(),
            ttl: self.config.ttl,
        };
        edit(&mut config);
        Self {
            conn: self.conn,
            config: Arc::new(config),
        }
    }

    /// The TTL given to acquired locks.
    pub fn lease_ttl(&self) -> Duration {
        self.config.ttl
    }

    /// The connection this locker uses.
    pub fn connection(&self) -> &C {
        &self.conn
    }

    /// The Redis key of the lock on `key`.
    pub fn lock_key(&self, key: &str) -> String {
        format!("{}:lock:{{{}}}", self.config.prefix, keys::tag(key))
    }

    /// The Redis key of the fence counter of `key`.
    pub fn fence_key(&self, key: &str) -> String {
        format!("{}:fence:{{{}}}", self.config.prefix, keys::tag(key))
    }

    /// Tries once to take the lock on `key`, in one round trip.
    ///
    /// Errors on an empty key or a Redis failure; a lock held by someone else
    /// is not an error but [`Acquisition::Contended`].
    pub async fn acquire(&self, key: &str) -> Result<Acquisition> {
        self.acquire_ticket(&self.ticket(key)?).await
    }

    /// Prepares an attempt at the lock on `key`.
    pub(crate) fn ticket(&self, key: &str) -> Result<Arc<Ticket>> {
        if key.is_empty() {
            return Err(Error::InvalidKey("lock key must not be empty".into()));
        }
        let (prefix, tag) = (&self.config.prefix, keys::tag(key));
        let mut keys = String::with_capacity(2 * (prefix.len() + tag.len()) + 16);
        for kind in ["lock", "fence"] {
            keys.push_str(prefix);
            keys.push(':');
            keys.push_str(kind);
            keys.push_str(":{");
            keys.push_str(&tag);
            keys.push('}');
        }
        let split = prefix.len() + tag.len() + 8;
        Ok(Arc::new(Ticket {
            key: key.to_owned(),
            keys,
            split,
            token: random_token(),
        }))
    }

    /// Tries once to take the lock with a prepared ticket.
    pub(crate) async fn acquire_ticket(&self, ticket: &Arc<Ticket>) -> Result<Acquisition> {
        let key = &ticket.key;
        let ttl = self.config.ttl;
        let started = Instant::now();
        let mut cmd = script::evalsha(&ACQUIRE, 2);
        cmd.arg(ticket.lock_key())
            .arg(ticket.fence_key())
            .arg(&ticket.token)
            .arg(millis(ttl))
            .arg(millis(FENCE_KEEP.max(ttl.saturating_mul(2))));
        let (acquired, value): (i64, i64) = script::run(&ACQUIRE, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("acquiring lock `{key}`")))?;
        if acquired == 1 {
            let fence = u64::try_from(value).map_err(|_| {
                Error::reply(
                    format_args!("acquiring lock `{key}`"),
                    format_args!("negative fence {value}"),
                )
            })?;
            Ok(Acquisition::Acquired(Lease {
                ticket: ticket.clone(),
                fence,
                expires_at: started + ttl,
            }))
        } else {
            // PTTL is -1 for a lock someone set without expiry, -2 if it
            // vanished; neither tells us when to retry, so say "now".
            let retry_after = Duration::from_millis(u64::try_from(value).unwrap_or(0));
            Ok(Acquisition::Contended(Contended::new(
                key.to_owned(),
                retry_after,
            )))
        }
    }

    /// How long the lock on `key` still lives: `None` when it is free (or
    /// held without expiry, which lockgate never does).
    pub async fn remaining(&self, key: &str) -> Result<Option<Duration>> {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(self.lock_key(key))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "reading the TTL of lock `{key}`"
            )))?;
        Ok(u64::try_from(pttl).ok().map(Duration::from_millis))
    }

    /// Releases a lock. Returns `true` if it was still held by `lease`, and
    /// `false` (changing nothing) if it had expired or belongs to another
    /// holder now.
    pub async fn release(&self, lease: &Lease) -> Result<bool> {
        self.release_ticket(&lease.ticket).await
    }

    pub(crate) async fn release_ticket(&self, ticket: &Ticket) -> Result<bool> {
        let mut cmd = script::evalsha(&RELEASE, 1);
        cmd.arg(ticket.lock_key()).arg(&ticket.token);
        let released: i64 = script::run(&RELEASE, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "releasing lock `{}`",
                ticket.key
            )))?;
        Ok(released == 1)
    }

    /// Renews a lock to live `ttl` from now. Returns `true` if it was still
    /// held by `lease` (and updates [`Lease::expires_at`]), `false` if it had
    /// expired or belongs to another holder, in which case nothing changes.
    pub async fn extend(&self, lease: &mut Lease, ttl: Duration) -> Result<bool> {
        check_ttl(ttl)?;
        let started = Instant::now();
        let extended = self.extend_ticket(&lease.ticket, ttl).await?;
        if extended {
            lease.expires_at = started + ttl;
        }
        Ok(extended)
    }

    pub(crate) async fn extend_ticket(&self, ticket: &Ticket, ttl: Duration) -> Result<bool> {
        let mut cmd = script::evalsha(&EXTEND, 1);
        cmd.arg(ticket.lock_key())
            .arg(&ticket.token)
            .arg(millis(ttl));
        let extended: i64 = script::run(&EXTEND, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "extending lock `{}`",
                ticket.key
            )))?;
        Ok(extended == 1)
    }
}

/// 128 random bits as 32 lowercase hex digits (without `core::fmt`, which
/// showed in profiles of the lock cycle).
fn random_token() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bits = rand::random::<u128>();
    (0..32)
        .rev()
        .map(|i| HEX[((bits >> (4 * i)) & 0xf) as usize] as char)
        .collect()
}

/// The longest TTL accepted: ten years. Longer is almost surely a unit
/// mistake, and it keeps every deadline computation far from overflow.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

fn check_ttl(ttl: Duration) -> Result<()> {
    if ttl < Duration::from_millis(1) || ttl > MAX_TTL {
        return Err(Error::config(format_args!(
            "lock TTL must be between 1 ms and {MAX_TTL:?}, got {ttl:?}"
        )));
    }
    Ok(())
}

/// Milliseconds, rounded up: the server's expiry is then never earlier than
/// the `expires_at` the client computes from the unrounded duration. Capped
/// at 2^53 so that Redis' `now + ms` cannot overflow.
pub(crate) fn millis(d: Duration) -> u64 {
    const CAP: u128 = 1 << 53;
    d.as_nanos().div_ceil(1_000_000).min(CAP) as u64
}
