//! Drives a tower service from a [`Queue`]: the consumer loop that brings
//! fresh, delayed, retried and deferred messages back into the pipeline.
//!
//! The worker claims due messages in batches sized to its free capacity,
//! calls the service once it is ready, and settles: `Ok` acknowledges,
//! [`Outcome::Deferred`] leaves the message where the
//! [`LockLayer`](crate::LockLayer) put it, `Err` or a panic retries with
//! backoff and buries after `max_attempts`. One timer renews every lease and
//! recovers dead workers' messages. Idle, it sleeps on a timer and the
//! queue's doorbell ([`Waiter`](crate::queue::Waiter)), never polling. Redis
//! errors, shutdown and metrics: docs/worker.md, "The worker".
//!
//! ```no_run
//! # async fn demo() -> Result<(), lockgate::BoxError> {
//! use lockgate::{BoxError, Job, Queue, Worker};
//! use tower::service_fn;
//!
//! let client = redis::Client::open("redis://127.0.0.1/")?;
//! let queue: Queue<String> = Queue::new(client.get_connection_manager().await?, "emails")?;
//! let service = service_fn(|job: Job<String>| async move {
//!     println!("sending {}", *job);
//!     Ok::<_, BoxError>(())
//! });
//! Worker::new(client, queue, service)
//!     .concurrency(16)?
//!     .run_until(tokio::signal::ctrl_c())
//!     .await?;
//! # Ok(()) }
//! ```

mod call;
use call::{failure, handle, panic_message};
mod housekeeping;
use housekeeping::{heal_index, recover_expired, renew_leases, sample_depth, warn_on_eviction};
mod metrics;
mod run;
mod runs;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::Service;

use self::metrics::Count;
pub use self::metrics::{Metrics, MetricsSnapshot};
use crate::BoxError;
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::layer::HeldLock;
use crate::outcome::Outcome;
use crate::queue::{Acked, Claim, ClaimToken, Connector, Job, MAX_BATCH, Queue};

/// What the worker's tasks need of a payload type: its bounds, named once.
trait Payload: Serialize + DeserializeOwned + Send + Sync + 'static {}
impl<T: Serialize + DeserializeOwned + Send + Sync + 'static> Payload for T {}

/// What the worker's tasks need of a connection type.
trait Conn: ConnectionLike + Clone + Send + Sync + 'static {}
impl<C: ConnectionLike + Clone + Send + Sync + 'static> Conn for C {}

/// The most handlers one worker runs at once.
pub const MAX_CONCURRENCY: usize = 100_000;

/// How a worker reads a service's response: whether the message was
/// deferred (and is rescheduled already) or done. Implemented for
/// [`Outcome`] and for common plain responses (`()`, `bool`, `String`,
/// integers, `serde_json::Value`, `Option`, `Vec`), which always mean done;
/// `impl WorkerResponse for MyType {}` says "done" for a type of your own,
/// and `ServiceBuilder::map_response(|_| ())` maps a foreign type away.
pub trait WorkerResponse {
    /// The id under which the message was deferred, if it was.
    fn deferred_as(&self) -> Option<&str> {
        None
    }
}

/// Looks inside `Done`: stacked layers (a `RateLimitLayer` around a
/// `LockLayer`) answer `Done(Deferred { .. })` when the inner one deferred.
impl<R: WorkerResponse> WorkerResponse for Outcome<R> {
    fn deferred_as(&self) -> Option<&str> {
        match self {
            Outcome::Deferred { id, .. } => Some(id),
            Outcome::Done(inner) => inner.deferred_as(),
        }
    }
}

impl<R: WorkerResponse + ?Sized> WorkerResponse for Box<R> {
    fn deferred_as(&self) -> Option<&str> {
        (**self).deferred_as()
    }
}

macro_rules! done_responses {
    ($($t:ty),*) => {$( impl WorkerResponse for $t {} )*};
}
impl<R> WorkerResponse for Option<R> {}
impl<R> WorkerResponse for Vec<R> {}
impl WorkerResponse for () {}
impl WorkerResponse for serde_json::Value {}
done_responses!(
    bool, String, u8, u16, u32, u64, usize, i8, i16, i32, i64, isize
);

/// Consumes a [`Queue`] through a tower service.
pub struct Worker<T, C, K, S> {
    /// Opens the dedicated connection the idle wait blocks on.
    connector: K,
    queue: Queue<T, C>,
    service: S,
    /// Validated when set.
    config: Config,
    /// Shared with [`Worker::metrics`] handles.
    metrics: Metrics,
}

