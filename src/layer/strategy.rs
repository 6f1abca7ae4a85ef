//! What a [`LockLayer`](super::LockLayer) does when a message's key is busy.

use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::{ClaimLost, TooManyDeferrals};
use crate::BoxError;
use crate::backoff::Backoff;
use crate::lock::Contended;
use crate::queue::{Claim, ClaimToken, Job, PushOptions, Queue};

/// The conflict strategy: optionally retry with backoff, then fail or defer.
///
/// ```no_run
/// # fn demo(queue: lockgate::Queue<String>) -> lockgate::Result<()> {
/// use std::time::Duration;
/// use lockgate::{Backoff, OnConflict};
///
/// let ms = Duration::from_millis;
/// // Fail at once, with the holder's remaining TTL as `retry_after`.
/// let fail = OnConflict::fail();
/// // Sleep and retry up to 5 times, then fail.
/// let retry = OnConflict::retry(Backoff::exponential(ms(10), ms(500))?.max_attempts(5)).then_fail();
/// // Sleep and retry briefly, then put the message aside for 2 s.
/// let defer = OnConflict::retry(Backoff::exponential(ms(10), ms(100))?.max_attempts(3))
///     .then_defer(queue, Duration::from_secs(2));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct OnConflict<D = Fail> {
    /// Retries before giving up; `None` gives up at once.
    pub(crate) retry: Option<Backoff>,
    /// What giving up means.
    pub(crate) then: D,
}

impl OnConflict<Fail> {
    /// Fail at once with [`Contended`], which carries the key and how long
    /// the holder's lock still lives.
    pub fn fail() -> Self {
        Self {
            retry: None,
            then: Fail,
        }
    }

    /// Sleep with jittered exponential backoff and try again, as long as
    /// `backoff` allows; then fail with [`Contended`]. A backoff made by
    /// [`Backoff::exponential`] allows **10 tries in all** unless told
    /// otherwise ([`Backoff::max_attempts`], [`Backoff::max_elapsed`],
    /// [`Backoff::unlimited_attempts`]).
    pub fn retry(backoff: Backoff) -> Self {
        Self {
            retry: Some(backoff),
            then: Fail,
        }
    }

    /// Fail with [`Contended`] once retries are used up (the default; spelled
    /// out for readability).
    pub fn then_fail(self) -> Self {
        self
    }

    /// Put the message into `queue`, due after `delay`, once retries are used
    /// up. See [`OnConflict::defer`].
    pub fn then_defer<T, C>(
        self,
        queue: Queue<T, C>,
        delay: impl Into<DeferDelay>,
    ) -> OnConflict<Defer<T, C>> {
        OnConflict {
            retry: self.retry,
            then: Defer {
                queue,
                delay: delay.into(),
                max_deferrals: None,
            },
        }
    }

    /// Put the message into `queue`, due after `delay`, and answer
    /// [`Outcome::Deferred`](crate::Outcome::Deferred). A [`Worker`](crate::Worker)
    /// on that queue, running the same service, brings it back.
    ///
    /// A request that is a [`Job`] claimed from `queue` (a layer over the
    /// worker's `Job<T>`, key function `|job: &Job<T>| ..`) is rescheduled
    /// in place: one script, same id, same stored bytes, counting a
    /// deferral, not a failed attempt. A `Job` of another queue is pushed
    /// into `queue` as a new message (its worker acknowledges the original);
    /// any other request, a payload `T` among them, is pushed as a new
    /// message. See docs/worker.md, "The worker" (how in-place deferral finds
    /// the job).
    pub fn defer<T, C>(
        queue: Queue<T, C>,
        delay: impl Into<DeferDelay>,
    ) -> OnConflict<Defer<T, C>> {
        Self::fail().then_defer(queue, delay)
    }
}

impl<T, C> OnConflict<Defer<T, C>> {
    /// Gives up on a claimed job that was deferred `n` times already: the
    /// call fails with [`TooManyDeferrals`], so the worker retries it as a
    /// failure and eventually dead-letters it instead of deferring forever.
    pub fn max_deferrals(mut self, n: u32) -> Self {
        self.then.max_deferrals = Some(n);
        self
    }
}

/// Give up with a [`Contended`] error.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fail;

/// Give up by scheduling the message into a delay queue.
pub struct Defer<T, C> {
    queue: Queue<T, C>,
    delay: DeferDelay,
    /// Deferrals allowed per claimed job.
    max_deferrals: Option<u32>,
}

// By hand: derived impls would demand `T: Clone + Debug` of the messages.
impl<T, C: Clone> Clone for Defer<T, C> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            delay: self.delay,
            max_deferrals: self.max_deferrals,
        }
    }
}

impl<T, C> std::fmt::Debug for Defer<T, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Defer")
            .field("queue", &self.queue)
            .field("delay", &self.delay)
            .field("max_deferrals", &self.max_deferrals)
            .finish()
    }
}

