//! A reliable Redis delay queue: immediate and delayed messages, leases,
//! retries and dead letters, every state change one Lua script.
//!
//! A message is **scheduled** (a sorted set by due time), **active**
//! (claimed under a lease, with a claim number only its worker knows) or
//! **dead** (buried with its last error), its payload stored once while its
//! id moves between the sets. Each transition is one script on the server's
//! clock, so a message is never in no structure or claimable twice, and
//! every operation on a claimed message carries its claim: once another
//! worker took the message, the first one's ack, retry or defer changes
//! nothing. Claim numbers are the larger of the last + 1 and the server's µs,
//! so they never repeat, also after the server lost recent writes.
//!
//! ```no_run
//! # async fn demo(conn: redis::aio::ConnectionManager) -> lockgate::Result<()> {
//! use std::time::Duration;
//! use lockgate::Queue;
//!
//! let queue: Queue<String> = Queue::new(conn, "emails")?;
//! queue.push("due now".to_string()).await?;
//! queue.push_after("in a minute".to_string(), Duration::from_secs(60)).await?;
//!
//! let claimed = queue.claim(10, Duration::from_secs(30)).await?;
//! for job in claimed.jobs {
//!     println!("sending {}", *job);
//!     queue.ack(&job).await?;
//! }
//! # Ok(()) }
//! ```
//!
//! Messages are claimed in (due ms, id byte-wise) order: one process's
//! generated ids in its push order. [`Waiter`] waits for work without
//! polling; the [`Worker`](crate::Worker) drives a tower service from a
//! queue. More: docs/queue.md, "The queue".

mod claim;
use claim::token;
pub use claim::{Claim, ClaimRef, ClaimToken};
mod dead;
mod events;
mod job;
mod keyed;
pub(crate) use keyed::libraries;
mod lease;
mod names;
pub use names::queue_names;
mod push;
pub use push::{MAX_PRIORITY, PushOptions, Pushed};
mod read;
mod settle;
pub use keyed::MAX_RUN;
use keyed::{Held, Keyed, KeyedState, Sweep};
use read::span;
pub use read::{Activity, Completed, KeyLoad, KeyStats, Peek, Peeked, Stats};
pub(crate) use settle::RunEnd;
pub(crate) mod scripts;
mod shards;
pub use shards::MAX_SHARDS;
use shards::Shards;
mod wait;

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Value;
use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use self::dead::{DeadCursor, DeadPage};
pub use self::events::{Event, EventKind, EventsFrom};
pub use self::job::{DeadLetter, Job};
pub(crate) use self::wait::BLOCK;
pub use self::wait::{Connector, Waiter, Wake};
use crate::error::{Error, Result};
use crate::keys;
use crate::lock::millis;
use crate::script::Program;
use scripts::Query;

/// The most messages one script call handles (claim, push batch, recover).
/// Lua's `unpack` fails somewhere past 8,000 values; staying far below keeps
/// every script call short, so the server is never blocked for long.
pub const MAX_BATCH: usize = 1000;

/// The most entries [`Queue::record_events`] and [`Queue::keep_completed`]
/// keep.
pub const MAX_KEPT: usize = 100_000_000;

/// The most keys [`Queue::key_stats`] reads of each partition's keys at
/// work, and of its keys in line, whatever `top` asks.
pub const MAX_KEYS_READ: usize = 10_000;

/// The least time between two sweeps for keyed partitions missing from the
/// index (see `Queue::heal_in_turn`): each asks all 16,384 slots.
pub(crate) const HEAL_EVERY: Duration = Duration::from_secs(5);

/// How often the workers' recovery turns visit every keyed partition
/// (`Queue::recover_in_turn`), not only those the leases index names: the
/// safety net for messages leased by a version that kept no such index.
const FULL_SWEEP_EVERY: Duration = Duration::from_secs(300);

/// A Redis delay queue of `T` messages.
///
/// Cloning is cheap and shares the connection. `C` is any redis-rs async
/// connection; a Redis Cluster works because every key of one queue shares
/// the hash tag `{<name>}`.
pub struct Queue<T, C = redis::aio::ConnectionManager> {
    conn: C,
    keys: Arc<QueueKeys>,
    recording: Recording,
    /// The keyed side's state, shared by clones.
    keyed: Arc<KeyedState>,
    /// The shards of its messages without a key (one: the queue's own keys).
    shards: Arc<Shards>,
    /// `Queue<T>` neither owns nor sends `T`s across threads by itself.
    _message: PhantomData<fn(T) -> T>,
}

impl<T, C> Queue<T, C> {
    pub(crate) fn keys(&self) -> &Arc<QueueKeys> {
        &self.keys
    }