#[derive(Debug, Clone)]
struct Config {
    concurrency: usize,
    /// Lease of a claimed message; renewed every third of it.
    lease: Duration,
    /// Claimed jobs held ready beyond `concurrency`; `None`: as many.
    prefetch: Option<usize>,
    max_attempts: u32,
    max_stalls: u32,
    /// `None` for no limit.
    max_deferrals: Option<u32>,
    retry: Backoff,
    shutdown_timeout: Duration,
    /// How often the queue's depth gauges are sampled; `None`: never.
    sample_every: Option<Duration>,
    /// Whether each shard's depth is sampled too.
    sample_shards: bool,
    /// How many of a key's messages a claim or an acknowledgement takes at
    /// once (a run).
    key_batch: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            concurrency: 10,
            prefetch: None,
            lease: Duration::from_secs(30),
            max_attempts: 5,
            max_stalls: 3,
            max_deferrals: None,
            retry: Backoff::exponential(Duration::from_secs(1), Duration::from_secs(300))
                .expect("constant arguments are valid")
                .unlimited_attempts(),
            shutdown_timeout: Duration::from_secs(30),
            sample_every: Some(Duration::from_secs(10)),
            sample_shards: false,
            key_batch: DEFAULT_KEY_BATCH,
        }
    }
}