/// How long a deferred message waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeferDelay {
    /// A fixed delay.
    Fixed(Duration),
    /// Until the current holder's lock runs out (at least 10 ms, when the
    /// holder's TTL is unknown), plus a random share of `jitter` so that
    /// deferred messages of one key do not all return at the same instant.
    HolderTtl {
        /// The most added on top of the holder's remaining TTL.
        jitter: Duration,
    },
    /// Into the key's line at once: see [`DeferDelay::until_released`].
    UntilReleased,
    /// Exactly [`Contended::retry_after`]: see [`DeferDelay::until_allowed`].
    UntilAllowed,
}

impl DeferDelay {
    /// Until the key allows the call, exactly: for a
    /// [`RateLimitLayer`](crate::layer::RateLimitLayer), when the next slot
    /// opens, and the slot is reserved for the message (if the request is
    /// a [`Job`] claimed from the queue, rescheduled in place; anything else
    /// is pushed anew); for a lock or permits, when the holder's lease ends
    /// (at least 1 ms).
    pub fn until_allowed() -> Self {
        DeferDelay::UntilAllowed
    }

    /// Until the holder's lock runs out, plus up to `jitter`.
    pub fn holder_ttl(jitter: Duration) -> Self {
        DeferDelay::HolderTtl { jitter }
    }

    /// Into the key's line in the queue (see
    /// [`PushOptions::key`](crate::queue::PushOptions::key)): claimed when
    /// the key is free, one at a time, in line order, each with the key's
    /// lock (or one of its permits), which the layer over it uses instead
    /// of contending again. Needs a [`Worker`](crate::Worker) on the queue.
    /// For locks only: a [`RateLimitLayer`](crate::layer::RateLimitLayer)
    /// refuses it. See docs/layer.md, "The LockLayer" (into the key's line).
    pub fn until_released() -> Self {
        DeferDelay::UntilReleased
    }

    fn resolve(&self, busy: &Contended) -> Duration {
        match *self {
            DeferDelay::Fixed(d) => d,
            DeferDelay::UntilReleased => Duration::ZERO,
            // Whole milliseconds (the queue's unit), rounded up: never back
            // before the slot opens.
            DeferDelay::UntilAllowed => {
                Duration::from_millis(busy.retry_after().as_micros().div_ceil(1000).max(1) as u64)
            }
            DeferDelay::HolderTtl { jitter } => {
                let jitter =
                    Duration::try_from_secs_f64(jitter.as_secs_f64() * rand::random::<f64>())
                        .unwrap_or(Duration::MAX);
                busy.retry_after()
                    .max(MIN_HOLDER_WAIT)
                    .saturating_add(jitter)
            }
        }
    }
}

/// The least a `HolderTtl` deferral waits: a holder whose TTL is unknown
/// (set without expiry by someone else) must not cause a hot loop.
const MIN_HOLDER_WAIT: Duration = Duration::from_millis(10);

impl From<Duration> for DeferDelay {
    fn from(d: Duration) -> Self {
        DeferDelay::Fixed(d)
    }
}

pub(crate) mod sealed {
    use crate::queue::Job;

    /// Keeps [`GiveUp`](super::GiveUp) implemented by lockgate only, and
    /// says what a strategy does with a request of type `Req`, by its type.
    pub trait Sealed<Req> {
        /// Whether giving up defers the message into its key's line at
        /// once (`DeferDelay::until_released`).
        fn until_released(&self) -> bool {
            false
        }

        /// The id of `req`, when giving up reschedules it in place exactly
        /// when the key allows it (`DeferDelay::UntilAllowed`, and `req` a
        /// job claimed from the deferral's queue): then a rate limit
        /// reserves the slot for it, under that id.
        fn reserves_slot<'r>(&self, _req: &'r Req) -> Option<&'r str> {
            None
        }
    }
    impl<Req> Sealed<Req> for super::Fail {}
    impl<T, C> Sealed<T> for super::Defer<T, C> {
        fn until_released(&self) -> bool {
            self.joins_line()
        }
    }
    // Beside `Sealed<T>`: no type is both `T` and `Job<T>`.
    impl<T, C> Sealed<Job<T>> for super::Defer<T, C> {
        fn until_released(&self) -> bool {
            self.joins_line()
        }

        fn reserves_slot<'r>(&self, job: &'r Job<T>) -> Option<&'r str> {
            let until_allowed = self.delay == super::DeferDelay::UntilAllowed;
            (until_allowed && self.in_place(job)).then(|| job.id())
        }
    }
}

/// Where a deferred message went.
pub(crate) type Deferral = (String, SystemTime);

/// The last step of a conflict strategy, for requests of type `Req`:
/// [`Fail`] for any request, [`Defer`] for a `T` (pushed as a new message)
/// or a claimed [`Job<T>`] (rescheduled in place when claimed from the
/// deferral's queue). Which one applies is decided by the request's type.
///
/// Sealed: it appears in bounds (`D: GiveUp<Req>`) but is implemented only
/// by lockgate's own strategies.
pub trait GiveUp<Req>: sealed::Sealed<Req> + Send + Sync + 'static {
    /// Called with the request once retries are used up.
    fn give_up(&self, req: Req, busy: Contended) -> BoxFuture<'static, Result<Deferral, BoxError>>;
}

