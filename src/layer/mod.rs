//! Middleware that runs a handler while holding a per-key distributed lock.
//!
//! [`LockLayer`] wraps any tower service. For each request it asks a key
//! function for the request's key (`None`: no lock needed), takes the lock
//! (or one of n permits), calls the inner service holding it, and releases
//! it when the call returns, fails, panics or is dropped. The lock is renewed
//! every third of its TTL; a lost lock fires [`HeldLock::lost`] and fails the
//! call with [`LockLost`] (see [`OnLost`]). [`HeldLock::current`] gives the
//! handler the key and its fencing token.
//!
//! When the key is busy, the [`OnConflict`] strategy decides: fail at once
//! with [`Contended`](crate::Contended) (which says when to retry), retry
//! with jittered backoff (woken by the release), or defer the message into a
//! [`Queue`](crate::Queue), answering [`Outcome::Deferred`](crate::Outcome);
//! or retry first, then fail or defer. The watchdog's exact rules, the
//! retry budget and wake on release: docs/layer.md, "The LockLayer".
//!
//! # Example
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), lockgate::BoxError> {
//! # let server = lockgate::testing::RedisServer::start()?;
//! # let conn = server.connection_manager().await?;
//! use std::time::Duration;
//! use lockgate::{Backoff, BoxError, LockLayer, Locker, OnConflict, Outcome};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! #[derive(Debug)]
//! struct Order { account: String, amount: u64 }
//!
//! async fn handle(order: Order) -> Result<u64, BoxError> {
//!     // At most one handler per account runs at any time, cluster-wide.
//!     Ok(order.amount)
//! }
//!
//! let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
//! let backoff = Backoff::exponential(Duration::from_millis(10), Duration::from_millis(200))?;
//! let service = ServiceBuilder::new()
//!     .layer(
//!         LockLayer::new(locker, |o: &Order| o.account.clone())
//!             .on_conflict(OnConflict::retry(backoff.max_attempts(5)).then_fail()),
//!     )
//!     .service_fn(handle);
//!
//! let outcome = service.oneshot(Order { account: "acc-1".into(), amount: 7 }).await?;
//! assert_eq!(outcome, Outcome::Done(7));
//! # Ok(()) }
//! ```

mod contend;
mod context;
pub mod error;
mod future;
mod guard;
mod local;
mod message_id;
mod rate;
mod service;
mod strategy;

use std::sync::Arc;

pub use self::context::HeldLock;
pub(crate) use self::context::fence_issuer;
pub use self::error::{ClaimLost, LockLost, TooManyDeferrals};
pub use self::future::ResponseFuture;
pub use self::guard::LockGuard;
pub use self::rate::{RateLimit, RateLimitLayer, RateSlot};
pub use self::service::Lock;
pub use self::strategy::{Defer, DeferDelay, Fail, GiveUp, OnConflict};

/// Calls `call` (a service's `call`: synchronously, as a worker does) with
/// `id` as the message's id for the first [`LockLayer`]
/// or [`RateLimitLayer`] its request passes: if that layer defers the
/// request into a queue, the message is pushed under `id` instead of a
/// fresh one.
///
/// For consumers of a broker that redelivers what was not acknowledged
/// (NATS JetStream, SQS, Kafka): give each message its broker identity, and
/// a copy redelivered after a crash between the deferral and the
/// acknowledgement is not pushed twice ([`Queue::push_with`] adds nothing
/// for an id that exists); the layer answers [`Outcome::Deferred`] either
/// way. See docs/worker.md, "The worker" (a broker in front).
///
/// ```no_run
/// # async fn demo<S: tower::Service<String>>(mut service: S) -> Result<(), S::Error> {
/// use tower::ServiceExt;
///
/// let ready = service.ready().await?;
/// let outcome = lockgate::layer::with_message_id("orders:42", || ready.call("hi".into())).await?;
/// # Ok(()) }
/// ```
///
/// [`Queue::push_with`]: crate::Queue::push_with
/// [`Outcome::Deferred`]: crate::Outcome::Deferred
pub fn with_message_id<R>(id: impl Into<String>, call: impl FnOnce() -> R) -> R {
    message_id::provide(Some(id.into()), call)
}
use crate::lock::Locker;

/// What happens to a running handler whose lock was found lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLost {
    /// Let the handler finish (it can watch [`HeldLock::lost`] and stop
    /// early), then fail the call with [`LockLost`] `{ completed: true }`.
    #[default]
    Report,
    /// Drop the handler's future at once and fail the call with
    /// [`LockLost`] `{ completed: false }`.
    Cancel,
}

