//! Distributed per-key locks with fencing tokens.
//!
//! A lock is one Redis string, `<prefix>:lock:{<key>}`, taken with `SET key
//! token NX PX ttl` (one round trip when free; a second, the `contend.lua`
//! script, when held). A random token identifies its holder; release and
//! renewal compare it inside a script, so a holder whose lock expired can
//! never delete or extend the next holder's. docs/locks.md ("Locks and
//! fencing tokens") and docs/layer.md ("The LockLayer") describe the cycle,
//! the line of waiters and the hand-off on release.
//!
//! # Fencing tokens, and what they guarantee
//!
//! A **fencing token** (fence) increases per key across holders, lockers and
//! processes: storage that refuses fences lower than the highest it has seen
//! stops a holder that paused past its TTL from writing late. It is issued on
//! first use ([`Locker::fence`], [`HeldLock::fence`](crate::HeldLock::fence)),
//! only while the caller's token still holds the lock, as `max(server clock
//! in µs, last fence on record + 1)`; the record, `<prefix>:fence:{<key>}`,
//! lives as long as the lock plus [`FENCE_GRACE`].
//!
//! **Guarantee.** A new fence is higher than every earlier fence of its key
//! unless the issuing server's clock (after a failover: the new primary's)
//! stepped back by more than the time from that earlier fence to the end of
//! its lock plus [`FENCE_GRACE`], or, when a failover or a restart lost the
//! latest fences, by more than the failover's duration. A failover can still
//! let a second holder in while the first believes it holds the lock; the
//! second's fence is higher ([`Locker::require_replicas`] narrows that
//! window). docs/locks.md, "Locks under failover", has the details.
//!
//! Every command is safe to run twice, as redis-rs' cluster connections do
//! when a reply was lost. **Upgrading:** stop processes of older versions
//! (which kept the fence in a counter key or a `~...` tombstone) before
//! starting new ones: mutual exclusion holds across versions, but an old
//! process sees this version's marks and fences as held, and this version
//! sees an old tombstone as held for its 5 s.
//!
//! ```no_run
//! # async fn demo(conn: redis::aio::ConnectionManager) -> lockgate::Result<()> {
//! use std::time::Duration;
//! use lockgate::{Acquisition, Locker};
//!
//! let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
//! match locker.acquire("account-42").await? {
//!     Acquisition::Acquired(lease) => {
//!         let fence = locker.fence(&lease).await?;
//!         // ... write, passing `fence` along ...
//!         locker.release(&lease).await?;
//!     }
//!     Acquisition::Contended(busy) => {
//!         println!("busy, try again in {:?}", busy.retry_after());
//!     }
//! }
//! # Ok(()) }
//! ```

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::keys::{self, KeyName};
use crate::script::{self, Program};

mod inspect;
mod token;
pub use inspect::{EvictionPolicy, Holder};
pub(crate) use token::{Token, process_tag};
pub(crate) mod listen;
pub mod permits;
pub mod rate;
pub(crate) mod wake;
pub use wake::ReleaseListener;

/// The suffix of a lock's line of waiters (see `contend.lua`).
const WAITERS: &str = ":waiters";

/// How long a released lock (or permit) waits for the waiter it was handed to
/// (see `release.lua`): its watchdog makes it a whole TTL; one that died or
/// gave up holds the lock up this long at most. The same for every caller,
/// whatever its TTL: a waiter counts on it.
pub(crate) const HANDOFF: Duration = Duration::from_millis(500);

/// What a contend does with the key's line of waiters: the number is the
/// scripts' argument (see `contend.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Line {
    /// Nothing: the caller never joined it.
    Outside = 0,
    /// Joins it (or keeps its place) when the key is busy, marking the
    /// lock; leaves it when the lock is taken.
    Join = 1,
    /// Leaves it when the lock is taken, without joining: a waiter that
    /// joined before and cannot hear releases now.
    Leave = 2,
}

/// A lock script: `holds.lua` (the token check they share), then `parts`.
fn lock_script(parts: &[&str]) -> Script {
    let holds = include_str!("holds.lua");
    Script::new(&format!("{holds}\n{}", parts.join("\n")))
}