impl<T, C, K, S> std::fmt::Debug for Worker<T, C, K, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("queue", &self.queue)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<T, C, K, S> Worker<T, C, K, S>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Connector,
    S: Service<Job<T>> + Send + 'static,
    S::Response: WorkerResponse + Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    S::Future: Send + 'static,
{
    /// A worker for `queue`, passing each job to `service`; `connector` (a
    /// [`redis::Client`] or a cluster client) opens the connection the idle
    /// wait blocks on.
    ///
    /// Defaults: concurrency 10, prefetch 10, lease 30 s, 5 attempts, retries after
    /// 1 s doubling to 5 min (jittered), unlimited deferrals, 30 s shutdown
    /// timeout.
    pub fn new(connector: K, queue: Queue<T, C>, service: S) -> Self {
        // Keyed messages waiting for a lock other code holds are woken by
        // its release, heard on the worker's server.
        if let Some(client) = (&connector as &dyn std::any::Any).downcast_ref::<redis::Client>() {
            queue.wake_keys_with(client.clone());
        }
        Self {
            connector,
            queue,
            service,
            config: Config::default(),
            metrics: Metrics::default(),
        }
    }

    /// Hears releases with `listener`: a keyed message
    /// ([`PushOptions::key`](crate::PushOptions::key)) whose key's lock
    /// other code holds is claimable as soon as that lock is released. A
    /// worker made with a [`redis::Client`] opens a listener by itself; one
    /// made with a cluster client needs this, else such a key waits for the
    /// lock's expiry. A queue's handles keep the first listener given.
    pub fn wake_on_release(self, listener: crate::ReleaseListener) -> Self {
        self.queue.wake_keys_by(listener);
        self
    }

    /// Handlers running at once, at most. Errors on zero.
    pub fn concurrency(mut self, n: usize) -> Result<Self> {
        if n == 0 || n > MAX_CONCURRENCY {
            return Err(Error::config(format_args!(
                "worker concurrency must be between 1 and {MAX_CONCURRENCY}, got {n}"
            )));
        }
        self.config.concurrency = n;
        Ok(self)
    }

    /// How many claimed messages to hold ready beyond those running (default:
    /// as many as `concurrency`, at most [`MAX_BATCH`]). Claiming ahead lets
    /// the worker claim in batches under backlog, one round trip per many
    /// messages; the cost is that held messages wait for this worker rather
    /// than another idle one. `0` claims only for free handler slots.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.config.prefetch = Some(n.min(MAX_BATCH));
        self
    }

    /// How many of a key's messages a claim (its first ones in line) or an
    /// acknowledgement (its next ones) takes at once, under the key's
    /// lock, to run one after another in push order with no call between
    /// them: a busy key then pays one script per run rather than per
    /// message (see docs/keyed.md, "Runs of a key", and
    /// [`Queue::claim_runs`](crate::Queue::claim_runs)). Default 8; 1
    /// claims one at a time. A key with permits or a
    /// rate limit, or whose lock other code fences or waits for, goes on
    /// one message at a time; code waiting for the lock gets it at the
    /// run's end. Errors outside 1..=[`MAX_BATCH`].
    pub fn key_batch(mut self, n: usize) -> Result<Self> {
        if !(1..=MAX_BATCH).contains(&n) {
            return Err(Error::config(format_args!(
                "worker key_batch must be between 1 and {MAX_BATCH}, got {n}"
            )));
        }
        self.config.key_batch = n;
        Ok(self)
    }

    /// How often the worker samples its queue's counts per state into the
    /// `lockgate_queue_messages` gauges of the `metrics` facade (see
    /// [`telemetry`](crate::telemetry)), read with
    /// [`Queue::recent_stats`]: the queue's workers with the same interval
    /// read its stats about once per interval between them.
    /// Default 10 s; `None` turns sampling off. Errors under 100 ms.
    pub fn sample_every(mut self, every: Option<Duration>) -> Result<Self> {
        if every.is_some_and(|every| every < Duration::from_millis(100)) {
            return Err(Error::config(format_args!(
                "worker sampling interval must be at least 100 ms, got {every:?}"
            )));
        }
        self.config.sample_every = every;
        Ok(self)
    }

    /// Also samples each shard's counts of a queue over shards
    /// ([`Queue::shards`]) into `lockgate_queue_shard_messages` gauges
    /// (labels `queue`, `shard`, `state`), at the same interval: one stats
    /// script per shard each time.
    pub fn sample_shards(mut self) -> Self {
        self.config.sample_shards = true;
        self
    }

    /// How long a claimed message stays leased without renewal; the worker
    /// renews every third of it. A message whose worker died is handed to
    /// another about one lease later. Errors under 30 ms.
    pub fn lease(mut self, lease: Duration) -> Result<Self> {
        if lease < Duration::from_millis(30) || lease > crate::lock::MAX_TTL {
            return Err(Error::config(format_args!(
                "worker lease must be between 30 ms and {:?}, got {lease:?}",
                crate::lock::MAX_TTL
            )));
        }
        self.config.lease = lease;
        Ok(self)
    }

    /// Tries per message, the first included, before it becomes a dead
    /// letter. Errors on zero.
    pub fn max_attempts(mut self, n: u32) -> Result<Self> {
        self.config.max_attempts = at_least_one("max_attempts", n)?;
        Ok(self)
    }

    /// Lease expiries per message (its worker died or stalled while it held
    /// the message) before it becomes a dead letter, counted apart from
    /// failed attempts. Default 3: one crash expires the leases of every
    /// message the worker held, most of them innocent; 3 bounds what a
    /// poison message costs to 3 worker crashes (see docs/worker.md, "The
    /// worker"). Errors on zero.
    pub fn max_stalls(mut self, n: u32) -> Result<Self> {
        self.config.max_stalls = at_least_one("max_stalls", n)?;
        Ok(self)
    }

    /// Deferrals (for lock contention) per message before it becomes a dead
    /// letter instead of being handled again. Counted apart from attempts.
    pub fn max_deferrals(mut self, n: u32) -> Self {
        self.config.max_deferrals = Some(n);
        self
    }

    /// The wait before a failed message is tried again: the n-th retry waits
    /// [`Backoff::delay`]`(n - 1)`. The backoff's own attempt limits are not
    /// used; [`max_attempts`](Self::max_attempts) is.
    pub fn retry_backoff(mut self, backoff: Backoff) -> Self {
        self.config.retry = backoff;
        self
    }

    /// How long shutdown waits for running handlers before cancelling them
    /// and handing their messages back. Settlements already under way are
    /// not cancelled: they finish (within about a lease) before `run_until`
    /// returns.
    pub fn shutdown_timeout(mut self, d: Duration) -> Self {
        self.config.shutdown_timeout = d;
        self
    }

    /// A handle on the worker's counters, readable while it runs.
    pub fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    /// Runs until `shutdown` completes, then shuts down gracefully.
    ///
    /// Redis failures do not end the loop (they are logged and retried with
    /// backoff), except a refusal that waiting does not cure: when the
    /// server has denied the connection's user what its work needs
    /// ([`Error::is_denied`]) for 5 s without a success between, `run_until`
    /// hands back what it claimed and returns that error. It also returns an
    /// error when the service fails in `poll_ready`, which in tower means it
    /// can serve no more requests.
    pub async fn run_until(self, shutdown: impl Future) -> Result<()> {
        self.run(shutdown, false).await
    }

    /// Runs until the queue is drained, then shuts down as
    /// [`run_until`](Self::run_until) does: until a claim finds nothing
    /// due and every message this worker claimed is settled (BullMQ's
    /// `drained`). Messages delayed into the future stay where they are.
    /// For tests, scripts and batch jobs; another worker's messages in
    /// flight are not waited for.
    pub async fn run_until_idle(self) -> Result<()> {
        self.run(std::future::pending::<()>(), true).await
    }

    /// The loop of [`run_until`](Self::run_until); `until_idle`: also stop
    /// once the queue is drained.
    async fn run(self, shutdown: impl Future, until_idle: bool) -> Result<()> {
        warn_on_eviction(&self.queue).await;
        let shared = Arc::new(Shared::new(self.queue.clone(), self.config, self.metrics));
        // Aborted when run_until ends or is dropped: housekeeping must not
        // keep renewing the leases of messages nobody handles any more.
        // Renewal has a task of its own: it must never wait for a recovery
        // sweep, whose length grows with the queue (issue 36).
        let mut background = JoinSet::new();
        background.spawn(renew_leases(shared.clone()));
        background.spawn(recover_expired(shared.clone()));
        let connector = Arc::new(self.connector);
        background.spawn(heal_index(shared.clone(), connector.clone()));
        shared.metrics.register(self.queue.name());
        if let Some(every) = shared.config.sample_every {
            let metrics = shared.metrics.clone();
            let sampling = (every, shared.config.sample_shards);
            background.spawn(sample_depth(self.queue.clone(), metrics, sampling));
        }
        let (acks, ack_queue) = mpsc::unbounded_channel();
        let (ends, end_queue) = mpsc::unbounded_channel();
        let acker = tokio::spawn(acker(shared.clone(), ack_queue));
        let ender = tokio::spawn(run_ender(shared.clone(), end_queue));
        let acks = AckQueue { acks, ends };
        let mut run = run::Run {
            waiter: self.queue.waiter(connector),
            service: self.service,
            shared,
            acks,
            tasks: JoinSet::new(),
            buffer: VecDeque::new(),
            claimed_keyed: std::collections::HashSet::new(),
            failures: 0,
            claims_denied: None,
            waits_denied: None,
            maybe_due: true,
            next_due: None,
            until_idle,
            last_look: false,
            keyed_capped: false,
        };
        // The caller's `shutdown` is polled beside the loop, always with
        // this task's waker, and only flags the stop: polled now and then
        // by the loop instead, a future that shares something with a claim
        // (a handle's first look at its queue, say) could wait on a claim
        // that waits on it.
        let (stop, stopped) = watch::channel(false);
        let watch_shutdown = async move {
            shutdown.await;
            let _ = stop.send(true);
            std::future::pending::<std::convert::Infallible>().await
        };
        let mut stopped = std::pin::pin!(async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|stop| *stop).await;
        });
        let work = async {
            let result = loop {
                // Checked without waiting on every round, so that a steady
                // backlog (which never waits) still notices a shutdown.
                if (&mut stopped).now_or_never().is_some() {
                    break Ok(());
                }
                if let Some(result) = run.round(&mut stopped).await {
                    break result;
                }
            };
            run.finish().await;
            result
        };
        let result = tokio::select! {
            result = work => result,
            never = watch_shutdown => match never {},
        };
        // Every handler has finished: let the writers write what is queued.
        let _ = tokio::join!(acker, ender);
        drop(background);
        flush_counts(&self.queue).await;
        result
    }
}