/// A request's lock key: a string, or `None` for "this request needs no
/// lock". Implemented for `String`, `&'static str`, integers, and `Option`s
/// of those. (A key borrowed from the request, `&str`, cannot outlive the
/// key function's borrow: return `req.key.clone()`.)
pub trait LockKey {
    /// The key, or `None` to call through without a lock.
    fn into_lock_key(self) -> Option<String>;

    /// The key with the number of permits this request's key admits, when
    /// the key function chooses it ([`Permits`]); `None` as the count
    /// leaves the layer's own ([`LockLayer::permits`], or a lock).
    fn into_lock_key_and_permits(self) -> Option<(String, Option<u32>)>
    where
        Self: Sized,
    {
        self.into_lock_key().map(|key| (key, None))
    }
}

/// A key with its own number of permits, returned by a key function: at
/// most `permits` calls with this key run at a time, cluster-wide (see
/// [`LockLayer::permits`]). For limits that differ by key, such as tenants
/// on different plans:
///
/// ```
/// # struct Job { tenant: String, premium: bool }
/// use lockgate::layer::Permits;
/// let key_fn = |job: &Job| Permits::new(job.tenant.clone(), if job.premium { 8 } else { 2 });
/// ```
///
/// A count of 0, or above [`MAX_PERMITS`](crate::lock::permits::MAX_PERMITS),
/// fails the call with [`Error::Config`](crate::Error::Config).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permits<K> {
    key: K,
    permits: u32,
}

impl<K: LockKey> Permits<K> {
    /// `key`, admitting `permits` holders at a time.
    pub fn new(key: K, permits: u32) -> Self {
        Self { key, permits }
    }
}

impl<K: LockKey> LockKey for Permits<K> {
    fn into_lock_key(self) -> Option<String> {
        self.key.into_lock_key()
    }

    fn into_lock_key_and_permits(self) -> Option<(String, Option<u32>)> {
        let permits = self.permits;
        self.key.into_lock_key().map(|key| (key, Some(permits)))
    }
}

impl LockKey for String {
    fn into_lock_key(self) -> Option<String> {
        Some(self)
    }
}

impl<K: LockKey> LockKey for Option<K> {
    fn into_lock_key(self) -> Option<String> {
        self.and_then(LockKey::into_lock_key)
    }

    fn into_lock_key_and_permits(self) -> Option<(String, Option<u32>)> {
        self.and_then(LockKey::into_lock_key_and_permits)
    }
}