static CONTEND: LazyLock<Script> = LazyLock::new(|| lock_script(&[include_str!("contend.lua")]));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| lock_script(&[include_str!("line.lua"), include_str!("release.lua")]));
static EXTEND: LazyLock<Script> = LazyLock::new(|| lock_script(&[include_str!("extend.lua")]));
static FENCE: LazyLock<Script> = LazyLock::new(|| lock_script(&[include_str!("fence.lua")]));

/// The key prefix used when none is configured.
pub const DEFAULT_PREFIX: &str = "lockgate";
/// The lock TTL used when none is configured.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// How long a key's last fence stays on record (`<prefix>:fence:{<key>}`)
/// after its lock ends: see the [module docs](self) for the guarantee.
pub const FENCE_GRACE: Duration = Duration::from_secs(5);

/// Acquires, renews and releases per-key locks on Redis.
///
/// [`Locker::connect`] and [`Locker::connect_cluster`] also open a
/// [`ReleaseListener`] on the first wait; [`Locker::new`] takes any redis-rs
/// async connection and has none: its layers poll unless given one. Cloning
/// is cheap and shares the connection (and the listener).
#[derive(Clone)]
pub struct Locker<C> {
    /// Cloned per call, as redis-rs' multiplexed connections are meant to be.
    conn: C,
    config: Arc<LockerConfig>,
}

#[derive(Debug)]
struct LockerConfig {
    prefix: String,
    ttl: Duration,
    /// `WAIT` after every acquire and extend (see `require_replicas`).
    durability: Option<Durability>,
    /// The eviction check warns once per configuration, not once per call.
    eviction_checked: AtomicBool,
    /// How a release tells waiters (`PUBLISH` on a single server,
    /// `SPUBLISH` on a cluster), found out on the first release.
    publish: tokio::sync::OnceCell<&'static str>,
    /// Opened on first need (by a locker made by `connect*`), shared by clones.
    listener: Option<Arc<listen::AutoListener>>,
}

/// `WAIT replicas timeout` after each write.
#[derive(Debug, Clone, Copy)]
struct Durability {
    replicas: u32,
    timeout: Duration,
}

impl<C> std::fmt::Debug for Locker<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locker")
            .field("prefix", &self.config.prefix)
            .field("ttl", &self.config.ttl)
            .field(
                "required_replicas",
                &self.config.durability.map(|d| (d.replicas, d.timeout)),
            )
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
    key: String,
    /// Zero if unknown.
    retry_after: Duration,
    permits: Option<u32>,
}

impl Contended {
    pub(crate) fn new(key: String, retry_after: Duration) -> Self {
        Self {
            key,
            retry_after,
            permits: None,
        }
    }

    /// The same, for a key with `permits` (`None`: a lock).
    pub(crate) fn with_permits(self, permits: Option<u32>) -> Self {
        Self { permits, ..self }
    }

    /// How many permits the key has; `None` for a lock.
    pub(crate) fn permits(&self) -> Option<u32> {
        self.permits
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
    /// Shared with the layer's release guard and `HeldLock`.
    ticket: Arc<Ticket>,
    expires_at: Instant,
}

/// One attempt at a lock, made before anything is sent, so that whoever may
/// hold the lock can always release it (a release with a token that never
/// acquired is a harmless no-op).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ticket {
    key: String,
    /// For one of n permits, the key's permits set.
    lock_key: String,
    token: Token,
    /// Issued on first use (see `Locker::fence`).
    fence: OnceLock<u64>,
    /// How many permits the key admits (see [`permits`]); `None` for a lock.
    permits: Option<u32>,
    /// Held by a later message of a keyed run, under the token of the
    /// message before it: a fence it asks for is issued anew (see
    /// `fence.lua`), not the one before's.
    later_in_run: bool,
}

impl Ticket {
    pub(crate) fn key(&self) -> &str {
        &self.key
    }

    pub(crate) fn issued_fence(&self) -> Option<u64> {
        self.fence.get().copied()
    }