/// On a Redis Cluster, copies the counts of the keyed partitions a worker
/// changed last, for `stats`, before it returns (see
/// [`Queue::flush_counts`]).
async fn flush_counts<T, C>(queue: &Queue<T, C>)
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    if let Err(error) = queue.flush_counts().await {
        tracing::warn!(queue = %queue.name(), %error, "could not copy the counts of the keyed partitions this worker changed last; the queue's stats miss them until their next change");
    }
}

/// `n`, or an error naming the setting when it is zero.
fn at_least_one(setting: &str, n: u32) -> Result<u32> {
    match n {
        0 => Err(Error::config(format_args!("{setting} must be at least 1"))),
        n => Ok(n),
    }
}

/// State shared by the claim loop, the handler tasks and housekeeping.
struct Shared<T, C> {
    queue: Queue<T, C>,
    config: Config,
    metrics: Metrics,
    /// Claims of messages being handled (or buffered), by task sequence
    /// number.
    in_flight: Mutex<HashMap<u64, InFlight>>,
    /// Set at shutdown, once the shutdown timeout has passed: handlers still
    /// running are cancelled (their messages handed back); settlements under
    /// way are not.
    cancel: watch::Sender<bool>,
    /// A hand-back at shutdown got no answer in time: the connection hangs,
    /// so the rest are not tried (they come back after their lease) and
    /// shutdown still ends.
    hand_back_stalled: std::sync::atomic::AtomicBool,
    /// The sequence number of the next claim tracked in `in_flight`.
    next_seq: AtomicU64,
    /// The locks of keyed messages, as the handler sees them
    /// ([`HeldLock`]): their fences are issued through it.
    locker: crate::Locker<C>,
    /// Keyed messages claimed by the ack of the one before them, under the
    /// same lock, tracked (so renewed) already: the loop starts them first.
    continued: Mutex<VecDeque<(u64, Job<T>)>>,
    /// Wakes the idle loop when a message is continued.
    continued_ready: tokio::sync::Notify,
    /// The runs of keyed messages at work (see `runs.rs`).
    runs: runs::Runs<T>,
    /// Set when the loop stops: acks no longer claim the next message.
    stopping: std::sync::atomic::AtomicBool,
    /// Since when a keyed turn the loop claimed has waited in its buffer
    /// for a slot, if one does (see [`Shared::yields`]).
    key_waits_since: Mutex<Option<Instant>>,
    /// The handler slots (the loop's permits): a key runs on past
    /// `MAX_RUN` messages while one is free.
    slots: Arc<Semaphore>,
}