/// Keys that are their `Display` text.
macro_rules! display_keys {
    ($($t:ty),*) => {$(
        impl LockKey for $t {
            fn into_lock_key(self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )*};
}
display_keys!(&'static str);
display_keys!(
    u8, u16, u32, u64, u128, usize, i8, i16, i32, i64, i128, isize
);

/// Wraps a service so that each call holds the lock of its request's key.
///
/// # A closure handler in a spawned task
///
/// A closure whose `async` block's output is inferred, called through the
/// layer inside `tokio::spawn`, does not compile ("implementation of
/// `From` is not general enough"): inside the spawned future the compiler
/// loses the `'static` of the block's `BoxError` and cannot prove the
/// layer's `S::Error: Into<BoxError>` for every lifetime. Every tower
/// middleware that boxes errors has that bound (tower's own `Timeout`
/// fails the same way); it is a limitation of rustc, not of the layer.
///
/// ```compile_fail
/// # async fn demo(locker: lockgate::Locker<redis::aio::ConnectionManager>) {
/// use lockgate::{BoxError, LockLayer};
/// use tower::{ServiceBuilder, ServiceExt};
/// let svc = ServiceBuilder::new()
///     .layer(LockLayer::new(locker, |key: &String| key.clone()))
///     .service_fn(|_: String| async { Ok::<_, BoxError>(()) });
/// tokio::spawn(async move { svc.oneshot("k".to_string()).await });
/// # }
/// ```
///
/// Name the handler (`async fn handle(req: Req) -> Result<R, BoxError>`,
/// then `.service_fn(handle)`), or call it with `svc.ready().await?.call(req)`
/// in the spawned task: both compile (`tests/integration/spawned_closure.rs`).
///
/// Cloning the layer is cheap: clones share the [`Locker`] (and its
/// connection), the key function, the strategy, and (under `retry`) the
/// per-key FIFO in which this process's calls for one key wait their turn
/// before asking Redis. Locks are distributed:
/// two layers on two connections, in two processes, exclude each other as
/// long as they use the same Redis and key prefix.
pub struct LockLayer<C, F, D = Fail> {
    locker: Locker<C>,
    key_fn: Arc<F>,
    on_conflict: OnConflict<D>,
    on_lost: OnLost,
    /// This process's waiters per key (used under `retry`).
    local: Arc<local::LocalQueues>,
    /// What wakes waiters under `retry` when the key is released.
    wake: Wake,
    /// Issues fences for `HeldLock::fence` (made on first use: it needs
    /// the connection bounds the constructors do not ask for).
    issue_fence: std::sync::OnceLock<context::IssueFence>,
    /// Permits per key (`None`: a lock), unless the key says otherwise.
    permits: Option<u32>,
    /// The layer's instruments in the `metrics` facade, registered at the
    /// first call (shared by the layer's clones).
    instruments: Arc<std::sync::OnceLock<crate::telemetry::LockInstruments>>,
}

/// What wakes a layer's waiters under `retry`.
#[derive(Debug, Clone)]
pub(crate) enum Wake {
    /// The locker's own listener, if it has one (see `Locker::connect`);
    /// else nothing: waiters poll.
    Locker,
    Listener(crate::ReleaseListener),
    /// Nothing: waiters poll (`LockLayer::poll_only`).
    Poll,
}

impl Wake {
    /// The listener to wait on now, if any (`None`: poll).
    pub(crate) fn listener<C>(&self, locker: &Locker<C>) -> Option<crate::ReleaseListener>
    where
        C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    {
        match self {
            Wake::Locker => locker.release_listener(),
            Wake::Listener(listener) => Some(listener.clone()),
            Wake::Poll => None,
        }
    }
}

impl<C: Clone, F, D: Clone> Clone for LockLayer<C, F, D> {
    fn clone(&self) -> Self {
        Self {
            locker: self.locker.clone(),
            key_fn: self.key_fn.clone(),
            on_conflict: self.on_conflict.clone(),
            on_lost: self.on_lost,
            local: self.local.clone(),
            wake: self.wake.clone(),
            issue_fence: self.issue_fence.clone(),
            permits: self.permits,
            instruments: self.instruments.clone(),
        }
    }
}

impl<C, F, D: std::fmt::Debug> std::fmt::Debug for LockLayer<C, F, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockLayer")
            .field("locker", &self.locker)
            .field("on_conflict", &self.on_conflict)
            .field("on_lost", &self.on_lost)
            .field("permits", &self.permits)
            .finish_non_exhaustive()
    }
}

impl<C, F> LockLayer<C, F, Fail> {
    /// Locks each request on the key `key_fn` returns for it. Fails at once
    /// on a busy key until [`on_conflict`](Self::on_conflict) says otherwise.
    pub fn new(locker: Locker<C>, key_fn: F) -> Self {
        Self {
            locker,
            key_fn: Arc::new(key_fn),
            on_conflict: OnConflict::fail(),
            on_lost: OnLost::default(),
            local: Default::default(),
            wake: Wake::Locker,
            issue_fence: Default::default(),
            permits: None,
            instruments: Default::default(),
        }
    }
}

impl<C, F, D> LockLayer<C, F, D> {
    /// Sets what happens when a request's key is busy.
    pub fn on_conflict<D2>(self, on_conflict: OnConflict<D2>) -> LockLayer<C, F, D2> {
        LockLayer {
            locker: self.locker,
            key_fn: self.key_fn,
            on_conflict,
            on_lost: self.on_lost,
            local: self.local,
            wake: self.wake,
            issue_fence: self.issue_fence,
            permits: self.permits,
            instruments: self.instruments,
        }
    }

    /// Sets what happens to a handler whose lock is lost while it runs.
    pub fn on_lost(mut self, on_lost: OnLost) -> Self {
        self.on_lost = on_lost;
        self
    }

    /// Wakes waiters under [`OnConflict::retry`] when the lock they wait
    /// for is released, by any process, instead of polling with backoff.
    ///
    /// The backoff still bounds the wait, by time (see
    /// [`Backoff::budget`](crate::Backoff::budget)); while the listener's
    /// connection is down, waiters poll with it. A locker made by
    /// [`Locker::connect`] or [`Locker::connect_cluster`] brings its own
    /// listener, used by default: call this only to share one listener
    /// between lockers made by [`Locker::new`], or to use another
    /// connection. See docs/layer.md, "The LockLayer" (wake on release).
    pub fn wake_on_release(mut self, listener: crate::ReleaseListener) -> Self {
        self.wake = Wake::Listener(listener);
        self
    }

    /// Waiters under [`OnConflict::retry`] poll with the backoff, even when
    /// the locker has a release listener (see
    /// [`wake_on_release`](Self::wake_on_release)). For tests and
    /// comparisons; waking is cheaper and faster.
    pub fn poll_only(mut self) -> Self {
        self.wake = Wake::Poll;
        self
    }

    /// Admits up to `permits` concurrent calls per key, cluster-wide,
    /// instead of one: a semaphore per key (see
    /// [`lock::permits`](crate::lock::permits)). A key function that
    /// returns [`Permits`] sets the count per request instead.
    ///
    /// Everything else is as for a lock (lease, watchdog, release,
    /// [`HeldLock`], the strategy when all are taken). One key shared by
    /// every call makes a global limit:
    /// `LockLayer::new(locker, |_: &Job| "emails").permits(20)`. See
    /// docs/limits.md, "Permits". Errors on 0, or more than
    /// [`MAX_PERMITS`](crate::lock::permits::MAX_PERMITS).
    pub fn permits(mut self, permits: u32) -> crate::Result<Self> {
        self.permits = Some(crate::lock::permits::check_permits(permits)?);
        Ok(self)
    }

    /// This layer with another key function, for requests of another type:
    /// the same locker, strategy and settings, sharing with this layer's
    /// clones this process's per-key FIFO and the instruments. One layer
    /// then serves a pipeline's messages (`|m: &Msg| ..`) and, re-keyed
    /// over the [`Job`](crate::Job) (`|job: &Job<Msg>| ..`), the
    /// [`Worker`](crate::Worker) that brings deferred ones back, whose jobs
    /// it defers in place (see [`OnConflict::defer`]).
    pub fn key_fn<G>(self, key_fn: G) -> LockLayer<C, G, D> {
        LockLayer {
            locker: self.locker,
            key_fn: Arc::new(key_fn),
            on_conflict: self.on_conflict,
            on_lost: self.on_lost,
            local: self.local,
            wake: self.wake,
            issue_fence: self.issue_fence,
            permits: self.permits,
            instruments: self.instruments,
        }
    }
}

impl<S, C: Clone, F, D: Clone> tower::Layer<S> for LockLayer<C, F, D> {
    type Service = Lock<S, C, F, D>;

    fn layer(&self, inner: S) -> Self::Service {
        Lock::new(inner, Arc::new(self.clone()))
    }
}