    /// Opens a release listener with `client` on first need: a keyed
    /// message whose key's lock other code holds is then claimable as soon
    /// as that lock is released (else at its expiry).
    pub(crate) fn wake_keys_with(&self, client: redis::Client) {
        let open = crate::lock::listen::Open::Server(Box::new(client));
        let _ = (self.keyed.listener).set(Arc::new(crate::lock::listen::AutoListener::new(open)));
    }

    /// The same with a listener that is open (one made for a cluster).
    pub(crate) fn wake_keys_by(&self, listener: crate::ReleaseListener) {
        let auto = crate::lock::listen::AutoListener::opened(listener);
        let _ = self.keyed.listener.set(Arc::new(auto));
    }

    fn keyed(&self) -> Keyed<'_, C> {
        self.keyed_on(&self.conn)
    }

    /// The keyed side of the queue, on another connection than its own.
    fn keyed_on<'a, D>(&'a self, conn: &'a D) -> Keyed<'a, D> {
        Keyed {
            conn,
            keys: &self.keys,
            state: &self.keyed,
            recording: self.recording,
        }
    }
}

impl<T, C: Clone> Clone for Queue<T, C> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            keys: self.keys.clone(),
            recording: self.recording,
            keyed: self.keyed.clone(),
            shards: self.shards.clone(),
            _message: PhantomData,
        }
    }
}

/// How many dead letters (or completed messages) are kept, and how long.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Retention {
    /// Keep at most this many (the newest).
    max_count: Option<usize>,
    /// Keep none older than this.
    max_age: Option<Duration>,
}

/// What a queue's handle records and keeps: the lifecycle events' cap
/// (when recorded), the completed messages' retention (when kept), and the
/// dead letters' retention (applied by burials).
#[derive(Debug, Clone, Copy, Default)]
struct Recording {
    events: Option<usize>,
    completed: Option<Retention>,
    dead: Retention,
}

impl Retention {
    /// The two script arguments ("" for no limit).
    fn args(&self) -> (String, String) {
        let count = self.max_count.map(|n| n.to_string());
        let age = self.max_age.map(|d| millis(d).to_string());
        (count.unwrap_or_default(), age.unwrap_or_default())
    }
}

impl<T, C> std::fmt::Debug for Queue<T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("name", &self.keys.name)
            .field("prefix", &self.keys.prefix)
            .field("retention", &self.recording.dead)
            .field("events", &self.recording.events)
            .field("completed", &self.recording.completed)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

/// The Redis key names of one queue, built once.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct QueueKeys {
    pub(crate) name: String,
    /// `<prefix>:{<name>}`, the stem of every key below.
    pub(crate) base: String,
    pub(crate) prefix: String,
    pub(crate) data: String,
    pub(crate) schedule: String,
    pub(crate) prioritized: String,
    pub(crate) active: String,
    pub(crate) dead: String,
    pub(crate) errors: String,
    pub(crate) claims: String,
    pub(crate) bell: String,
    pub(crate) events: String,
    /// Per-second counts of messages done and failed, while events are
    /// recorded (`lua/activity.lua`).
    pub(crate) activity: String,
    pub(crate) completed: String,
    /// The index of the keyed partitions and shards (see `keyed.rs`,
    /// `shards.rs`).
    pub(crate) partitions: String,
    /// The record of the queue's shard count (see `shards.rs`).
    pub(crate) shards: String,
    /// Whose turn it is to recover expired leases, per period (see
    /// `recover_in_turn`): `<recovering>:<ms>`.
    pub(crate) recovering: String,
}

impl QueueKeys {
    fn new(prefix: &str, name: &str) -> Self {
        Self::at(prefix, name, format!("{prefix}:{{{}}}", keys::tag(name)))
    }

    /// The keys of queue `name` under `base` (its own, or a shard's).
    fn at(prefix: &str, name: &str, base: String) -> Self {
        Self {
            name: name.to_owned(),
            base: base.clone(),
            prefix: prefix.to_owned(),
            data: format!("{base}:data"),
            schedule: format!("{base}:schedule"),
            prioritized: format!("{base}:prioritized"),
            active: format!("{base}:active"),
            dead: format!("{base}:dead"),
            errors: format!("{base}:errors"),
            claims: format!("{base}:claims"),
            bell: format!("{base}:bell"),
            events: format!("{base}:events"),
            activity: format!("{base}:activity"),
            completed: format!("{base}:completed"),
            partitions: format!("{base}:partitions"),
            shards: format!("{base}:shards"),
            recovering: format!("{base}:recovering"),
        }
    }
}

/// The keys `<base>:<name>` of `names`.
fn named<const N: usize>(base: &str, names: [&str; N]) -> [String; N] {
    names.map(|name| format!("{base}:{name}"))
}