/// [`Worker::key_batch`]'s default.
const DEFAULT_KEY_BATCH: usize = 8;

/// How long one hand-back at shutdown may take before the connection is
/// taken as hung.
const HAND_BACK_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a keyed turn claimed here may wait for a slot before a busy
/// key's run lets its key go for it (see `Shared::yields`): longer than
/// a slot takes to turn over under no-op handlers, where the buffer is
/// what hides a claim's round trip, and short beside a hot key's run.
const YIELD_AFTER: Duration = Duration::from_millis(5);

/// A claim being handled, as housekeeping sees it.
struct InFlight {
    token: ClaimToken,
    /// A renewal found the claim gone. Housekeeping only marks it: the
    /// handler's task decides, once the call returns, whether anything was
    /// lost (a deferral in place of this very claim also ends it, and may
    /// have raced the renewal).
    refused: bool,
    /// The lease runs at least until then: the moment the call that set
    /// it (the claim, the last renewal) was sent, plus the lease. The
    /// server's deadline is later (it counts from when the call arrived).
    leased_until: Instant,
    /// A keyed message's lock as its handler sees it, once started: marked
    /// lost when a renewal finds the claim gone, and when the call returns.
    held: Option<HeldLock>,
}

/// What to write back for a handled message.
enum Settlement {
    /// Whether the message counts as done (not so when deferred as a copy).
    Ack(bool),
    Retry(String),
    /// `failed`: failed for the last time (else deferred too often, which is
    /// not a failed attempt).
    Bury {
        error: String,
        failed: bool,
    },
}