    pub(crate) fn lock_key(&self) -> &str {
        &self.lock_key
    }

    pub(crate) fn token(&self) -> &str {
        self.token.as_str()
    }

    pub(crate) fn permits(&self) -> Option<u32> {
        self.permits
    }
}

impl Lease {
    /// The user's key.
    pub fn key(&self) -> &str {
        &self.ticket.key
    }

    /// The random token stored in the lock; only its holder knows it.
    pub fn token(&self) -> &str {
        self.ticket.token.as_str()
    }

    /// The fencing token, if one was issued to this lease: fences are
    /// issued on first use, by [`Locker::fence`].
    pub fn issued_fence(&self) -> Option<u64> {
        self.ticket.issued_fence()
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

impl Locker<redis::aio::ConnectionManager> {
    /// A locker over a [`ConnectionManager`](redis::aio::ConnectionManager)
    /// to `client`'s server, that opens this process's [`ReleaseListener`]
    /// when a waiter first needs one, so that a waiting
    /// [`LockLayer`](crate::LockLayer) is woken by the release instead of
    /// polling ([`LockLayer::poll_only`](crate::LockLayer::poll_only) opts
    /// out). Errors when the first connection fails.
    pub async fn connect(client: redis::Client) -> Result<Self> {
        let conn = redis::aio::ConnectionManager::new(client.clone())
            .await
            .map_err(Error::redis("connecting the locker"))?;
        Ok(Self::new(conn).listening(listen::Open::Server(Box::new(client))))
    }
}

impl Locker<redis::cluster_async::ClusterConnection> {
    /// As [`connect`](Locker::connect), for a Redis Cluster: `builder()` makes
    /// the locker's connection, and another for its [`ReleaseListener`]
    /// ([`ReleaseListener::connect_cluster`]).
    pub async fn connect_cluster(
        builder: impl Fn() -> redis::cluster::ClusterClientBuilder + Send + Sync + 'static,
    ) -> Result<Self> {
        let attempted = "connecting the locker to the cluster";
        let client = builder().build().map_err(Error::redis(attempted))?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(Error::redis(attempted))?;
        Ok(Self::new(conn).listening(listen::Open::Cluster(Box::new(builder))))
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
                durability: None,
                eviction_checked: AtomicBool::new(false),
                publish: tokio::sync::OnceCell::new(),
                listener: None,
            }),
        }
    }

    /// The release listener of a locker made by [`connect`](Locker::connect)
    /// or [`connect_cluster`](Locker::connect_cluster), which its layers use
    /// unless told otherwise: opened in the background on the first call,
    /// `None` until it is up (always, for [`new`](Self::new)).
    pub fn release_listener(&self) -> Option<ReleaseListener> {
        self.config.listener.as_ref()?.get()
    }

    /// Sets the TTL of acquired locks. Errors on a TTL under one millisecond
    /// or over 10 years ([`MAX_TTL`]).
    pub fn ttl(self, ttl: Duration) -> Result<Self> {
        check_ttl(ttl)?;
        if let Some(durability) = self.config.durability {
            check_wait_fits(ttl, durability.timeout)?;
        }
        Ok(self.with_config(|c| c.ttl = ttl))
    }

    /// Sets the key prefix. Errors on an empty prefix or one with braces.
    pub fn prefix(self, prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        keys::check_prefix(&prefix)?;
        Ok(self.with_config(|c| c.prefix = prefix))
    }

    fn listening(self, open: listen::Open) -> Self {
        let listener = Arc::new(listen::AutoListener::new(open));
        self.with_config(|c| c.listener = Some(listener))
    }

    /// A locker on `conn` under a queue's `prefix` (checked with the
    /// queue's), for the locks of its keyed messages.
    pub(crate) fn for_queue(conn: C, prefix: &str) -> Self {
        Self::new(conn).with_config(|c| c.prefix = prefix.to_owned())
    }

    fn with_config(self, edit: impl FnOnce(&mut LockerConfig)) -> Self {
        let mut config = LockerConfig {
            prefix: self.config.prefix.clone(),
            ttl: self.config.ttl,
            durability: self.config.durability,
            eviction_checked: AtomicBool::new(false),
            publish: tokio::sync::OnceCell::new_with(self.config.publish.get().copied()),
            listener: self.config.listener.clone(),
        };
        edit(&mut config);
        Self {
            conn: self.conn,
            config: Arc::new(config),
        }
    }

    /// Makes every acquire and extend wait until `replicas` replicas have the
    /// lock (`WAIT`, in one pipeline with the script), and fail closed when
    /// fewer confirm in time, or the pipeline fails after the script may have
    /// run: the lock is released (token-checked) and the call returns
    /// [`Error::NotReplicated`] (retryable). This narrows, but cannot close,
    /// the window in which a failover loses a lock: see docs/locks.md, "Locks
    /// under failover".
    ///
    /// Checks at once, within `timeout`, that the server accepts `WAIT`
    /// (else [`Error::DurabilityUnsupported`]) and that `replicas` replicas
    /// confirm (else [`Error::NotReplicated`]). `replicas` must be at least
    /// 1, and `timeout` 1 ms to one minute and at most a third of the lock
    /// TTL. `WAIT` holds its connection's replies for up to `timeout`: give a
    /// durable `Locker` a connection of its own, whose response timeout is longer.
    pub async fn require_replicas(self, replicas: u32, timeout: Duration) -> Result<Self> {
        if replicas == 0 {
            return Err(Error::config("require_replicas needs at least 1 replica"));
        }
        if timeout < Duration::from_millis(1) || timeout > Duration::from_secs(60) {
            return Err(Error::config(format_args!(
                "require_replicas timeout must be between 1 ms and 60 s, got {timeout:?}"
            )));
        }
        check_wait_fits(self.config.ttl, timeout)?;
        let attempted = "checking for replicas (require_replicas)";
        let acked: i64 = match redis::cmd("WAIT")
            .arg(replicas)
            .arg(millis(timeout))
            .query_async(&mut self.conn.clone())
            .await
        {
            Ok(acked) => acked,
            Err(e) => {
                // A server that answered with a lasting error (unknown or
                // renamed command, no permission, a replica) refuses WAIT
                // itself; a connection failure or a failover state says
                // nothing about WAIT and is reported as such (retryable).
                let answered = matches!(
                    e.kind(),
                    redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
                );
                let detail = format!(
                    "the server rejected `WAIT {replicas} {}`: {e}",
                    millis(timeout)
                );
                let error = Error::redis(attempted)(e);
                if !answered || error.is_retryable() {
                    return Err(error);
                }
                return Err(Error::DurabilityUnsupported { detail });
            }
        };
        let acked = u32::try_from(acked).unwrap_or(0);
        if acked < replicas {
            return Err(Error::NotReplicated {
                attempted: attempted.into(),
                wanted: replicas,
                acked,
                timeout,
                released: false,
            });
        }
        Ok(self.with_config(|c| c.durability = Some(Durability { replicas, timeout })))
    }

    /// The replicas every acquire and extend waits for, and for how long,
    /// if [`require_replicas`](Self::require_replicas) was set.
    pub fn required_replicas(&self) -> Option<(u32, Duration)> {
        self.config.durability.map(|d| (d.replicas, d.timeout))
    }

    /// Sends `cmd` (a script's `EVALSHA` when `script` is given) that may
    /// take (`acquire`) or extend the lock: directly, or under
    /// `require_replicas` with `WAIT` in one pipeline.
    async fn send<T: redis::FromRedisValue>(
        &self,
        script: Option<&Script>,
        cmd: &redis::Cmd,
        ticket: &Ticket,
        acquire: bool,
        wrote: impl Fn(&T) -> bool,
    ) -> Result<T> {
        let reply = match self.config.durability {
            None => match script {
                Some(script) => script::run(script, cmd, &mut self.conn.clone()).await,
                None => cmd.query_async(&mut self.conn.clone()).await,
            }
            .map_err(|e| Error::redis(attempted(acquire, ticket))(e))?,
            // Boxed: the rare path keeps the common future small.
            Some(durability) => {
                let durable = self.send_durable(script, cmd, ticket, acquire, wrote, durability);
                Box::pin(durable).await?
            }
        };
        if acquire {
            self.check_eviction_once();
        }
        Ok(reply)
    }

    /// `send` under `require_replicas`, failing closed (the lock released, as
    /// only we know the token, and [`Error::NotReplicated`]) when too few
    /// replicas confirm a reply that `wrote` says changed the lock.
    async fn send_durable<T: redis::FromRedisValue>(
        &self,
        script: Option<&Script>,
        cmd: &redis::Cmd,
        ticket: &Ticket,
        acquire: bool,
        wrote: impl Fn(&T) -> bool,
        durability: Durability,
    ) -> Result<T> {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone())
            .cmd("WAIT")
            .arg(durability.replicas)
            .arg(millis(durability.timeout));
        let mut conn = self.conn.clone();
        let mut sent = pipe.query_async::<(T, i64)>(&mut conn).await;
        if let (Err(e), Some(script)) = (&sent, script)
            && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        {
            sent = match script.prepare_invoke().load_async(&mut conn).await {
                Ok(_) => pipe.query_async(&mut conn).await,
                Err(e) => Err(e),
            };
        }
        let (reply, acked) = match sent {
            Ok((reply, acked)) => (reply, u32::try_from(acked).unwrap_or(0)),
            Err(e) => {
                // An acquire may have run although the pipeline failed (a
                // timeout during WAIT, WAIT refused, a dropped connection).
                if acquire && let Err(release) = self.release_ticket(ticket).await {
                    tracing::warn!(%release, key = ticket.key, "could not release a lock whose durable acquire failed; it expires with its TTL");
                }
                return Err(Error::redis(attempted(acquire, ticket))(e));
            }
        };
        // Only a write needs replicas: a contended attempt wrote nothing.
        if !wrote(&reply) || acked >= durability.replicas {
            return Ok(reply);
        }
        let released = match self.release_ticket(ticket).await {
            Ok(released) => released == Released::Now,
            Err(error) => {
                tracing::warn!(%error, key = ticket.key, "could not release a lock that too few replicas confirmed; it expires with its TTL");
                false
            }
        };
        Err(Error::NotReplicated {
            attempted: attempted(acquire, ticket),
            wanted: durability.replicas,
            acked,
            timeout: durability.timeout,
            released,
        })
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
        keys::lock_key(&self.config.prefix, key)
    }

    /// Tries once to take the lock on `key`: one round trip (`SET key token
    /// NX PX ttl`) when it is free, a second one, to read how long the holder
    /// still has, when it is not ([`Acquisition::Contended`], not an error).
    /// Errors on an empty key, a Redis failure, and under
    /// [`require_replicas`](Self::require_replicas) with
    /// [`Error::NotReplicated`]. The first acquire of each configuration also
    /// starts [`check_eviction`](Self::check_eviction) in the background.
    pub async fn acquire(&self, key: &str) -> Result<Acquisition> {
        let ticket = self.ticket(key.to_owned())?;
        match self.try_set(&ticket).await? {
            Some(acquired) => Ok(acquired),
            None => self.contend(&ticket, Line::Outside).await,
        }
    }

    /// Prepares an attempt at the lock on `key`.
    pub(crate) fn ticket(&self, key: String) -> Result<Arc<Ticket>> {
        check_key(&key)?;
        Ok(self.held_ticket(key, (Token::random(), false), None))
    }

    /// A ticket for the lock on `key` (one of its `permits`) with `token`: an
    /// attempt's, or one that holds it already (a keyed message's claim).
    pub(crate) fn held_ticket(
        &self,
        key: String,
        (token, later_in_run): (Token, bool),
        permits: Option<u32>,
    ) -> Arc<Ticket> {
        Arc::new(Ticket {
            lock_key: self.held_key(&key, permits),
            key,
            token,
            fence: OnceLock::new(),
            permits,
            later_in_run,
        })
    }

    /// The Redis key of the lock on `key`, or of its permits set.
    pub(crate) fn held_key(&self, key: &str, permits: Option<u32>) -> String {
        let kind = if permits.is_some() { "permits" } else { "lock" };
        keys::tagged_key(&self.config.prefix, kind, key)
    }

    /// A new attempt at the same lock as `ticket`, with a new token.
    pub(crate) fn retoken(&self, ticket: &Ticket) -> Arc<Ticket> {
        Arc::new(Ticket {
            token: Token::random(),
            fence: OnceLock::new(),
            ..ticket.clone()
        })
    }

    /// The fast path: one `SET NX PX`. `Some` when it took the lock; `None`
    /// when the key was set, by another holder or by a first copy of this
    /// request (a resend): the contend script tells which.
    pub(crate) async fn try_set(&self, ticket: &Arc<Ticket>) -> Result<Option<Acquisition>> {
        // Found out before the first lock is taken, so that its release
        // does not depend on one more round trip.
        self.publish_command()
            .await
            .map_err(|e| Error::redis(attempted(true, ticket))(e))?;
        if ticket.permits.is_some() {
            // The key admits several holders: only the script can tell.
            return match self.contend(ticket, Line::Outside).await? {
                Acquisition::Contended(_) => Ok(None),
                acquired => Ok(Some(acquired)),
            };
        }
        let ttl = self.config.ttl;
        let started = Instant::now();
        let mut cmd = script::command("SET");
        cmd.arg(ticket.lock_key())
            .arg(ticket.token)
            .arg("NX")
            .arg("PX")
            .arg(millis(ttl));
        // `OK` when set, nil when the key exists.
        let set: Option<String> = self.send(None, &cmd, ticket, true, Option::is_some).await?;
        Ok(set.map(|_| self.lease(ticket, started, ttl)))
    }

    /// Tries once more with the contend script (a permit's: the acquire one),
    /// which also reads how long the holder has, and joins or leaves the line.
    pub(crate) async fn contend(&self, ticket: &Arc<Ticket>, line: Line) -> Result<Acquisition> {
        let started = Instant::now();
        let script = match ticket.permits {
            Some(_) => &*permits::ACQUIRE,
            None => &*CONTEND,
        };
        let mut cmd = script.call(2);
        cmd.arg(ticket.lock_key())
            .arg(KeyName(ticket.lock_key(), WAITERS))
            .arg(ticket.token)
            .arg(millis(self.config.ttl));
        if let Some(permits) = ticket.permits {
            cmd.arg(permits);
        }
        cmd.arg(line as u32);
        let reply: Vec<i64> = self
            .send(Some(script), &cmd, ticket, true, |reply: &Vec<i64>| {
                reply.first() == Some(&1)
            })
            .await?;
        let [acquired, left] = reply[..] else {
            let lock = ticket.permits.map_or("lock", |_| "a permit of");
            return Err(Error::reply(
                format_args!("acquiring {lock} `{}`", ticket.key),
                format_args!("expected 2 integers, got {reply:?}"),
            ));
        };
        // PTTL is -1 for a key someone set without expiry, -2 if it vanished;
        // neither tells when to retry, so say "now".
        let left = Duration::from_millis(u64::try_from(left).unwrap_or(0));
        if acquired == 1 {
            return Ok(self.lease(ticket, started, left));
        }
        let busy = Contended::new(ticket.key.clone(), left).with_permits(ticket.permits);
        Ok(Acquisition::Contended(busy))
    }

    /// The lease a release handed to `ticket` (see `release.lua`), taken
    /// without asking Redis: the hand-off started after `joined`, when the
    /// ticket's first try to join the line was sent, so the lease ends by
    /// `joined` + [`HANDOFF`], conservatively. `None` when too little of that
    /// is left (or the locker confirms with replicas): the caller then
    /// confirms with the contend script.
    pub(crate) fn handed(&self, ticket: &Arc<Ticket>, joined: Instant) -> Option<Lease> {
        let expires_at = joined + HANDOFF;
        let enough = Instant::now() + HANDOFF / 2 <= expires_at;
        (enough && self.config.durability.is_none()).then(|| Lease {
            ticket: ticket.clone(),
            expires_at,
        })
    }

    /// A lease on a lock taken by a command sent at `started`, lasting from
    /// then the TTL, or only what the server said is `left` (a resent acquire
    /// may find the lock its first copy took a while ago): conservative.
    fn lease(&self, ticket: &Arc<Ticket>, started: Instant, left: Duration) -> Acquisition {
        Acquisition::Acquired(Lease {
            ticket: ticket.clone(),
            expires_at: started + self.config.ttl.min(left),
        })
    }

    /// How long the lock `ticket` is for still lives (zero when free); for a
    /// permit, until the first holder's lease ends (zero when one is free).
    pub(crate) async fn remaining_ticket(&self, ticket: &Ticket) -> Result<Duration> {
        if let Some(permits) = ticket.permits {
            // Sorted by the end of their leases: the first ends first.
            let holders = self.permit_holders(&ticket.key).await?;
            return Ok(match holders.first() {
                Some(first) if holders.len() >= permits as usize => first.remaining,
                _ => Duration::ZERO,
            });
        }
        let pttl: i64 = redis::cmd("PTTL")
            .arg(ticket.lock_key())
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!("reading lock `{}`", ticket.key)))?;
        Ok(Duration::from_millis(u64::try_from(pttl).unwrap_or(0)))
    }

    /// Issues the fencing token of a held lock on first use (one round trip;
    /// later calls return it without asking Redis): strictly greater than
    /// the fence of every earlier holder of this key, within the bounds the
    /// [module docs](self#fencing-tokens-and-what-they-guarantee) state.
    /// The first call errors with [`Error::NotHeld`] when the lease no longer
    /// holds the lock; a fence once issued stays the lease's.
    pub async fn fence(&self, lease: &Lease) -> Result<u64> {
        self.fence_ticket(&lease.ticket).await
    }

    pub(crate) async fn fence_ticket(&self, ticket: &Ticket) -> Result<u64> {
        if let Some(fence) = ticket.issued_fence() {
            return Ok(fence);
        }
        // The record's name is made here, not with the ticket: most holders
        // never ask for a fence.
        let (script, record) = match ticket.permits {
            Some(_) => (&*permits::FENCE, ticket.lock_key.clone() + permits::FENCES),
            None => (&*FENCE, self.fence_key(&ticket.key)),
        };
        let mut cmd = script.call(2);
        cmd.arg(ticket.lock_key())
            .arg(record)
            .arg(ticket.token)
            .arg(millis(FENCE_GRACE))
            .arg(if ticket.later_in_run { "1" } else { "" });
        let key = &ticket.key;
        let fence: i64 = script::run(script, &cmd, &mut self.conn.clone())
            .await
            .map_err(Error::redis(format_args!(
                "issuing the fence of lock `{key}`"
            )))?;
        let Ok(fence) = u64::try_from(fence) else {
            return Err(Error::NotHeld { key: key.clone() });
        };
        Ok(*ticket.fence.get_or_init(|| fence))
    }

    /// The Redis key that records the last fence issued for `key` (it lives
    /// as long as the lock that issued it, plus [`FENCE_GRACE`]).
    pub fn fence_key(&self, key: &str) -> String {
        keys::tagged_key(&self.config.prefix, "fence", key)
    }

    /// Releases a lock. Returns `true` if it was held by `lease` and is now
    /// free, and `false` (changing nothing) if it had expired or belongs to
    /// another holder now. A lock found gone before the lease's expiry (a
    /// second or resent release) counts as released: nothing but its own
    /// release, or a deletion by hand, removes it before its TTL.
    pub async fn release(&self, lease: &Lease) -> Result<bool> {
        let sent = Instant::now();
        Ok(match self.release_ticket(&lease.ticket).await? {
            Released::Now => true,
            Released::Gone => sent < lease.expires_at,
            Released::Other => false,
        })
    }

    pub(crate) async fn release_ticket(&self, ticket: &Ticket) -> Result<Released> {
        let attempted = || format!("releasing lock `{}`", ticket.key);
        let publish = self
            .publish_command()
            .await
            .map_err(|e| Error::redis(attempted())(e))?;
        if ticket.permits.is_some() {
            return self.release_permit(ticket, publish).await;
        }
        let mut cmd = RELEASE.call(2);
        cmd.arg(ticket.lock_key())
            .arg(KeyName(ticket.lock_key(), WAITERS))
            .arg(ticket.token)
            .arg(publish)
            .arg(millis(HANDOFF));
        let released: i64 = script::run(&RELEASE, &cmd, &mut self.conn.clone())
            .await
            .map_err(|e| Error::redis(attempted())(e))?;
        Ok(match released {
            1 => Released::Now,
            0 => Released::Gone,
            _ => Released::Other,
        })
    }

    /// How the release script tells waiters (see [`detect_publish`]).
    async fn publish_command(&self) -> redis::RedisResult<&'static str> {
        match self.config.publish.get() {
            Some(command) => Ok(command),
            // Boxed: asked once, it need not weigh on every call's future.
            None => Box::pin(detect_publish(&self.config.publish, &self.conn)).await,
        }
    }

    /// Renews a lock to live `ttl` from now. Returns `true` if it was still
    /// held by `lease` (and updates [`Lease::expires_at`]), `false` if it had
    /// expired or belongs to another holder, in which case nothing changes.
    ///
    /// Under [`require_replicas`](Self::require_replicas), a renewal too few
    /// replicas confirmed releases the lock ([`Error::NotReplicated`]).
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
        let script = match ticket.permits {
            Some(_) => &*permits::EXTEND,
            None => &*EXTEND,
        };
        let mut cmd = script.call(1);
        cmd.arg(ticket.lock_key())
            .arg(ticket.token)
            .arg(millis(ttl));
        let extended: i64 = self
            .send(Some(script), &cmd, ticket, false, |extended| *extended == 1)
            .await?;
        Ok(extended == 1)
    }
}