/// The result of [`Queue::claim`].
#[derive(Debug)]
#[non_exhaustive]
pub struct Claimed<T> {
    /// The claimed messages, in due order.
    pub jobs: Vec<Job<T>>,
    /// How long until the next scheduled message is due, by the server's
    /// clock (zero when one is due already); `None` when nothing is scheduled.
    pub next_due: Option<Duration>,
    /// Claimed messages whose payload could not be decoded as `T`: they were
    /// moved to the dead letters with the decoding error.
    pub buried: usize,
}

/// The result of [`Queue::recover`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Recovered {
    /// Messages whose lease ran out, put back on the schedule, due now.
    pub requeued: usize,
    /// Messages whose lease ran out for the `max_stalls`-th time.
    pub buried: usize,
}

/// What an acknowledgement found for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Acked {
    /// Acknowledged now: the message is deleted.
    Done,
    /// The claim is no longer held, and the message still exists (its lease
    /// ran out): a lost lease.
    NotHeld,
    /// The message is gone already: completed (say, by an earlier copy of
    /// this acknowledgement whose reply was lost) or removed.
    Gone,
}

/// The keys that hold a queue's messages and errors, after
/// `<prefix>:{<name>}:` (the same ones `Queue::exists` looks at: the claim
/// counter and the doorbell outlive a purge). `partitions` indexes the
/// keyed messages' partitions, which live under their own hash tags.
const QUEUE_KEYS: [&str; 10] = [
    "partitions",
    "data",
    "schedule",
    "prioritized",
    "active",
    "dead",
    "errors",
    "completed",
    "events",
    "activity",
];

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A queue named `name` under the default prefix (`lockgate`).
    /// Errors on an empty name.
    pub fn new(conn: C, name: impl AsRef<str>) -> Result<Self> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(Error::config("queue name must not be empty"));
        }
        let keys = Arc::new(QueueKeys::new(crate::lock::DEFAULT_PREFIX, name));
        Ok(Self {
            conn,
            shards: Arc::new(Shards::new(keys.clone(), 1)),
            keys,
            recording: Recording::default(),
            keyed: Arc::default(),
            _message: PhantomData,
        })
    }

    /// Places the queue's keys under `prefix`. Errors on an empty prefix or
    /// one with braces.
    pub fn prefix(self, prefix: impl AsRef<str>) -> Result<Self> {
        let prefix = prefix.as_ref();
        keys::check_prefix(prefix)?;
        let keys = Arc::new(QueueKeys::new(prefix, &self.keys.name));
        Ok(Self {
            shards: Arc::new(Shards::new(keys.clone(), self.shards.len())),
            keys,
            keyed: Arc::default(),
            ..self
        })
    }

    /// Spreads the queue's messages without a key over `n` shards, each in
    /// a hash slot of its own, evenly apart: on a Redis Cluster, over its
    /// masters (keyed messages live in their keys' slots anyway). `n` is
    /// fixed when the queue is first used with it and recorded in Redis; a
    /// handle with another count is refused ([`Error::Config`]) on its first
    /// call. One shard, the default, is the plain queue. Errors when `n` is
    /// not 1..=[`MAX_SHARDS`]. See docs/cluster.md, "One queue across a
    /// Redis Cluster".
    pub fn shards(self, n: usize) -> Result<Self> {
        shards::check_count(n)?;
        Ok(Self {
            shards: Arc::new(Shards::new(self.keys.clone(), n)),
            ..self
        })
    }

    /// The number of shards its messages without a key spread over.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The queue's name.
    pub fn name(&self) -> &str {
        &self.keys.name
    }

    /// The prefix of the queue's keys (and of its keyed messages' locks).
    pub(crate) fn prefix_str(&self) -> &str {
        &self.keys.prefix
    }

    /// The connection this queue uses.
    pub fn connection(&self) -> &C {
        &self.conn
    }

    /// Claims up to `max` due messages (at most [`MAX_BATCH`]), in due order,
    /// each leased for `lease`: unless acknowledged, retried, deferred,
    /// buried or extended before the lease runs out, [`recover`](Self::recover)
    /// hands it to another worker.
    ///
    /// A claimed payload that does not decode as `T` is not returned: it is
    /// buried with the decoding error and counted in [`Claimed::buried`].
    pub async fn claim(&self, max: usize, lease: Duration) -> Result<Claimed<T>> {
        self.claim_runs(max, lease, 1).await
    }

    /// Claims as [`claim`](Self::claim) does, but a keyed message's turn
    /// may bring up to `run` of its key's first messages in line at once,
    /// all under the key's lock and one claim
    /// number: a run, as [`ack_run`](Self::ack_run) claims one, for a key
    /// with a lock and no rate limit (a key with permits or a rate limit
    /// gives one message a turn). A run's messages come one after another
    /// in [`Claimed::jobs`], in line order. Handle them one after another
    /// and settle them as the worker does: all together with
    /// [`ack_run`](Self::ack_run) after the last, or, when one of them is
    /// settled otherwise (failed, deferred, handed back), with
    /// [`cut_run`](Self::cut_run) first. Settling one alone lets go of
    /// the key and puts the others still at work back in line. `max`
    /// counts turns: the jobs may number up to `max` × `run`, which must
    /// not pass [`MAX_BATCH`]; `run` is at most [`MAX_RUN`]. The
    /// [`Worker`](crate::Worker) claims so, with
    /// [`key_batch`](crate::Worker::key_batch) as `run` (less where its
    /// batch would pass those bounds): a key with a backlog pays one claim
    /// and one acknowledgement per run rather than a hand-over after its
    /// first message.
    pub async fn claim_runs(&self, max: usize, lease: Duration, run: usize) -> Result<Claimed<T>> {
        self.claim_runs_for(max, max, lease, run).await
    }

    /// [`claim_runs`](Self::claim_runs), taking at most `keyed` keyed
    /// turns of the `max` (none: a worker with no slot free to start one).
    pub(crate) async fn claim_runs_for(
        &self,
        max: usize,
        keyed: usize,
        lease: Duration,
        run: usize,
    ) -> Result<Claimed<T>> {
        check_count("claim batch", max, 1..=MAX_BATCH)?;
        check_count("a run's messages", run, 1..=MAX_RUN as usize)?;
        if max.saturating_mul(run) > MAX_BATCH {
            return Err(Error::config(format_args!(
                "a claim of {max} turns of up to {run} messages each may pass MAX_BATCH ({MAX_BATCH})"
            )));
        }
        check_lease(lease)?;
        self.register().await;
        let (mut claimed, slots, now) = match self.layout().await?.len() {
            1 => self.claim_plain(max, lease).await?,
            _ => self.claim_shards(max, lease).await?,
        };
        let room = (max - claimed.jobs.len()).min(keyed);
        if room == 0 || slots.is_empty() {
            return Ok(claimed);
        }
        // Then keyed messages, with their keys' locks; those claimed so far
        // are leased, so a failure here must not lose them.
        let terms = keyed::Terms {
            lease,
            run: u32::try_from(run).unwrap_or(u32::MAX),
        };
        let keyed = match self.keyed().claim(&slots, now, room, terms).await {
            Ok(keyed) => keyed,
            Err(error) if claimed.jobs.is_empty() => return Err(error),
            Err(error) => {
                tracing::warn!(queue = %self.name(), %error, "keyed messages could not be claimed; returning the others");
                return Ok(claimed);
            }
        };
        for mut run in runs_of(keyed.turns) {
            let (jobs, buried) = match run.len() {
                1 => match self.decode_turn(run.remove(0)).await {
                    Ok(job) => (vec![job], false),
                    Err(buried) => (Vec::new(), buried),
                },
                _ => self.decode_run(run, None).await,
            };
            claimed.jobs.extend(jobs);
            claimed.buried += usize::from(buried);
        }
        // As many partitions named as a claim names: the index may hold
        // more with work now, which this claim did not see.
        let more = (slots.len() >= keyed::PARTITIONS_PER_CLAIM).then_some(now);
        if let Some(at) = keyed.next_at.into_iter().chain(more).min() {
            let wait = span(at - now);
            claimed.next_due = Some(claimed.next_due.map_or(wait, |due| due.min(wait)));
        }
        Ok(claimed)
    }

    /// Claims unkeyed messages; also returns the keyed partitions that may
    /// have work, and the server's time.
    async fn claim_plain(
        &self,
        max: usize,
        lease: Duration,
    ) -> Result<(Claimed<T>, Vec<u16>, i64)> {
        let attempted = || format!("claiming from queue `{}`", self.name());
        let cmd = self.claim_call(&self.keys, (max, lease), keyed::PARTITIONS_PER_CLAIM);
        let window = crate::script::resend_window(lease);
        let send =
            || async { crate::script::run(&scripts::CLAIM, &cmd, &mut self.conn.clone()).await };
        let reply = crate::script::resending(window, send).await;
        let reply: Vec<Value> = reply.map_err(Error::redis(attempted()))?;
        self.decode_claimed(reply, 0, attempted).await
    }

    /// The claim script's call on the shard of keys `k` (see
    /// `lua/claim.lua`), naming up to `partitions` keyed partitions, with a
    /// record of its own: safe to resend (see `script::resending`).
    fn claim_call(
        &self,
        k: &QueueKeys,
        (max, lease): (usize, Duration),
        partitions: usize,
    ) -> redis::Cmd {
        let mut cmd = scripts::CLAIM.call(9);
        cmd.arg(&[&k.data, &k.schedule, &k.active, &k.claims])
            .arg(&[&k.bell, &k.prioritized, &k.events, &k.partitions])
            .arg(format!(
                "{}:{}",
                k.claims,
                crate::lock::Token::random().as_str()
            ))
            .arg(max)
            .arg(millis(lease))
            .arg(self.events_arg())
            .arg(partitions)
            .arg(millis(crate::script::resend_window(lease)));
        cmd
    }

    /// The claim script's reply from shard `shard` decoded: the jobs, the
    /// partitions it named, and the server's time.
    async fn decode_claimed(
        &self,
        mut header: Vec<Value>,
        shard: usize,
        attempted: impl Fn() -> String,
    ) -> Result<(Claimed<T>, Vec<u16>, i64)> {
        // {claim, next due, now, partitions}, then the claimed messages.
        let mut values = header.split_off(header.len().min(4)).into_iter();
        let (claim, next_due, now, slots): (u64, i64, i64, Vec<u16>) =
            redis::from_redis_value(Value::Array(header))
                .map_err(|e| Error::reply(attempted(), format_args!("bad header: {e}")))?;
        let mut claimed = Claimed {
            jobs: Vec::new(),
            next_due: (next_due >= 0).then(|| span(next_due - now)),
            buried: 0,
        };
        while let (Some(id), Some(due), Some(record)) =
            (values.next(), values.next(), values.next())
        {
            // The due time is a score: text, maybe with a fraction.
            let entry = Value::Array(vec![id, due, record]);
            let Ok((id, due, record)) = redis::from_redis_value::<(String, f64, Vec<u8>)>(entry)
            else {
                // Cannot happen with lockgate's script; if it does, the jobs
                // decoded so far must still reach the caller (they are
                // leased), and the odd entry comes back after its lease.
                tracing::error!(queue = %self.name(), "claim returned a malformed entry; skipping it");
                continue;
            };
            let decoded = self.decode_or_bury((id, claim, due as i64, &record), (None, shard));
            match decoded.await {
                Ok(job) => claimed.jobs.push(job),
                Err(buried) => claimed.buried += usize::from(buried),
            }
        }
        Ok((claimed, slots, now))
    }

    /// A keyed message's turn, decoded (due when pushed) or buried.
    async fn decode_turn(&self, turn: keyed::Turn) -> std::result::Result<Job<T>, bool> {
        match self.decode_turn_only(turn) {
            Ok(job) => Ok(job),
            Err(bad) => Err(self.bury_undecodable(*bad).await),
        }
    }

    /// A keyed turn decoded as `T`, or the job as it is and the error.
    fn decode_turn_only(
        &self,
        turn: keyed::Turn,
    ) -> std::result::Result<Job<T>, Box<(Job<()>, String)>> {
        let enqueued = job::split_or_raw(&turn.record).enqueued;
        let token = (turn.id, turn.claim, Some(turn.held), 0);
        Job::<T>::decode(token, enqueued, &turn.record, &self.keys)
    }

    /// A claimed message decoded as `T`, under its key's lock when `held`,
    /// from shard `shard`.
    /// One that does not decode is buried (not as a failed attempt) and
    /// `Err` says whether it was; a failed burial is logged and must not
    /// strand the rest of a batch: the message comes back after its lease.
    async fn decode_or_bury(
        &self,
        (id, claim, due_ms, record): (String, u64, i64, &[u8]),
        (held, shard): (Option<Arc<Held>>, usize),
    ) -> std::result::Result<Job<T>, bool> {
        let shard = u16::try_from(shard).unwrap_or_default();
        let token = (id, claim, held, shard);
        match Job::<T>::decode(token, due_ms, record, &self.keys) {
            Ok(job) => Ok(job),
            Err(bad) => Err(self.bury_undecodable(*bad).await),
        }
    }

    /// Buries a message that does not decode (not as a failed attempt);
    /// whether it was. A failure is logged: it comes back after its lease.
    async fn bury_undecodable(&self, (job, error): (Job<()>, String)) -> bool {
        tracing::warn!(queue = %self.name(), id = %job.id(), %error, "burying undecodable message");
        match self.bury_with(&job, &error, false).await {
            Ok(buried) => buried,
            Err(e) => {
                tracing::warn!(id = %job.id(), error = %e, "could not bury undecodable message");
                false
            }
        }
    }

    /// A claimed keyed turn's token (for a run's messages to settle as
    /// they are, decoded or not).
    fn turn_token_of(turn: &keyed::Turn) -> ClaimToken {
        ClaimToken {
            id: turn.id.clone(),
            claim: turn.claim,
            failures: 0,
            stalls: 0,
            held: Some(turn.held.clone()),
            shard: 0,
            run_before: None,
        }
    }

    /// Hands messages whose lease ran out back to the schedule, due now,
    /// counting a *stall*, not a failed attempt (the handler may never have
    /// started). A message whose lease ran out `max_stalls` times (at
    /// least once) is buried instead. Loops over script calls of
    /// [`MAX_BATCH`] until none is left; safe to run from many processes.
    /// On one server it visits the keyed partitions where a lease may have
    /// run out, by the index the scripts keep of their earliest leases;
    /// once every few minutes, between all the queue's handles, every
    /// partition (docs/keyed.md, "Recovery sweeps").
    pub async fn recover(&self, max_stalls: u32) -> Result<Recovered> {
        let mut total = Recovered::default();
        let shards = self.layout().await?;
        self.index_shards().await?;
        for (shard, k) in shards.keys.iter().enumerate() {
            let recovered = self.recover_shard(k, max_stalls).await?;
            if recovered.requeued > 0 {
                self.mark_shard_after(shard, 0).await;
            }
            total.requeued += recovered.requeued;
            total.buried += recovered.buried;
        }
        let (sweep, turn) = self.sweep().await?;
        let recovered = self.keyed().recover(max_stalls.max(1), sweep).await;
        let (requeued, buried) = match recovered {
            Ok(recovered) => recovered,
            Err(error) => {
                if turn {
                    self.give_back_full_sweep().await;
                }
                return Err(error);
            }
        };
        total.requeued += requeued;
        total.buried += buried;
        if total.requeued + total.buried > 0 {
            tracing::info!(queue = %self.name(), requeued = total.requeued, buried = total.buried, "recovered messages whose lease ran out");
        }
        Ok(total)
    }

    /// Which keyed partitions a recovery visits: every one in the first
    /// turn of each [`FULL_SWEEP_EVERY`] between the queue's handles (the
    /// safety net for leases given by a version without the leases index),
    /// else those the index names; and whether it took the full sweep's
    /// turn.
    async fn sweep(&self) -> Result<(Sweep, bool)> {
        let mut full = redis::cmd("SET");
        full.arg(format!("{}:full", self.keys.recovering));
        full.arg(1)
            .arg("NX")
            .arg("PX")
            .arg(millis(FULL_SWEEP_EVERY));
        let attempted = || format!("recovering expired leases in queue `{}`", self.name());
        let full: Option<String> = full.query_on(&self.conn, attempted).await?;
        Ok(match full {
            Some(_) => (Sweep::Full, true),
            None => (Sweep::Due, false),
        })
    }

    /// After a full sweep that failed: its turn back, for the next
    /// recovery to take (else the next is [`FULL_SWEEP_EVERY`] away). A
    /// failure here leaves it so, and says so.
    async fn give_back_full_sweep(&self) {
        let key = format!("{}:full", self.keys.recovering);
        let mut del = redis::cmd("DEL");
        del.arg(&key);
        let attempted = || {
            format!(
                "giving back the full sweep's turn of queue `{}`",
                self.name()
            )
        };
        if let Err(error) = del.query_on::<(), _>(&self.conn, attempted).await {
            tracing::warn!(%error, queue = %self.name(), "a full recovery sweep failed, and its turn stays taken: the next one comes in 5 minutes");
        }
    }

    /// [`recover`](Self::recover), unless a handle of the queue with the
    /// same `every` (a worker with the same lease, in this process or
    /// another) did in the last `every`: such workers take turns, so that
    /// between them they sweep the queue's shards and keyed partitions once
    /// per `every`, however many they are. (Workers with another lease
    /// take their own turns: none waits on a slower one's.) Returns nothing
    /// recovered when it was not this handle's turn.
    pub(crate) async fn recover_in_turn(
        &self,
        max_stalls: u32,
        every: Duration,
    ) -> Result<Recovered> {
        // A handle that cannot recover (say, of another shard count) must
        // not take a turn from those that can.
        self.layout().await?;
        let every = millis(every);
        // A turn lasts 90 % of `every`: the next tick of the worker that
        // took it finds it over, however their timers drift.
        let mut turn = redis::cmd("SET");
        turn.arg(format!("{}:{every}", self.keys.recovering));
        turn.arg(1).arg("NX").arg("PX").arg((every * 9 / 10).max(1));
        let attempted = || format!("recovering expired leases in queue `{}`", self.name());
        let taken: Option<String> = turn.query_on(&self.conn, attempted).await?;
        let Some(_) = taken else {
            return Ok(Recovered::default());
        };
        self.recover(max_stalls).await
    }

    /// Sweeps for keyed partitions missing from the index
    /// (`Keyed::heal_index`) over `conn`, unless a handle of the queue did
    /// in the last [`HEAL_EVERY`] (or `every`, when longer): a message a
    /// producer pushed without its index step is found within about that.
    /// Returns how many partitions it put back.
    pub(crate) async fn heal_in_turn<D>(&self, conn: &D, every: Duration) -> Result<usize>
    where
        D: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let period = millis(every.max(HEAL_EVERY));
        let mut turn = redis::cmd("SET");
        turn.arg(format!("{}:healing", self.keys.base));
        turn.arg(1).arg("NX").arg("PX").arg(period * 9 / 10);
        let attempted = || {
            format!(
                "looking for unindexed partitions of queue `{}`",
                self.name()
            )
        };
        let taken: Option<String> = turn.query_on(conn, attempted).await?;
        match taken {
            Some(_) => self.keyed_on(conn).heal_index().await,
            None => Ok(0),
        }
    }

    /// Recovers the messages without a key of the shard of keys `k`.
    async fn recover_shard(&self, k: &QueueKeys, max_stalls: u32) -> Result<Recovered> {
        let mut total = Recovered::default();
        let (max_count, max_age) = self.recording.dead.args();
        let attempted = || format!("recovering expired leases in queue `{}`", self.name());
        loop {
            let (requeued, buried, examined): (usize, usize, usize) = scripts::RECOVER
                .key(&[&k.data, &k.schedule, &k.active, &k.dead])
                .key(&[&k.errors, &k.bell, &k.prioritized, &k.events])
                .key(&k.activity)
                .arg(max_stalls.max(1))
                .arg(MAX_BATCH)
                .arg(&max_count)
                .arg(&max_age)
                .arg(self.events_arg())
                .query_on(&self.conn, attempted)
                .await?;
            total.requeued += requeued;
            total.buried += buried;
            if examined < MAX_BATCH {
                return Ok(total);
            }
        }
    }

    /// Whether the queue has any key in Redis: messages waiting, running
    /// or dead, or errors on record. (A queue exists in Redis only while it
    /// holds something.)
    pub async fn exists(&self) -> Result<bool> {
        // Every key but the bell (a ring alone is no queue), per shard.
        for k in &self.layout().await?.keys {
            let found: u32 = redis::cmd("EXISTS")
                .arg(&named(&k.base, QUEUE_KEYS))
                .query_on(&self.conn, || format!("looking up queue `{}`", self.name()))
                .await?;
            if found > 0 {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Dead-letter retention: keep at most `max_count` dead letters (the
    /// newest) and none buried more than `max_age` ago (`None`, the
    /// default: no limit). Applied by the scripts that bury, about a
    /// hundred letters per burial at most. Every process that buries should
    /// use the same setting. See docs/queue.md, "The queue".
    pub fn dead_retention(mut self, max_count: Option<usize>, max_age: Option<Duration>) -> Self {
        self.recording.dead = Retention { max_count, max_age };
        self
    }

    /// Records lifecycle events: every change of a message this handle
    /// makes is appended to the queue's events stream, capped near
    /// `max_len` entries; follow them with [`events`](Self::events). Turn it
    /// on for every handle that changes the queue: one without it leaves
    /// gaps. Errors on 0. See docs/queue.md, "Lifecycle events".
    pub fn record_events(mut self, max_len: usize) -> Result<Self> {
        check_count("the events stream's cap", max_len, 1..=MAX_KEPT)?;
        self.recording.events = Some(max_len);
        Ok(self)
    }

    /// Keeps the last `max_count` completed messages, and those of the last
    /// `max_age`, on the queue's completed stream, trimmed by the
    /// acknowledgement; read them with [`completed`](Self::completed).
    /// Errors when both are `None` or on a count of 0. See docs/queue.md,
    /// "Keeping completed messages".
    pub fn keep_completed(
        mut self,
        max_count: Option<usize>,
        max_age: Option<Duration>,
    ) -> Result<Self> {
        let over_a_year = max_age.is_some_and(|age| age > Duration::from_secs(366 * 86_400));
        let refusal = match max_count {
            None if max_age.is_none() => {
                "keeping completed messages needs a limit: a count, an age, or both".to_owned()
            }
            Some(0) => "keeping 0 completed messages keeps none: leave it off".to_owned(),
            Some(n) if n > MAX_KEPT => {
                format!("keeping more than {MAX_KEPT} completed messages is not bounded memory")
            }
            _ if over_a_year => {
                "keeping completed messages for more than a year is not bounded memory".to_owned()
            }
            _ => {
                self.recording.completed = Some(Retention { max_count, max_age });
                return Ok(self);
            }
        };
        Err(Error::config(refusal))
    }

    /// The events' cap as the scripts take it ("" when events are off).
    fn events_arg(&self) -> String {
        self.recording
            .events
            .map(|cap| cap.to_string())
            .unwrap_or_default()
    }

    /// Deletes a scheduled or dead message; returns whether it did. A message
    /// being processed is left to its worker (`false`): deleting it then
    /// would let that worker's claim act on a later message with the same id.
    /// Keyed messages with this id are removed under whichever key (an id
    /// is unique within its key): each partition is scanned for the id,
    /// O(messages) there.
    pub async fn remove(&self, id: &str) -> Result<bool> {
        let shards = self.layout().await?;
        let k = &shards.keys[shards.of(id)];
        let removed: i64 = scripts::REMOVE
            .key(&[&k.data, &k.schedule, &k.dead])
            .key(&[&k.errors, &k.prioritized, &k.events])
            .arg(id)
            .arg(self.events_arg())
            .query_on(&self.conn, || format!("removing message `{id}`"))
            .await?;
        Ok(removed == 1 || self.keyed().remove(id).await?)
    }

    /// Deletes the whole queue: every message in every state. (The claim
    /// counter stays, so that a worker's claim from before the purge can
    /// never match a new message pushed under the same id.) The memory is
    /// freed in the background (`UNLINK`), so a large queue does not block
    /// the server.
    pub async fn purge(&self) -> Result<()> {
        self.keyed().purge().await?;
        for k in &self.layout().await?.keys {
            redis::cmd("UNLINK")
                .arg(&named(&k.base, QUEUE_KEYS))
                .arg(&k.bell)
                .query_on::<(), _>(&self.conn, || format!("purging queue `{}`", self.name()))
                .await?;
        }
        Ok(())
    }

    /// A [`Waiter`] that blocks until this queue's doorbell rings, on its own
    /// connection opened through `connector` (a [`redis::Client`] or a
    /// cluster client).
    pub fn waiter<K: Connector>(&self, connector: K) -> Waiter<K, C> {
        let poke = format!("{}:poke:{}", self.keys.base, job::new_id());
        Waiter::new(connector, self.conn.clone(), self.keys.bell.clone(), poke)
    }
}

/// The messages without a key among `jobs`, with their place in it, by shard.
/// Script calls (each a place and its batch) in waves of at most
/// [`MAX_BATCH`] messages in all, in order: a wave goes out at once, so
/// that many small calls cost a round trip, while large batches still go
/// one after another, none waiting behind many others past a response
/// timeout.
/// Requests a call that fans out (a batch over many partitions or keyed
/// messages) has in flight at once on the caller's connection: a thousand
/// at once passed a 500 ms response timeout on a loaded machine.
pub(crate) const CALLS_AT_ONCE: usize = 64;

/// Runs `calls` [`CALLS_AT_ONCE`] at a time, a group after another (each
/// group's requests go out together), and gives their results in order.
pub(crate) async fn in_groups<F: std::future::Future>(calls: Vec<F>) -> Vec<F::Output> {
    let (mut calls, mut out) = (calls.into_iter(), Vec::new());
    loop {
        let group: Vec<F> = calls.by_ref().take(CALLS_AT_ONCE).collect();
        if group.is_empty() {
            return out;
        }
        out.extend(futures_util::future::join_all(group).await);
    }
}

fn by_shard<'a>(
    jobs: &[&'a ClaimToken],
) -> std::collections::BTreeMap<usize, Vec<(usize, &'a ClaimToken)>> {
    let mut shards = std::collections::BTreeMap::<_, Vec<_>>::new();
    for (n, job) in jobs.iter().enumerate().filter(|(_, j)| j.held.is_none()) {
        shards
            .entry(usize::from(job.shard))
            .or_default()
            .push((n, *job));
    }
    shards
}

/// Refuses a count `n` outside `range` (`what`: the operation's count).
/// Claimed keyed turns grouped by run: a run's messages (`Held::run` above
/// 0) follow its first.
fn runs_of(turns: Vec<keyed::Turn>) -> Vec<Vec<keyed::Turn>> {
    let mut runs: Vec<Vec<keyed::Turn>> = Vec::new();
    for turn in turns {
        match runs.last_mut() {
            Some(run) if turn.held.run > 0 => run.push(turn),
            _ => runs.push(vec![turn]),
        }
    }
    runs
}

fn check_count(what: &str, n: usize, range: std::ops::RangeInclusive<usize>) -> Result<()> {
    if range.contains(&n) {
        return Ok(());
    }
    let (min, max) = range.into_inner();
    Err(Error::config(format_args!(
        "{what} must be {min}..={max}, got {n}"
    )))
}

fn check_lease(lease: Duration) -> Result<()> {
    if lease < Duration::from_millis(1) || lease > crate::lock::MAX_TTL {
        return Err(Error::config(format_args!(
            "lease must be between 1 ms and {:?}, got {lease:?}",
            crate::lock::MAX_TTL
        )));
    }
    Ok(())
}

pub(crate) fn unix_ms(t: SystemTime) -> i64 {
    let ms = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
    i64::try_from(ms).unwrap_or(i64::MAX)
}

pub(crate) fn from_unix_ms(ms: i64) -> SystemTime {
    UNIX_EPOCH + span(ms)
}