impl<T: Payload, C: Conn> Shared<T, C> {
    /// The state of a worker on `queue` that has not started yet.
    fn new(queue: Queue<T, C>, config: Config, metrics: Metrics) -> Self {
        let locker = crate::Locker::for_queue(queue.connection().clone(), queue.prefix_str());
        Shared {
            slots: Arc::new(Semaphore::new(config.concurrency)),
            queue,
            config,
            metrics,
            in_flight: Mutex::new(HashMap::new()),
            cancel: watch::Sender::new(false),
            hand_back_stalled: std::sync::atomic::AtomicBool::new(false),
            next_seq: AtomicU64::new(0),
            locker,
            continued: Mutex::new(VecDeque::new()),
            continued_ready: tokio::sync::Notify::new(),
            runs: Mutex::new(HashMap::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            key_waits_since: Mutex::new(None),
        }
    }

    /// Whether a busy key's run, whose message holds a slot, lets its key
    /// go at its end rather than read ahead or claim the key's next run:
    /// when a key this worker claimed has waited [`YIELD_AFTER`] for a
    /// slot and none is free. Else every slot may stay with a key that
    /// keeps running, and the waiting key with nothing (its lock held
    /// here) while other workers have slots free. The key let go is
    /// claimed again where a slot is free.
    fn yields(&self) -> bool {
        let since = *self
            .key_waits_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        since.is_some_and(|since| since.elapsed() >= YIELD_AFTER)
            && self.slots.available_permits() == 0
    }

    /// Notes whether a keyed turn waits in the loop's buffer for a slot
    /// (see [`yields`](Self::yields)).
    fn note_key_waits(&self, waits: bool) {
        let mut since = self
            .key_waits_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match waits {
            false => *since = None,
            true => drop(since.get_or_insert_with(Instant::now)),
        }
    }

    /// Tracks `job`'s claim, leased until `leased_until`, under the next
    /// sequence number, which it returns: from now on it is renewed.
    fn track(
        &self,
        in_flight: &mut HashMap<u64, InFlight>,
        job: &Job<T>,
        leased_until: Instant,
    ) -> u64 {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let token = job.claim_ref().to_token();
        let flight = InFlight {
            token,
            refused: false,
            leased_until,
            held: None,
        };
        in_flight.insert(seq, flight);
        seq
    }

    fn continued(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, Job<T>)>> {
        // Plain pushes and pops: poisoning cannot leave it inconsistent.
        self.continued.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InFlight>> {
        // A panic while holding this lock cannot leave the map inconsistent
        // (every operation is a single insert/remove/clone), so poisoning is
        // ignored.
        self.in_flight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues an acknowledgement for the acker; writes it here when the
    /// acker is gone.
    async fn queue_ack(&self, acks: &AckQueue<T>, token: ClaimToken, done: bool) {
        if let Err(mpsc::error::SendError(ack)) = acks.acks.send((token, done)) {
            self.ack(&[ack]).await;
        }
    }

    /// Runs `write` until the server answers, retrying Redis errors with a
    /// growing pause for about a lease; `None` if it never answered (the
    /// messages come back after their lease). With the answer comes whether
    /// an earlier attempt failed in transport: the server may have run it
    /// all the same (its reply was lost), so a refusal now is no proof of a
    /// lost lease.
    async fn persist<R, F>(
        &self,
        what: impl Fn() -> String,
        mut write: impl FnMut() -> F,
    ) -> Option<(R, bool)>
    where
        F: Future<Output = Result<R>>,
    {
        let mut pause = Duration::from_millis(50);
        let give_up = Instant::now() + self.config.lease;
        let mut resent = false;
        loop {
            let error = match write().await {
                Ok(answer) => return Some((answer, resent)),
                Err(error) => error,
            };
            self.metrics.count(Count::RedisErrors);
            if Instant::now() + pause >= give_up {
                tracing::error!(%error, "could not {}; it comes back after its lease", what());
                return None;
            }
            resent |= may_have_run(&error);
            tracing::warn!(%error, "could not {}; retrying", what());
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// Acknowledges messages, each with whether it counts as done. A message
    /// gone after an attempt whose reply was lost was completed by that
    /// attempt; one gone otherwise, or under another claim, is a lost lease.
    ///
    /// Keyed messages are written each on its own (one script each, all at
    /// once), so that one that fails is resent alone: a resent batch would
    /// find the others gone and count them lost.
    async fn ack(&self, batch: &[(ClaimToken, bool)]) {
        let (keyed, plain): (Vec<_>, Vec<_>) =
            (batch.iter()).partition(|(token, _)| token.held_lock().is_some());
        let keyed = keyed.into_iter().map(|ack| self.ack_together(vec![ack]));
        let plain = async {
            if !plain.is_empty() {
                self.ack_together(plain).await;
            }
        };
        futures_util::future::join(plain, futures_util::future::join_all(keyed)).await;
    }

    /// Acknowledges `batch` in one call, resent whole when it fails.
    async fn ack_together(&self, batch: Vec<&(ClaimToken, bool)>) {
        let what = || format!("acknowledge {} message(s)", batch.len());
        let write = || self.queue.ack_claims(batch.iter().map(|(token, _)| token));
        let Some((acked, resent)) = self.persist(what, write).await else {
            return;
        };
        for ((token, done), acked) in batch.into_iter().zip(acked) {
            match acked {
                Acked::Done => {}
                Acked::Gone if resent => {
                    tracing::debug!(id = %token.id(), "acknowledged by an earlier attempt whose reply was lost");
                }
                Acked::Gone => {
                    self.metrics.count(Count::LostLeases);
                    tracing::warn!(id = %token.id(), "the message was gone before it was acknowledged (removed, or handled elsewhere after its lease ran out)");
                    continue;
                }
                Acked::NotHeld => {
                    self.metrics.count(Count::LostLeases);
                    tracing::warn!(id = %token.id(), "lease ran out before the message was acknowledged; it is handled again elsewhere");
                    continue;
                }
            }
            if *done {
                self.metrics.count(Count::Done);
            }
        }
    }

    /// Writes a settlement (see `persist`); if it fails for good, the
    /// message comes back when its lease runs out.
    async fn settle(&self, token: &ClaimToken, settlement: Settlement) {
        let what = || format!("settle message {}", token.id());
        let (count, written) = match &settlement {
            Settlement::Ack(done) => return self.ack(&[(token.clone(), *done)]).await,
            Settlement::Retry(error) => {
                let delay = self.config.retry.delay(token.attempt() - 1);
                let write =
                    || async move { Ok(self.queue.retry(token, delay, error).await?.is_some()) };
                (Count::Retried, self.persist(what, write).await)
            }
            Settlement::Bury { error, failed } => {
                let write = || self.queue.bury_with(token, error, *failed);
                (Count::Dead, self.persist(what, write).await)
            }
        };
        match written {
            Some((true, _)) => self.metrics.count(count),
            Some((false, true)) => {
                self.metrics.count(Count::Unconfirmed);
                tracing::info!(id = %token.id(), "settlement refused after an earlier attempt's reply was lost: it may have been applied by the earlier attempt, or the lease ran out in between");
            }
            Some((false, false)) => {
                self.metrics.count(Count::LostLeases);
                tracing::warn!(id = %token.id(), "lease ran out before the message was settled; it is handled again elsewhere");
            }
            None => {}
        }
    }

    /// Settles a message that is not passed to the handler, in a task of
    /// its own that holds the handler slot until it is done.
    fn spawn_settle(
        self: &Arc<Self>,
        tasks: &mut JoinSet<()>,
        seq: u64,
        token: ClaimToken,
        settlement: Settlement,
        permit: OwnedSemaphorePermit,
    ) {
        self.in_flight().remove(&seq);
        let shared = self.clone();
        tasks.spawn(async move {
            shared.cut_run(seq, &token).await;
            shared.settle(&token, settlement).await;
            drop(permit);
        });
    }

    /// Hands a claim back at shutdown, due now; logs a failure (the message
    /// then comes back after its lease).
    async fn release(&self, token: &ClaimToken) {
        use std::sync::atomic::Ordering;
        if self.hand_back_stalled.load(Ordering::Relaxed) {
            return;
        }
        match tokio::time::timeout(HAND_BACK_TIMEOUT, self.queue.release(token)).await {
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                self.metrics.count(Count::RedisErrors);
                tracing::warn!(id = %token.id(), %error, "shutdown: could not hand a message back; it comes back after its lease");
            }
            Err(_) => {
                self.hand_back_stalled.store(true, Ordering::Relaxed);
                self.metrics.count(Count::RedisErrors);
                tracing::warn!(id = %token.id(), "shutdown: no answer to a hand-back within {HAND_BACK_TIMEOUT:?}; the messages not handed back come back after their lease");
            }
        }
    }

    /// Whether a buffered job's lease ran out before it could start (a
    /// renewal found its claim gone): then it is not started, and counted.
    fn lost_while_buffered(&self, seq: u64, token: &ClaimToken) -> bool {
        let mut in_flight = self.in_flight();
        if !in_flight.get(&seq).is_some_and(|f| f.refused) {
            return false;
        }
        in_flight.remove(&seq);
        drop(in_flight);
        self.drop_run(seq);
        self.metrics.count(Count::LostLeases);
        tracing::warn!(id = %token.id(), "lease ran out before the handler started; the message will be handled again");
        true
    }

    /// The lock a keyed job's handler holds, as [`HeldLock::current`] shows
    /// it during the call; tracked with the job's claim so that a renewal
    /// that finds the claim gone marks it lost. `None` for other jobs.
    fn held_lock(&self, seq: u64, token: &ClaimToken) -> Option<HeldLock> {
        let (key, lock_token, permits) = token.held_lock()?;
        let permits = (permits > 0).then_some(permits);
        let lock_token = (lock_token, token.continues_run());
        let ticket = self.locker.held_ticket(key.to_owned(), lock_token, permits);
        let issuer = crate::layer::fence_issuer(self.locker.clone());
        let held = HeldLock::of_claim(ticket, issuer);
        if let Some(flight) = self.in_flight().get_mut(&seq) {
            flight.held = Some(held.clone());
        }
        Some(held)
    }

    /// Whether a buffered job may start: a handler never starts on a lease
    /// with less than half its length left, since the next renewal may be
    /// a third of a lease away and its round trip must fit in what is
    /// left. A job with less is renewed first, here; one whose claim that
    /// renewal finds gone is dropped, counted. `Err` when the renewal
    /// failed: the job stays tracked, for the caller to try again.
    async fn leased_for_start(&self, seq: u64, token: &ClaimToken) -> Result<bool> {
        let lease = self.config.lease;
        let left = (self.in_flight().get(&seq))
            .map(|f| f.leased_until.saturating_duration_since(Instant::now()));
        if left.is_none_or(|left| left >= lease / 2) {
            return Ok(true);
        }
        let sent = Instant::now();
        let renewed = self.queue.renew(&[token], lease).await;
        if let Some(error) = renewed.errors.into_iter().next() {
            self.metrics.count(Count::RedisErrors);
            return Err(error);
        }
        let mut in_flight = self.in_flight();
        if renewed.held.first() == Some(&Some(true)) {
            if let Some(flight) = in_flight.get_mut(&seq) {
                flight.leased_until = flight.leased_until.max(sent + lease);
            }
            return Ok(true);
        }
        in_flight.remove(&seq);
        drop(in_flight);
        self.drop_run(seq);
        self.metrics.count(Count::LostLeases);
        tracing::warn!(id = %token.id(), "lease ran out before the handler started; the message will be handled again");
        Ok(false)
    }

    /// Renews the leases of the claims in flight (the snapshot's: a claim
    /// tracked later has a whole lease already). A call that fails leaves
    /// its claims to the next tick; the others are renewed all the same.
    async fn renew_in_flight(&self) {
        let lease = self.config.lease;
        let in_flight: Vec<(u64, ClaimToken)> = self
            .in_flight()
            .iter()
            .filter(|(_, f)| !f.refused)
            .map(|(seq, f)| (*seq, f.token.clone()))
            .collect();
        if in_flight.is_empty() {
            return;
        }
        let sent = Instant::now();
        let tokens: Vec<&ClaimToken> = in_flight.iter().map(|(_, token)| token).collect();
        let renewed = self.queue.renew(&tokens, lease).await;
        for error in &renewed.errors {
            self.metrics.count(Count::RedisErrors);
            tracing::warn!(%error, "could not renew leases; retrying at the next tick");
        }
        let mut flights = self.in_flight();
        for ((seq, _), held) in in_flight.iter().zip(renewed.held) {
            // Settled since the snapshot: not lost, nor is a claim the
            // handler deferred in place (the handler's task decides when
            // its call returns); so a refusal is only marked.
            let Some(flight) = flights.get_mut(seq) else {
                continue;
            };
            match held {
                Some(true) => flight.leased_until = flight.leased_until.max(sent + lease),
                Some(false) => {
                    flight.refused = true;
                    if let Some(held) = &flight.held {
                        held.mark_lost();
                    }
                }
                None => {}
            }
        }
    }

    /// Waits for running handlers up to the shutdown timeout; then cancels
    /// the handlers still running and hands their messages back, while
    /// settlements already under way finish (within about a lease, the time
    /// a settlement retries for).
    async fn drain(&self, mut tasks: JoinSet<()>) {
        let join = async |tasks: &mut JoinSet<()>| while tasks.join_next().await.is_some() {};
        let joined = tokio::time::timeout(self.config.shutdown_timeout, join(&mut tasks)).await;
        if joined.is_ok() {
            return;
        }
        // Each task drops its handler call and hands its message back.
        self.cancel.send_replace(true);
        let grace = self.config.lease + Duration::from_secs(1);
        if tokio::time::timeout(grace, join(&mut tasks)).await.is_err() {
            tasks.abort_all();
            join(&mut tasks).await;
        }
        // Claims of tasks aborted before they reached their settlement: the
        // runs they leave settled first.
        self.cut_left_runs().await;
        let unfinished: Vec<ClaimToken> = self.in_flight().drain().map(|(_, f)| f.token).collect();
        for token in &unfinished {
            self.release(token).await;
        }
        tracing::info!(queue = %self.queue.name(), "shutdown: cancelled handlers that outlived the shutdown timeout");
    }
}

/// Writes waiting to be batched, each kind by a task of its own (neither
/// waits for the other's retries): acknowledgements, and whether each
/// counts as done (not so for a message deferred by pushing it as a new
/// message); the ends of keyed runs, each answered on its channel.
struct AckQueue<T> {
    acks: mpsc::UnboundedSender<(ClaimToken, bool)>,
    ends: mpsc::UnboundedSender<runs::RunEnding<T>>,
}

impl<T> Clone for AckQueue<T> {
    fn clone(&self) -> Self {
        AckQueue {
            acks: self.acks.clone(),
            ends: self.ends.clone(),
        }
    }
}

/// Writes acknowledgements in batches: everything queued while the previous
/// batch was in flight goes in the next, one round trip for many messages.
async fn acker<T: Payload, C: Conn>(
    shared: Arc<Shared<T, C>>,
    mut queued: mpsc::UnboundedReceiver<(ClaimToken, bool)>,
) {
    let mut batch = Vec::new();
    while queued.recv_many(&mut batch, MAX_BATCH).await > 0 {
        shared.ack(&batch).await;
        batch.clear();
    }
}

/// Writes the ends of keyed runs in batches, as the acker does
/// acknowledgements: on one server in one script call, however many keys.
async fn run_ender<T: Payload, C: Conn>(
    shared: Arc<Shared<T, C>>,
    mut queued: mpsc::UnboundedReceiver<runs::RunEnding<T>>,
) {
    let mut batch = Vec::new();
    while queued.recv_many(&mut batch, MAX_BATCH).await > 0 {
        shared.end_runs(std::mem::take(&mut batch)).await;
    }
}

/// Whether a failed settlement may have run on the server all the same:
/// only when no answer came (a timeout, a dropped connection, an I/O
/// error). An error reply (`READONLY`, `LOADING`, `NOPERM`, `OOM`, ...) or a
/// refused connection says the script did not run, so a later refusal is a
/// real lost lease, not a reply lost on the way.
fn may_have_run(error: &Error) -> bool {
    error.redis_error().is_some_and(crate::script::may_have_run)
}