impl<Req> GiveUp<Req> for Fail {
    fn give_up(
        &self,
        _req: Req,
        busy: Contended,
    ) -> BoxFuture<'static, Result<Deferral, BoxError>> {
        Box::pin(std::future::ready(Err(busy.into())))
    }
}

impl<T, C> GiveUp<T> for Defer<T, C>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn give_up(&self, req: T, busy: Contended) -> BoxFuture<'static, Result<Deferral, BoxError>> {
        let defer = self.clone();
        // A `T` is never a claimed job, whoever called: it is pushed as a
        // new message (a job is deferred in place only by a layer over the
        // `Job<T>` itself). Under the id a consumer gave it
        // (`with_message_id`), if any: a redelivered copy finds it and is
        // not pushed twice.
        let id = super::message_id::take();
        Box::pin(async move {
            let delay = defer.delay.resolve(&busy);
            let mut options = defer.push_options(&busy, delay);
            if let Some(id) = id {
                options = options.id(id);
            }
            let pushed = defer.queue.push_with(req, options).await?;
            let due = pushed.due.unwrap_or_else(SystemTime::now);
            tracing::debug!(key = %busy.key(), id = %pushed.id, ?delay, "deferred");
            Ok((pushed.id, due))
        })
    }
}

impl<T, C> GiveUp<Job<T>> for Defer<T, C>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn give_up(
        &self,
        job: Job<T>,
        busy: Contended,
    ) -> BoxFuture<'static, Result<Deferral, BoxError>> {
        let defer = self.clone();
        Box::pin(async move {
            let delay = defer.delay.resolve(&busy);
            if !defer.in_place(&job) {
                // Claimed from another queue: copy it into the deferral queue.
                // The worker that claimed it acknowledges the original when it
                // sees a deferral under another id. Outside a key's line it
                // keeps its priority.
                let mut options = defer.push_options(&busy, delay);
                if !defer.joins_line() {
                    options = options.priority(job.priority());
                }
                let pushed = defer.queue.push_with(job.into_payload(), options).await?;
                return Ok((pushed.id, pushed.due.unwrap_or_else(SystemTime::now)));
            }
            let token = job.claim_ref().to_token();
            defer
                .reschedule(&token, job.deferrals(), &busy, delay)
                .await
        })
    }
}

impl<T, C> Defer<T, C> {
    /// Whether giving up moves the message into its key's line
    /// (`DeferDelay::until_released`).
    fn joins_line(&self) -> bool {
        self.delay == DeferDelay::UntilReleased
    }

    /// Whether `job` is deferred in place: it was claimed from this
    /// deferral's queue.
    fn in_place(&self, job: &Job<T>) -> bool {
        job.queue_keys() == self.queue.keys()
    }
}

impl<T, C> Defer<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// How a new message deferred on `busy` is pushed: due after `delay`, or
    /// into its key's line (`DeferDelay::until_released`).
    fn push_options(&self, busy: &Contended, delay: Duration) -> PushOptions {
        let options = PushOptions::new().after(delay);
        match (self.joins_line(), busy.permits()) {
            (false, _) => options,
            (true, None) => options.key(busy.key()),
            (true, Some(n)) => options.key(busy.key()).permits(n),
        }
    }

    /// Defers a claimed job in place, within its deferral cap: rescheduled
    /// after `delay` (one script), or moved into its key's line.
    async fn reschedule(
        &self,
        token: &ClaimToken,
        deferrals: u32,
        busy: &Contended,
        delay: Duration,
    ) -> Result<Deferral, BoxError> {
        if self.max_deferrals.is_some_and(|max| deferrals >= max) {
            return Err(TooManyDeferrals {
                id: token.id().to_owned(),
                key: busy.key().to_owned(),
                deferrals,
            }
            .into());
        }
        let queue = &self.queue;
        // A job claimed with its key's lock keeps its place in its own line; an
        // unkeyed one a `LockLayer` found busy moves into its key's line.
        let deferred = match (self.joins_line(), token.held_lock()) {
            (true, None) => {
                let limits = busy.permits().map_or(String::new(), |n| n.to_string());
                let key = (busy.key(), limits.as_str());
                queue.defer_to_key(token, key, delay).await?
            }
            // Claimed with its own key's lock, busy on another key: it keeps
            // its place in its own line, and waits out the other holder's lease
            // at least (it cannot stand in two lines).
            (true, Some(_)) => {
                let wait = busy.retry_after().max(MIN_HOLDER_WAIT);
                queue.defer(token, delay.max(wait)).await?
            }
            (false, _) => queue.defer(token, delay).await?,
        };
        let Some(due) = deferred else {
            let id = token.id().to_owned();
            return Err(ClaimLost { id }.into());
        };
        tracing::debug!(key = %busy.key(), id = %token.id(), deferrals = deferrals + 1, ?delay, "deferred");
        Ok((token.id().to_owned(), due))
    }
}