/// What a call on the lock of `ticket` was doing, for errors.
fn attempted(acquire: bool, ticket: &Ticket) -> String {
    let doing = if acquire { "acquiring" } else { "extending" };
    format!("{doing} lock `{}`", ticket.key)
}

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// The lock held our token; it is free now.
    Now,
    /// The lock was gone: expired, or released already.
    Gone,
    /// Another token holds the lock.
    Other,
}

/// How a release tells waiters on the server behind `conn`, found out once
/// into `cell`: `SPUBLISH` on a cluster (it reaches the node that owns the
/// channel's slot, where `PUBLISH` would go to every node), `PUBLISH` on a
/// single server (`CLUSTER INFO` fails on a server without cluster support).
pub(crate) async fn detect_publish(
    cell: &tokio::sync::OnceCell<&'static str>,
    conn: &(impl ConnectionLike + Clone + Send),
) -> redis::RedisResult<&'static str> {
    cell.get_or_try_init(|| async {
        let info: redis::RedisResult<redis::Value> = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut conn.clone())
            .await;
        match info {
            Ok(_) => Ok("SPUBLISH"),
            // The server answered: no cluster support.
            Err(e) if matches!(e.kind(), redis::ErrorKind::Server(_)) => Ok("PUBLISH"),
            Err(e) => Err(e),
        }
    })
    .await
    .copied()
}

/// The longest TTL accepted: ten years. Longer is almost surely a unit
/// mistake, and it keeps every deadline computation far from overflow.
pub const MAX_TTL: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// A lock must outlive the `WAIT` that confirms it by a wide margin: a
/// confirmation that arrives after (or just before) the lock expired would
/// hand the caller a lease that is already over.
fn check_wait_fits(ttl: Duration, timeout: Duration) -> Result<()> {
    if timeout.saturating_mul(3) > ttl {
        return Err(Error::config(format_args!(
            "the require_replicas timeout ({timeout:?}) must be at most a third of the lock TTL ({ttl:?})"
        )));
    }
    Ok(())
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey("lock key must not be empty".into()));
    }
    Ok(())
}

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
