//! Integration tests for `lockgate::LockLayer` against real, private
//! `redis-server` processes (one per test, started through
//! `lockgate::testing::RedisServer`).
//!
//! The tests check behaviour and invariants (mutual exclusion, what each
//! conflict strategy answers, where deferred messages go, that locks are
//! released on every exit path, that the watchdog keeps a lock alive and
//! reports its loss, fencing order, readiness propagation), never timings:
//! durations appear only as generous sanity bounds.

use crate::support;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use futures_util::FutureExt;
use lockgate::layer::{DeferDelay, GiveUp, LockLost, TooManyDeferrals};
use lockgate::testing::RedisServer;
use lockgate::{
    Acquisition, BoxError, Contended, Error, HeldLock, Job, LockLayer, Locker, OnConflict, OnLost,
    Outcome, Queue,
};
use redis::aio::{ConnectionLike, ConnectionManager};
use serde::{Deserialize, Serialize};
use support::{
    BOUNDED, acquired, backoff, done_if, eventually, held, locker, manager, ms, raw, script_calls,
    secs, server,
};
use tokio::sync::{Notify, oneshot};
use tokio::time::{Instant, sleep, timeout};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

type BoxFut<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// Asserts that `key` is held by someone else right now.
async fn assert_busy<C>(locker: &Locker<C>, key: &str, at: &str)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match locker.acquire(key).await.expect("acquire") {
        Acquisition::Contended(c) => assert_eq!(c.key(), key),
        Acquisition::Acquired(lease) => {
            let _ = locker.release(&lease).await;
            panic!("{key:?} was free {at}: the holder's lock was not kept alive");
        }
    }
}

/// Polls until the lock at `key` is released;
/// panics after 2 s (far below the 30 s TTLs of the locks it waits for, so
/// only a release explains a pass).
async fn wait_gone(conn: &ConnectionManager, key: &str) {
    eventually(&format!("{key} is released"), secs(2), async || {
        let value: Option<String> = raw(conn, &["GET", key]).await;
        done_if(value.is_none(), format_args!("{value:?}"))
    })
    .await;
}

/// Claims from `queue` until something comes back; panics after `bound`.
async fn claim_one<T>(queue: &Queue<T>, bound: Duration) -> Job<T>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let started = Instant::now();
    loop {
        let mut claimed = queue.claim(1, secs(30)).await.expect("claim");
        if let Some(job) = claimed.jobs.pop() {
            return job;
        }
        assert!(
            started.elapsed() < bound,
            "nothing claimable in {} after {bound:?}",
            queue.name()
        );
        sleep(ms(5)).await;
    }
}

fn downcast<E: std::error::Error + 'static>(err: &BoxError) -> &E {
    err.downcast_ref::<E>()
        .unwrap_or_else(|| panic!("expected a {}, got {err:?}", std::any::type_name::<E>()))
}

/// The distance between two wall-clock times, either way round.
fn gap(a: SystemTime, b: SystemTime) -> Duration {
    a.duration_since(b)
        .or_else(|_| b.duration_since(a))
        .unwrap_or_default()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Msg {
    key: String,
    n: u32,
}

fn msg(key: &str, n: u32) -> Msg {
    Msg {
        key: key.to_owned(),
        n,
    }
}

fn key_of(m: &Msg) -> String {
    m.key.clone()
}

/// A handler that records, per call, its key and when it started and ended
/// (while holding the lock), working `work` in between.
#[derive(Clone)]
struct Recorder {
    log: Arc<Mutex<Vec<(String, Instant, Instant)>>>,
    work: Duration,
}

impl Recorder {
    fn new(work: Duration) -> Self {
        Self {
            log: Arc::default(),
            work,
        }
    }

    fn intervals(&self) -> Vec<(String, Instant, Instant)> {
        self.log.lock().unwrap().clone()
    }
}

impl Service<Msg> for Recorder {
    type Response = ();
    type Error = BoxError;
    type Future = BoxFut<()>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, m: Msg) -> Self::Future {
        let (log, work) = (self.log.clone(), self.work);
        Box::pin(async move {
            let held = HeldLock::current().expect("a locked call sees its lock");
            assert_eq!(held.key(), m.key);
            let start = Instant::now();
            sleep(work).await;
            let end = Instant::now();
            log.lock().unwrap().push((m.key, start, end));
            Ok(())
        })
    }
}

/// Panics if two recorded intervals of one key overlap.
fn assert_no_overlap(mut intervals: Vec<(String, Instant, Instant)>) {
    intervals.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for pair in intervals.windows(2) {
        let ((k1, s1, e1), (k2, s2, _)) = (&pair[0], &pair[1]);
        if k1 == k2 {
            assert!(
                e1 <= s2,
                "two handlers of key {k1} overlapped: one ran {s1:?}..{e1:?}, the next started {s2:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Mutual exclusion, end to end
// ---------------------------------------------------------------------------

const KEYS: usize = 4;
const CALLS: usize = 32;

/// 32 concurrent calls over 4 keys, alternating between two layers on two
/// connections (two Lockers, two ConnectionManagers). Returns each call's
/// key and result, and the handler's intervals.
async fn hammer<D>(
    server: &RedisServer,
    strategy: OnConflict<D>,
) -> (
    Vec<(String, Result<Outcome<()>, BoxError>)>,
    Vec<(String, Instant, Instant)>,
)
where
    D: GiveUp<Msg> + Clone,
{
    let recorder = Recorder::new(ms(3));
    let mut services = Vec::new();
    for _ in 0..2 {
        let layer = LockLayer::new(locker(manager(server).await, ms(500)), key_of)
            .on_conflict(strategy.clone());
        services.push(layer.layer(recorder.clone()));
    }
    let start = Arc::new(tokio::sync::Barrier::new(CALLS));
    let tasks: Vec<_> = (0..CALLS)
        .map(|i| {
            let svc = services[i % 2].clone();
            let start = start.clone();
            let key = format!("k{}", i % KEYS);
            tokio::spawn(async move {
                start.wait().await;
                (key.clone(), svc.oneshot(msg(&key, i as u32)).await)
            })
        })
        .collect();
    let mut results = Vec::new();
    for task in tasks {
        results.push(
            timeout(BOUNDED, task)
                .await
                .expect("call finished")
                .expect("no panic"),
        );
    }
    let intervals = recorder.intervals();
    assert_no_overlap(intervals.clone());
    let done = results
        .iter()
        .filter(|(_, r)| matches!(r, Ok(Outcome::Done(()))))
        .count();
    assert_eq!(done, intervals.len(), "one handler run per Done");
    for k in 0..KEYS {
        let key = format!("k{k}");
        assert!(
            intervals.iter().any(|(ik, _, _)| *ik == key),
            "no call of {key} got through"
        );
    }
    (results, intervals)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_with_retry_then_fail() {
    let server = server();
    let strategy = OnConflict::retry(backoff(2, 20).max_attempts(6)).then_fail();
    let (results, _) = hammer(&server, strategy).await;
    for (key, result) in results {
        match result {
            Ok(Outcome::Done(())) => {}
            Ok(other) => panic!("a fail strategy answered {other:?}"),
            Err(e) => assert_eq!(downcast::<Contended>(&e).key(), key),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_exclusion_with_retry_then_defer() {
    let server = server();
    let queue: Queue<Msg> = Queue::new(manager(&server).await, "deferred").unwrap();
    let strategy =
        OnConflict::retry(backoff(1, 4).max_attempts(2)).then_defer(queue.clone(), ms(200));
    let (results, _) = hammer(&server, strategy).await;
    let mut deferred = Vec::new();
    for (key, result) in results {
        match result.unwrap_or_else(|e| panic!("call on {key} failed: {e}")) {
            Outcome::Done(()) => {}
            Outcome::Deferred { id, .. } => deferred.push(id),
        }
    }
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due + stats.later) as usize,
        deferred.len(),
        "every deferral is in the queue, and nothing else"
    );
    deferred.sort();
    deferred.dedup();
    assert_eq!(
        deferred.len() as u64,
        stats.due + stats.later,
        "ids are unique"
    );
}

// ---------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------

/// A handler that counts its calls and answers the message's number.
#[derive(Clone, Default)]
struct Counter(Arc<AtomicUsize>);

impl Counter {
    fn calls(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Service<Msg> for Counter {
    type Response = u32;
    type Error = BoxError;
    type Future = BoxFut<u32>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, m: Msg) -> Self::Future {
        self.0.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move { Ok(m.n) })
    }
}

#[tokio::test]
async fn fail_reports_contended_with_key_and_retry_after() {
    let server = server();
    let holder = locker(manager(&server).await, ms(400));
    let lease = acquired(&holder, "hot").await;

    let counter = Counter::default();
    let svc =
        LockLayer::new(locker(manager(&server).await, ms(300)), key_of).layer(counter.clone());
    let err = svc.oneshot(msg("hot", 1)).await.unwrap_err();
    let busy = downcast::<Contended>(&err);
    assert_eq!(busy.key(), "hot");
    assert!(
        !busy.retry_after().is_zero() && busy.retry_after() <= ms(400),
        "retry_after {:?} is not within the holder's TTL",
        busy.retry_after()
    );
    assert_eq!(counter.calls(), 0, "the handler must not run");
    assert!(
        holder.release(&lease).await.unwrap(),
        "the holder still holds"
    );
}

#[tokio::test]
async fn retry_succeeds_once_the_holder_releases() {
    let server = server();
    // A long TTL: only the release can let the retrying call in.
    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "hot").await;

    let recorder = Recorder::new(ms(1));
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(OnConflict::retry(
            backoff(5, 40).unlimited_attempts().max_elapsed(BOUNDED),
        ))
        .layer(recorder.clone());
    let call = tokio::spawn(svc.oneshot(msg("hot", 1)));
    sleep(ms(150)).await;
    assert!(
        recorder.intervals().is_empty(),
        "ran while the key was held"
    );
    let released_at = Instant::now();
    assert!(holder.release(&lease).await.unwrap());

    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    let intervals = recorder.intervals();
    assert_eq!(intervals.len(), 1);
    assert!(
        intervals[0].1 >= released_at,
        "ran before the holder released"
    );
}

#[tokio::test]
async fn retry_then_fail_gives_up_after_max_attempts() {
    let server = server();
    let stats_conn = manager(&server).await;
    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "hot").await;
    // Loads the contend script.
    assert!(holder.acquire("hot").await.unwrap().lease().is_none());

    for attempts in [1, 2, 5] {
        let counter = Counter::default();
        let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
            .on_conflict(OnConflict::retry(backoff(1, 4).max_attempts(attempts)).then_fail())
            .layer(counter.clone());
        let before = script_calls(&stats_conn).await;
        let err = svc.oneshot(msg("hot", 1)).await.unwrap_err();
        let after = script_calls(&stats_conn).await;
        assert_eq!(downcast::<Contended>(&err).key(), "hot");
        assert_eq!(
            after - before,
            u64::from(attempts),
            "one contend script call per attempt (after the first try's SET)"
        );
        assert_eq!(counter.calls(), 0);
    }
    holder.release(&lease).await.unwrap();
}

#[tokio::test]
async fn retry_with_max_elapsed_stops_within_its_budget() {
    let server = server();
    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "hot").await;
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(OnConflict::retry(
            backoff(5, 20).unlimited_attempts().max_elapsed(ms(100)),
        ))
        .layer(Counter::default());
    let started = Instant::now();
    let err = svc.oneshot(msg("hot", 1)).await.unwrap_err();
    assert_eq!(downcast::<Contended>(&err).key(), "hot");
    // Sleeps add up to at most 100 ms; round trips are extra (sanity bound).
    assert!(started.elapsed() < secs(3));
    holder.release(&lease).await.unwrap();
}

#[tokio::test]
async fn defer_pushes_a_plain_message_into_the_queue() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), ms(500));
    let _lease = acquired(&holder, "hot").await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "deferred").unwrap();

    let counter = Counter::default();
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(OnConflict::defer(queue.clone(), secs(2)))
        .layer(counter.clone());
    let before = SystemTime::now();
    let outcome = svc.oneshot(msg("hot", 7)).await.unwrap();
    let Outcome::Deferred { id, due } = outcome else {
        panic!("expected a deferral, got {outcome:?}");
    };
    assert_eq!(counter.calls(), 0);
    assert!(
        gap(due, before + secs(2)) < ms(500),
        "due {due:?} is not about 2 s after {before:?}"
    );
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.due, stats.later, stats.active), (0, 1, 0));
    assert!(
        queue.claim(10, secs(30)).await.unwrap().jobs.is_empty(),
        "claimable before it is due"
    );

    if let Ok(left) = due.duration_since(SystemTime::now()) {
        sleep(left).await;
    }
    let job = claim_one(&queue, BOUNDED).await;
    assert_eq!(job.id(), id);
    assert_eq!(*job, msg("hot", 7));
    assert_eq!((job.attempt(), job.deferrals()), (1, 0));
    assert!(queue.ack(&job).await.unwrap());
}

#[tokio::test]
async fn a_message_deferred_under_its_broker_id_is_pushed_once_however_often_it_is_redelivered() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), ms(2000));
    let _lease = acquired(&holder, "hot").await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "redelivered").unwrap();
    let counter = Counter::default();
    let mut svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(OnConflict::defer(queue.clone(), secs(2)))
        .layer(counter.clone());

    let mut ids = Vec::new();
    // The first delivery, and two redeliveries of the same broker message.
    for _ in 0..3 {
        let ready = svc.ready().await.unwrap();
        let call = lockgate::layer::with_message_id("stream-1:17", || ready.call(msg("hot", 17)));
        let Outcome::Deferred { id, .. } = call.await.unwrap() else {
            panic!("expected a deferral");
        };
        ids.push(id);
    }
    assert_eq!(ids, ["stream-1:17"; 3]);
    // Another message without an id gets a fresh one; the id is taken by the
    // layer, not left for later calls.
    let outcome = svc
        .ready()
        .await
        .unwrap()
        .call(msg("hot", 18))
        .await
        .unwrap();
    let Outcome::Deferred { id, .. } = outcome else {
        panic!("expected a deferral");
    };
    assert_ne!(id, "stream-1:17");
    assert_eq!(counter.calls(), 0);
    let stats = queue.stats().await.unwrap();
    assert_eq!(stats.later, 2, "{stats:?}");
}

#[tokio::test]
async fn defer_until_the_holders_ttl_runs_out() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), ms(500));
    let acquired_at = SystemTime::now();
    let _lease = acquired(&holder, "hot").await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "deferred").unwrap();
    let jitter = ms(100);

    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(OnConflict::defer(
            queue.clone(),
            DeferDelay::holder_ttl(jitter),
        ))
        .layer(Counter::default());
    let outcome = svc.oneshot(msg("hot", 1)).await.unwrap();
    let Outcome::Deferred { due, .. } = outcome else {
        panic!("expected a deferral, got {outcome:?}");
    };
    // The holder's lock runs out about 500 ms after it was taken; the
    // message is due then, plus at most the jitter (50 ms slack for clocks
    // in milliseconds and round trips).
    let expiry = acquired_at + ms(500);
    assert!(
        due + ms(50) >= expiry,
        "due {due:?} before the holder's expiry {expiry:?}"
    );
    assert!(
        due <= expiry + jitter + ms(50),
        "due {due:?} later than expiry {expiry:?} + jitter"
    );
    assert_eq!(queue.stats().await.unwrap().later, 1);
}

#[tokio::test]
async fn retry_then_defer() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), secs(30));
    let lease = acquired(&holder, "hot").await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "deferred").unwrap();
    let counter = Counter::default();
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(
            OnConflict::retry(backoff(1, 4).max_attempts(3)).then_defer(queue.clone(), ms(300)),
        )
        .layer(counter.clone());

    // Busy through all retries: deferred.
    let outcome = svc.clone().oneshot(msg("hot", 1)).await.unwrap();
    assert!(outcome.is_deferred(), "{outcome:?}");
    assert_eq!(queue.stats().await.unwrap().later, 1);
    assert_eq!(counter.calls(), 0);

    // Freed during the retries: done, not deferred.
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of)
        .on_conflict(
            OnConflict::retry(backoff(5, 40).max_attempts(50)).then_defer(queue.clone(), ms(300)),
        )
        .layer(counter.clone());
    let call = tokio::spawn(svc.oneshot(msg("hot", 2)));
    sleep(ms(50)).await;
    holder.release(&lease).await.unwrap();
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done(2));
    assert_eq!(
        queue.stats().await.unwrap().later,
        1,
        "nothing more deferred"
    );
}

// ---------------------------------------------------------------------------
// Deferring claimed jobs
// ---------------------------------------------------------------------------

/// A handler of claimed jobs that counts its calls.
fn job_handler(
    calls: Arc<AtomicUsize>,
) -> impl Service<Job<Msg>, Response = (), Error = BoxError, Future: Send> + Clone + Send + 'static
{
    service_fn(move |_job: Job<Msg>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(()) }
    })
}

#[tokio::test]
async fn a_claimed_job_is_rescheduled_in_place_up_to_max_deferrals() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), secs(30));
    let lease = acquired(&holder, "hot").await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "jobs").unwrap();
    let pushed = queue.push(msg("hot", 1)).await.unwrap();

    let calls = Arc::new(AtomicUsize::new(0));
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), |j: &Job<Msg>| {
        j.key.clone()
    })
    .on_conflict(OnConflict::defer(queue.clone(), ms(20)).max_deferrals(2))
    .layer(job_handler(calls.clone()));

    let mut job = claim_one(&queue, BOUNDED).await;
    assert_eq!(
        (job.id(), job.attempt(), job.deferrals()),
        (&*pushed.id, 1, 0)
    );
    for round in 1..=2 {
        let outcome = svc.clone().oneshot(job.clone()).await.unwrap();
        let Outcome::Deferred { id, .. } = outcome else {
            panic!("expected a deferral, got {outcome:?}");
        };
        assert_eq!(id, pushed.id, "rescheduled in place, under its own id");
        let stats = queue.stats().await.unwrap();
        assert_eq!(stats.active, 0, "no longer claimed");
        assert_eq!(stats.due + stats.later, 1, "back on the schedule, once");
        job = claim_one(&queue, BOUNDED).await;
        assert_eq!(job.id(), pushed.id);
        assert_eq!(job.deferrals(), round, "deferrals counted");
        assert_eq!(job.attempt(), 1, "a deferral is not a failed attempt");
    }

    let err = svc.clone().oneshot(job.clone()).await.unwrap_err();
    let too_many = downcast::<TooManyDeferrals>(&err);
    assert_eq!(
        (&*too_many.id, &*too_many.key, too_many.deferrals),
        (&*pushed.id, "hot", 2)
    );
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.active, stats.due + stats.later),
        (1, 0),
        "still claimed: the worker decides what a failure means"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // Once the key is free, the same job runs.
    holder.release(&lease).await.unwrap();
    let outcome = svc.oneshot(job.clone()).await.unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(queue.ack(&job).await.unwrap());
}

#[tokio::test]
async fn a_job_from_another_queue_is_copied() {
    let server = server();
    let conn = manager(&server).await;
    let holder = locker(conn.clone(), secs(30));
    let _lease = acquired(&holder, "hot").await;
    let deferrals: Queue<Msg> = Queue::new(conn.clone(), "deferrals").unwrap();
    let source: Queue<Msg> = Queue::new(conn.clone(), "source").unwrap();
    source.push(msg("hot", 5)).await.unwrap();
    let job = claim_one(&source, BOUNDED).await;

    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), |j: &Job<Msg>| {
        j.key.clone()
    })
    .on_conflict(OnConflict::defer(deferrals.clone(), ms(20)))
    .layer(job_handler(Arc::default()));
    let outcome = svc.oneshot(job.clone()).await.unwrap();
    let Outcome::Deferred { id, .. } = outcome else {
        panic!("expected a deferral, got {outcome:?}");
    };
    assert_ne!(id, job.id(), "copied under a new id");
    let copy = claim_one(&deferrals, BOUNDED).await;
    assert_eq!((copy.id(), &*copy), (&*id, &msg("hot", 5)));
    assert_eq!(
        source.stats().await.unwrap().active,
        1,
        "the original stays claimed (its worker acknowledges it)"
    );
}

// ---------------------------------------------------------------------------
// Release on every exit path
// ---------------------------------------------------------------------------

#[tokio::test]
async fn released_when_the_handler_fails() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, secs(30));
    let lock_key = layer_locker.lock_key("k");
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn(|_m: Msg| async {
        Err::<(), _>(std::io::Error::other("handler failed"))
    }));
    let err = svc.oneshot(msg("k", 1)).await.unwrap_err();
    assert_eq!(
        downcast::<std::io::Error>(&err).to_string(),
        "handler failed"
    );
    assert!(
        !held(&conn, &lock_key).await,
        "released before the call returned"
    );
    let lease = acquired(&locker(conn, ms(300)), "k").await;
    assert!(lease.issued_fence().is_none());
}

#[tokio::test]
async fn released_when_the_handler_panics() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, secs(30));
    let lock_key = layer_locker.lock_key("k");
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn(|m: Msg| async move {
        if m.n > 0 {
            panic!("handler panicked on purpose");
        }
        Ok::<_, BoxError>(())
    }));

    // In a task: the panic surfaces as a JoinError.
    let joined = tokio::spawn(svc.clone().oneshot(msg("k", 1))).await;
    assert!(joined.unwrap_err().is_panic());
    wait_gone(&conn, &lock_key).await;

    // In place, caught with catch_unwind.
    let caught = std::panic::AssertUnwindSafe(svc.clone().oneshot(msg("k", 2)))
        .catch_unwind()
        .await;
    assert!(caught.is_err(), "the panic propagates");
    wait_gone(&conn, &lock_key).await;

    // And the key works normally afterwards.
    assert_eq!(svc.oneshot(msg("k", 0)).await.unwrap(), Outcome::Done(()));
}

/// A handler that says when it started and then works for a long time.
fn slow_handler(
    started: Arc<tokio::sync::Notify>,
    work: Duration,
) -> impl Service<Msg, Response = (), Error = BoxError, Future: Send> + Clone + Send + 'static {
    service_fn(move |_m: Msg| {
        let started = started.clone();
        async move {
            started.notify_one();
            sleep(work).await;
            Ok::<_, BoxError>(())
        }
    })
}

#[tokio::test]
async fn released_when_the_response_future_is_dropped() {
    let server = server();
    let conn = manager(&server).await;
    // 30 s: expiry cannot explain a quick hand-over.
    let layer_locker = locker(manager(&server).await, secs(30));
    let lock_key = layer_locker.lock_key("k");
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of).layer(slow_handler(started.clone(), secs(60)));
    let other = locker(manager(&server).await, ms(300));

    // Aborting the task that drives the call.
    let call = tokio::spawn(svc.clone().oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    assert!(held(&conn, &lock_key).await);
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    wait_gone(&conn, &lock_key).await;
    let lease = acquired(&other, "k").await;
    other.release(&lease).await.unwrap();

    // Dropping the future in place, once its handler runs.
    let mut call = Box::pin(svc.oneshot(msg("k", 2)));
    tokio::select! {
        result = &mut call => panic!("a 60 s call finished: {result:?}"),
        () = started.notified() => {}
    }
    assert!(held(&conn, &lock_key).await);
    drop(call);
    wait_gone(&conn, &lock_key).await;
    let lease = acquired(&other, "k").await;
    other.release(&lease).await.unwrap();
}

// ---------------------------------------------------------------------------
// Watchdog
// ---------------------------------------------------------------------------

#[tokio::test]
async fn the_watchdog_keeps_a_slow_handlers_lock() {
    let server = server();
    let ttl = ms(150);
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(locker(manager(&server).await, ttl), key_of)
        .layer(slow_handler(started.clone(), ttl * 5));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();

    let other = locker(manager(&server).await, ttl);
    let began = Instant::now();
    let mut checks = 0;
    while !call.is_finished() && began.elapsed() < ttl * 4 {
        assert_busy(&other, "k", &format!("{:?} into the call", began.elapsed())).await;
        checks += 1;
        sleep(ttl / 2).await;
    }
    assert!(checks >= 3, "only {checks} checks ran during the call");
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    // Released at the end.
    let lease = acquired(&other, "k").await;
    other.release(&lease).await.unwrap();
}

#[tokio::test]
async fn a_lost_lock_is_reported_to_the_handler_and_the_caller() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, ms(150));
    let lock_key = layer_locker.lock_key("k");
    let (tx, rx) = oneshot::channel::<u64>();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let saw_loss = Arc::new(AtomicBool::new(false));
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn({
        let saw_loss = saw_loss.clone();
        move |_m: Msg| {
            let (tx, saw_loss) = (tx.clone(), saw_loss.clone());
            async move {
                let held = HeldLock::current().expect("inside a locked call");
                assert!(!held.is_lost());
                let fence = held.fence().await.unwrap();
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send(fence);
                }
                timeout(BOUNDED, held.lost())
                    .await
                    .expect("the loss is signalled");
                saw_loss.store(held.is_lost(), Ordering::SeqCst);
                Ok::<_, BoxError>("finished")
            }
        }
    }));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    let fence = timeout(BOUNDED, rx).await.unwrap().unwrap();
    raw::<i64>(&conn, &["DEL", &lock_key]).await;

    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    let lost = downcast::<LockLost>(&err);
    assert_eq!(
        (&*lost.key, lost.fence, lost.completed),
        ("k", Some(fence), true)
    );
    assert!(saw_loss.load(Ordering::SeqCst), "is_lost() after lost()");
}

#[tokio::test]
async fn on_lost_cancel_drops_the_handler() {
    struct SetOnDrop(Arc<AtomicBool>);
    impl Drop for SetOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, ms(150));
    let lock_key = layer_locker.lock_key("k");
    let started = Arc::new(tokio::sync::Notify::new());
    let reached_end = Arc::new(AtomicBool::new(false));
    let dropped = Arc::new(AtomicBool::new(false));
    let svc = LockLayer::new(layer_locker, key_of)
        .on_lost(OnLost::Cancel)
        .layer(service_fn({
            let (started, reached_end, dropped) =
                (started.clone(), reached_end.clone(), dropped.clone());
            move |_m: Msg| {
                let (started, reached_end) = (started.clone(), reached_end.clone());
                let guard = SetOnDrop(dropped.clone());
                async move {
                    let _guard = guard;
                    started.notify_one();
                    sleep(secs(30)).await;
                    reached_end.store(true, Ordering::SeqCst);
                    Ok::<_, BoxError>(())
                }
            }
        }));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    raw::<i64>(&conn, &["DEL", &lock_key]).await;

    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    let lost = downcast::<LockLost>(&err);
    assert_eq!((&*lost.key, lost.completed), ("k", false));
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler's future was dropped"
    );
    assert!(
        !reached_end.load(Ordering::SeqCst),
        "the handler ran to its end"
    );
}

// ---------------------------------------------------------------------------
// HeldLock, keys
// ---------------------------------------------------------------------------

#[tokio::test]
async fn held_lock_exposes_key_and_an_ordered_fence() {
    assert!(HeldLock::current().is_none(), "no lock outside a call");
    let server = server();
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), key_of).layer(service_fn(
        |_m: Msg| async {
            let held = HeldLock::current().expect("inside a locked call");
            assert_eq!(held.issued_fence(), None, "issued on first use only");
            let fence = held.fence().await?;
            // Also visible in futures the handler awaits, with the same fence.
            let nested = async { HeldLock::current().map(|h| h.issued_fence()) }.await;
            assert_eq!(nested, Some(Some(fence)));
            assert_eq!(held.fence().await?, fence);
            Ok::<_, BoxError>((held.key().to_owned(), fence))
        },
    ));
    let direct = locker(manager(&server).await, ms(300));

    let mut fences = Vec::new();
    for n in 0..3 {
        let outcome = svc.clone().oneshot(msg("acct", n)).await.unwrap();
        let (key, fence) = outcome.done().expect("done");
        assert_eq!(key, "acct");
        fences.push(fence);
        let lease = acquired(&direct, "acct").await;
        fences.push(direct.fence(&lease).await.unwrap());
        direct.release(&lease).await.unwrap();
    }
    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences of layer calls and direct leases interleave in order: {fences:?}"
    );
    assert!(HeldLock::current().is_none(), "no lock after a call");
}

#[tokio::test]
async fn a_none_key_bypasses_the_lock() {
    let server = server();
    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "busy").await;
    let svc = LockLayer::new(
        locker(manager(&server).await, ms(300)),
        |r: &(Option<String>, u32)| r.0.clone(),
    )
    .layer(service_fn(|r: (Option<String>, u32)| async move {
        Ok::<_, BoxError>((r.1, HeldLock::current().is_some()))
    }));

    let outcome = svc.clone().oneshot((None, 1)).await.unwrap();
    assert_eq!(outcome, Outcome::Done((1, false)), "ran without a lock");
    let err = svc
        .clone()
        .oneshot((Some("busy".into()), 2))
        .await
        .unwrap_err();
    assert_eq!(downcast::<Contended>(&err).key(), "busy");
    let outcome = svc.oneshot((Some("free".into()), 3)).await.unwrap();
    assert_eq!(outcome, Outcome::Done((3, true)));
    assert!(
        holder.release(&lease).await.unwrap(),
        "the holder was undisturbed"
    );
}

#[tokio::test]
async fn integer_keys() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, ms(300));
    let svc = LockLayer::new(layer_locker.clone(), |n: &i64| *n).layer(service_fn({
        let (conn, layer_locker) = (conn.clone(), layer_locker.clone());
        move |n: i64| {
            let (conn, layer_locker) = (conn.clone(), layer_locker.clone());
            async move {
                let held = HeldLock::current().expect("inside a locked call");
                assert_eq!(held.key(), n.to_string());
                assert!(support::held(&conn, &layer_locker.lock_key(&n.to_string())).await);
                Ok::<_, BoxError>(n)
            }
        }
    }));
    for n in [42, -7, 0] {
        assert_eq!(svc.clone().oneshot(n).await.unwrap(), Outcome::Done(n));
    }
    let holder = locker(conn, secs(30));
    let lease = acquired(&holder, "42").await;
    let err = svc.oneshot(42).await.unwrap_err();
    assert_eq!(downcast::<Contended>(&err).key(), "42");
    holder.release(&lease).await.unwrap();
}

#[tokio::test]
async fn an_empty_key_is_invalid() {
    let server = server();
    let counter = Counter::default();
    let svc = LockLayer::new(locker(manager(&server).await, ms(300)), |_m: &Msg| "")
        .layer(counter.clone());
    let err = svc.oneshot(msg("", 1)).await.unwrap_err();
    assert!(
        matches!(downcast::<Error>(&err), Error::InvalidKey(_)),
        "{err:?}"
    );
    assert_eq!(counter.calls(), 0);
}

// ---------------------------------------------------------------------------
// Readiness and composition
// ---------------------------------------------------------------------------

/// A service that is ready only while its gate is open (or fails readiness
/// when told to).
#[derive(Clone, Default)]
struct Gate {
    open: Arc<AtomicBool>,
    broken: Arc<AtomicBool>,
    waker: Arc<Mutex<Option<Waker>>>,
}

impl Gate {
    fn open(&self) {
        self.open.store(true, Ordering::SeqCst);
        if let Some(w) = self.waker.lock().unwrap().take() {
            w.wake();
        }
    }
}

impl Service<Msg> for Gate {
    type Response = u32;
    type Error = BoxError;
    type Future = std::future::Ready<Result<u32, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if self.broken.load(Ordering::SeqCst) {
            return Poll::Ready(Err("inner service broken".into()));
        }
        *self.waker.lock().unwrap() = Some(cx.waker().clone());
        if self.open.load(Ordering::SeqCst) {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }

    fn call(&mut self, m: Msg) -> Self::Future {
        std::future::ready(Ok(m.n))
    }
}

/// Polls a service's readiness once.
async fn poll_ready_once<S: Service<Msg>>(svc: &mut S) -> Poll<Result<(), S::Error>> {
    std::future::poll_fn(|cx| Poll::Ready(svc.poll_ready(cx))).await
}

#[tokio::test]
async fn poll_ready_follows_the_inner_service() {
    let server = server();
    let gate = Gate::default();
    let mut svc =
        LockLayer::new(locker(manager(&server).await, ms(300)), key_of).layer(gate.clone());

    assert!(poll_ready_once(&mut svc).await.is_pending());
    assert!(
        timeout(ms(100), svc.ready()).await.is_err(),
        "ready while the inner service is not"
    );
    let waiting = tokio::spawn(async move {
        svc.ready().await.expect("ready");
        svc
    });
    sleep(ms(20)).await;
    gate.open();
    let mut svc = timeout(BOUNDED, waiting).await.unwrap().unwrap();
    assert_eq!(svc.call(msg("k", 9)).await.unwrap(), Outcome::Done(9));

    gate.broken.store(true, Ordering::SeqCst);
    match poll_ready_once(&mut svc).await {
        Poll::Ready(Err(e)) => assert_eq!(e.to_string(), "inner service broken"),
        other => panic!("expected the inner readiness error, got {other:?}"),
    }
}

#[tokio::test]
async fn composes_in_a_service_builder() {
    let server = server();
    // A request adapter outside the lock layer, the whole stack boxed into a
    // cloneable service.
    let svc = ServiceBuilder::new()
        .boxed_clone()
        .map_request(|(key, work): (&'static str, u64)| msg(key, work as u32))
        .layer(
            LockLayer::new(locker(manager(&server).await, secs(30)), key_of)
                .on_conflict(OnConflict::retry(backoff(5, 20).max_attempts(100)).then_fail()),
        )
        .service_fn(|m: Msg| async move {
            sleep(ms(u64::from(m.n))).await;
            Ok::<_, BoxError>(m.n)
        });

    assert_eq!(
        svc.clone().oneshot(("k", 1)).await.unwrap(),
        Outcome::Done(1)
    );

    // Two calls on one key through clones of the stack: both get through.
    let (a, b) = tokio::join!(
        svc.clone().oneshot(("k", 30)),
        svc.clone().oneshot(("k", 30))
    );
    assert_eq!(
        (a.unwrap(), b.unwrap()),
        (Outcome::Done(30), Outcome::Done(30))
    );
}

/// tower's `TimeoutLayer` outside the lock layer drops a call that runs too
/// long: its lock is released at once, not left to its 30 s TTL. Inside the
/// lock layer the timeout is the handler's error, and the lock is released
/// before the call returns.
#[tokio::test]
async fn a_timeout_layer_releases_the_lock_of_a_timed_out_call_at_once() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, secs(30));
    let lock_key = layer_locker.lock_key("k");
    let lock_layer = LockLayer::new(layer_locker, key_of);
    let started = Arc::new(tokio::sync::Notify::new());
    let other = locker(conn.clone(), ms(300));

    let outside = ServiceBuilder::new()
        .timeout(ms(200))
        .layer(lock_layer.clone())
        .service(slow_handler(started.clone(), secs(60)));
    let err = outside.oneshot(msg("k", 1)).await.unwrap_err();
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err:?}");
    timeout(BOUNDED, started.notified())
        .await
        .expect("the handler ran, so the lock was held");
    wait_gone(&conn, &lock_key).await;
    let lease = acquired(&other, "k").await;
    other.release(&lease).await.unwrap();

    let inside = ServiceBuilder::new()
        .layer(lock_layer)
        .timeout(ms(200))
        .service(slow_handler(started.clone(), secs(60)));
    let err = inside.oneshot(msg("k", 2)).await.unwrap_err();
    assert!(err.is::<tower::timeout::error::Elapsed>(), "{err:?}");
    assert!(
        !held(&conn, &lock_key).await,
        "released before the call returned"
    );
    let lease = acquired(&other, "k").await;
    other.release(&lease).await.unwrap();
}

/// tower's `ConcurrencyLimitLayer` inside the lock layer: the lock layer's
/// `poll_ready` is the limit's, so callers see its back-pressure, whatever
/// their keys. A call that gives up on a busy key hands its permit back.
#[tokio::test]
async fn a_concurrency_limit_inside_applies_back_pressure_through_the_lock_layer() {
    let server = server();
    let (started, go) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let svc = ServiceBuilder::new()
        .layer(LockLayer::new(
            locker(manager(&server).await, secs(30)),
            key_of,
        ))
        .concurrency_limit(1)
        .service_fn({
            let (started, go) = (started.clone(), go.clone());
            move |m: Msg| {
                let (started, go) = (started.clone(), go.clone());
                async move {
                    started.notify_one();
                    go.notified().await;
                    Ok::<_, BoxError>(m.n)
                }
            }
        });

    let first = tokio::spawn(svc.clone().oneshot(msg("a", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    let mut second = svc.clone();
    assert!(poll_ready_once(&mut second).await.is_pending());
    assert!(
        timeout(ms(100), second.ready()).await.is_err(),
        "ready while the only permit is taken"
    );
    go.notify_one();
    let outcome = timeout(BOUNDED, first).await.unwrap().unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Done(1));
    timeout(BOUNDED, second.ready())
        .await
        .expect("ready once the first call ended")
        .unwrap();
    go.notify_one(); // lets the next handler finish at once
    assert_eq!(second.call(msg("b", 2)).await.unwrap(), Outcome::Done(2));

    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "busy").await;
    let err = svc.clone().oneshot(msg("busy", 3)).await.unwrap_err();
    assert_eq!(downcast::<Contended>(&err).key(), "busy");
    timeout(BOUNDED, svc.clone().ready())
        .await
        .expect("the permit was handed back")
        .unwrap();
    holder.release(&lease).await.unwrap();
}

/// tower's `ConcurrencyLimitLayer` outside the lock layer bounds the calls in
/// flight, taking their locks included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrency_limit_outside_bounds_the_calls_in_flight() {
    let server = server();
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let svc = ServiceBuilder::new()
        .concurrency_limit(2)
        .layer(LockLayer::new(
            locker(manager(&server).await, secs(30)),
            key_of,
        ))
        .service_fn({
            let (running, most) = (running.clone(), most.clone());
            move |m: Msg| {
                let (running, most) = (running.clone(), most.clone());
                async move {
                    most.fetch_max(running.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                    sleep(ms(20)).await;
                    running.fetch_sub(1, Ordering::SeqCst);
                    Ok::<_, BoxError>(m.n)
                }
            }
        });
    let calls: Vec<_> = (0..8)
        .map(|n| tokio::spawn(svc.clone().oneshot(msg(&format!("k{n}"), n))))
        .collect();
    for (n, call) in (0..).zip(calls) {
        let outcome = timeout(BOUNDED, call).await.unwrap().unwrap();
        assert_eq!(outcome.unwrap(), Outcome::Done(n));
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 2, "{most} calls ran at once under a limit of 2");
}

/// tower's `BufferLayer` outside the lock layer: callers share one lock
/// layer through the buffer's worker. `HeldLock::current()` still works in
/// the handler (the `Recorder` asserts it): the lock layer is inside the
/// buffer, so it still wraps the handler's future in its task-local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_layer_outside_serves_callers_through_one_lock_layer() {
    let server = server();
    let recorder = Recorder::new(ms(3));
    let svc = ServiceBuilder::new()
        .buffer(4)
        .layer(
            LockLayer::new(locker(manager(&server).await, secs(30)), key_of).on_conflict(
                OnConflict::retry(backoff(2, 20).unlimited_attempts().max_elapsed(BOUNDED)),
            ),
        )
        .service(recorder.clone());
    let calls: Vec<_> = (0..16)
        .map(|n| tokio::spawn(svc.clone().oneshot(msg(&format!("k{}", n % 2), n))))
        .collect();
    for call in calls {
        let outcome = timeout(BOUNDED, call).await.unwrap().unwrap();
        assert_eq!(outcome.unwrap(), Outcome::Done(()));
    }
    let intervals = recorder.intervals();
    assert_eq!(intervals.len(), 16, "one handler run per call");
    assert_no_overlap(intervals);
}

// ---------------------------------------------------------------------------
// Cancellation while talking to Redis (regression tests)
// ---------------------------------------------------------------------------

/// A connection that delays every command before sending it and/or after its
/// reply arrived, by amounts the test sets while it runs. Models a slow
/// network or a busy server.
#[derive(Clone)]
struct Delayed {
    inner: ConnectionManager,
    before: Arc<Mutex<Duration>>,
    after: Arc<Mutex<Duration>>,
    /// When set, each reply is replaced by a timeout error (after `after`),
    /// although the server ran the command: a lost reply.
    lose_replies: Arc<AtomicBool>,
}

impl Delayed {
    fn new(inner: ConnectionManager) -> Self {
        Self {
            inner,
            before: Arc::default(),
            after: Arc::default(),
            lose_replies: Arc::default(),
        }
    }
}

impl ConnectionLike for Delayed {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let before = *self.before.lock().unwrap();
            sleep(before).await;
            let reply = self.inner.req_packed_command(cmd).await;
            let after = *self.after.lock().unwrap();
            sleep(after).await;
            if self.lose_replies.load(Ordering::SeqCst) {
                let lost = std::io::Error::new(std::io::ErrorKind::TimedOut, "reply lost (test)");
                return Err(lost.into());
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.inner.req_packed_commands(pipeline, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// Regression: the acquire once was not cancellation-safe. When the response future is dropped after the server
/// ran the acquire script but before its reply was processed (a timeout
/// around the call, a slow reply), nobody holds the new token, and the lock
/// stays for its whole TTL.
#[tokio::test]
async fn dropped_during_acquire_does_not_leak_the_lock() {
    let server = server();
    let conn = manager(&server).await;
    let delayed = Delayed::new(manager(&server).await);
    let layer_locker = locker(delayed.clone(), secs(30));
    let lock_key = layer_locker.lock_key("k");
    // Warm up the layer's locker (it finds out how to publish on its first
    // acquire), so the acquire below is one command.
    layer_locker
        .release(&acquired(&layer_locker, "warm-up").await)
        .await
        .unwrap();
    let svc = LockLayer::new(layer_locker, key_of).layer(Counter::default());

    *delayed.after.lock().unwrap() = ms(500); // the reply is slow to arrive
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    sleep(ms(150)).await; // the script has run on the server by now
    assert!(
        held(&conn, &lock_key).await,
        "the acquire reached the server"
    );
    call.abort();
    let _ = call.await;
    *delayed.after.lock().unwrap() = Duration::ZERO;

    wait_gone(&conn, &lock_key).await;
}

/// Regression: the lease once was taken out of the guard before the release round trip, so a response future
/// dropped while the release is in flight (not yet written to the socket)
/// neither finishes the release nor lets the guard's `Drop` spawn one. The
/// lock stays for its whole TTL.
#[tokio::test]
async fn dropped_during_release_does_not_leak_the_lock() {
    let server = server();
    let conn = manager(&server).await;
    let delayed = Delayed::new(manager(&server).await);
    let layer_locker = locker(delayed.clone(), secs(30));
    let lock_key = layer_locker.lock_key("k");
    let (tx, rx) = oneshot::channel::<()>();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn({
        let delayed = delayed.clone();
        move |_m: Msg| {
            // The next command on the locker's connection is the release:
            // make it slow to leave.
            *delayed.before.lock().unwrap() = ms(500);
            if let Some(tx) = tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            async { Ok::<_, BoxError>(()) }
        }
    }));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, rx).await.unwrap().unwrap();
    sleep(ms(100)).await; // the call is now waiting on its release
    call.abort();
    let _ = call.await;
    *delayed.before.lock().unwrap() = Duration::ZERO;

    wait_gone(&conn, &lock_key).await;
}

/// Regression: the renewal once was awaited inside the `select!` arm, so
/// while an extend was in flight the handler's future was not polled and
/// its completion not noticed. A handler that finishes
/// well inside its TTL while Redis is slow (a reconnect, a response timeout)
/// waits for the extend; if the lock ran out meanwhile, its successful
/// result is discarded and the call fails with `LockLost`.
#[tokio::test]
async fn a_finished_handler_does_not_wait_for_a_slow_renewal() {
    let server = server();
    let conn = manager(&server).await;
    let delayed = Delayed::new(manager(&server).await);
    let layer_locker = locker(delayed.clone(), ms(300)); // renewals every 100 ms
    let warm = locker(conn.clone(), ms(300));
    warm.release(&acquired(&warm, "warm-up").await)
        .await
        .unwrap();

    let (go_tx, go_rx) = oneshot::channel::<()>();
    let go_rx = Arc::new(Mutex::new(Some(go_rx)));
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn({
        let started = started.clone();
        move |_m: Msg| {
            let (go_rx, started) = (go_rx.lock().unwrap().take(), started.clone());
            async move {
                started.notify_one();
                go_rx.expect("one call").await.expect("go");
                Ok::<_, BoxError>("finished")
            }
        }
    }));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    // From now on Redis is slow to take commands: the first renewal hangs.
    *delayed.before.lock().unwrap() = secs(3);
    sleep(ms(150)).await; // the renewal is in flight, and hangs
    // Later commands (the release) go through at normal speed.
    *delayed.before.lock().unwrap() = Duration::ZERO;
    go_tx.send(()).unwrap(); // the handler finishes, inside its TTL

    let outcome = timeout(ms(1000), call)
        .await
        .expect("the call ends when its handler does")
        .unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Done("finished"));
}

/// A handler that blocks its thread past the TTL gets no renewal: if another
/// holder takes the key meanwhile, the call must not claim success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_lost_while_the_handler_blocked_is_reported() {
    let server = server();
    let conn = manager(&server).await;
    let svc =
        LockLayer::new(locker(conn.clone(), ms(300)), key_of).layer(service_fn(|_: Msg| async {
            // Blocks the thread: no renewal can run.
            std::thread::sleep(Duration::from_millis(900));
            Ok::<_, BoxError>(())
        }));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    sleep(ms(500)).await; // past the TTL
    let rival = locker(conn.clone(), ms(5_000));
    let lease = acquired(&rival, "k").await;
    let error = call.await.unwrap().expect_err("the lock was lost");
    let lost = error.downcast_ref::<LockLost>().expect("LockLost");
    assert!(lost.completed);
    // The rival's lock is untouched.
    assert!(rival.release(&lease).await.unwrap());
}

// ---------------------------------------------------------------------------
// The watchdog's local deadline, renewal faults (issue 8, items 7 and 9)
// ---------------------------------------------------------------------------

/// A multiplexed connection whose requests fail after `response_timeout`
/// (`None`: wait for ever, as cluster connections do by default).
async fn multiplexed(
    server: &RedisServer,
    response_timeout: Option<Duration>,
) -> redis::aio::MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(response_timeout);
    server
        .client()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("multiplexed connection to the test server")
}

/// Loads the acquire, extend and release scripts, so that later calls are
/// plain EVALSHAs (which a `CLIENT PAUSE ... WRITE` holds back).
async fn load_lock_scripts(conn: &ConnectionManager) {
    let warm = locker(conn.clone(), ms(300));
    let mut lease = acquired(&warm, "warm-up").await;
    assert!(warm.extend(&mut lease, ms(300)).await.unwrap());
    warm.fence(&lease).await.unwrap();
    // A busy key runs the contend script.
    assert!(warm.acquire("warm-up").await.unwrap().lease().is_none());
    assert!(warm.release(&lease).await.unwrap());
}

/// Holds back every write and script on the server for `pause` (expiry is
/// paused too); reads still go through.
async fn pause_writes(conn: &ConnectionManager, pause: Duration) -> Instant {
    let millis = pause.as_millis().to_string();
    let _: () = raw(conn, &["CLIENT", "PAUSE", &millis, "WRITE"]).await;
    Instant::now()
}

/// Item 9: a renewal that hangs (no response timeout) must not keep the
/// lock "held" past its lease: once the lease's expiry passes without a
/// confirmed renewal, `HeldLock::lost()` fires.
#[tokio::test]
async fn a_hung_renewal_signals_the_loss_when_the_lease_runs_out() {
    let server = server();
    let conn = manager(&server).await;
    load_lock_scripts(&conn).await;
    let ttl = ms(300);
    let pause = secs(3);
    let layer_locker = locker(multiplexed(&server, None).await, ttl);
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of).layer(service_fn({
        let started = started.clone();
        move |_m: Msg| {
            let started = started.clone();
            async move {
                let held = HeldLock::current().expect("inside a locked call");
                started.notify_one();
                // Returns when the loss is signalled (or never, as before).
                timeout(pause + secs(2), held.lost())
                    .await
                    .map_err(|_| BoxError::from("lost() did not fire while the renewal hung"))?;
                Ok::<_, BoxError>(Instant::now())
            }
        }
    }));
    let called = Instant::now();
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    // The first renewal (a third of the TTL in) hangs until the pause ends.
    let paused = pause_writes(&conn, pause).await;

    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    assert_lost_at_the_deadline(&err, true, called, ttl, paused, pause);
}

/// The loss of "k" was reported (`completed` as given) once its lease ran
/// out (no earlier than `ttl` after the call began) and while the renewal
/// still hung (before the pause of the server's writes ended).
fn assert_lost_at_the_deadline(
    err: &BoxError,
    completed: bool,
    called: Instant,
    ttl: Duration,
    paused: Instant,
    pause: Duration,
) {
    let ended = Instant::now();
    let lost = downcast::<LockLost>(err);
    assert_eq!((&*lost.key, lost.completed), ("k", completed));
    assert!(
        ended < paused + pause,
        "the loss was reported only {:?} after the pause began",
        ended - paused
    );
    assert!(
        ended >= called + ttl,
        "the loss was reported {:?} after the call began, before the lease could run out",
        ended - called
    );
}

/// Item 9: under `OnLost::Cancel`, a hung renewal cancels the handler near
/// the lease's expiry, not whenever the renewal's reply comes.
#[tokio::test]
async fn on_lost_cancel_cancels_when_a_hung_renewal_outlives_the_lease() {
    let server = server();
    let conn = manager(&server).await;
    load_lock_scripts(&conn).await;
    let ttl = ms(300);
    let pause = secs(3);
    let layer_locker = locker(multiplexed(&server, None).await, ttl);
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of)
        .on_lost(OnLost::Cancel)
        .layer(slow_handler(started.clone(), secs(30)));
    let called = Instant::now();
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    let paused = pause_writes(&conn, pause).await;

    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    assert_lost_at_the_deadline(&err, false, called, ttl, paused, pause);
}

/// Item 9, the other side of the local deadline: renewals are scheduled from
/// the lease (a third of the TTL after the last confirmed one was sent), so
/// replies that are slow but keep coming never let the deadline pass.
#[tokio::test]
async fn slow_renewal_replies_do_not_make_the_lock_count_as_lost() {
    let server = server();
    let conn = manager(&server).await;
    load_lock_scripts(&conn).await;
    // Each reply takes 800 ms: renewing a third of the TTL after the last
    // reply came (800 + 667 + 800 ms) would confirm too late for a 2 s TTL;
    // renewing from the lease confirms 1,467 ms into each lease, over 500 ms
    // before it runs out (slack for a loaded machine).
    let ttl = secs(2);
    let slow = Delayed::new(manager(&server).await);
    *slow.after.lock().unwrap() = ttl * 2 / 5;
    let svc = LockLayer::new(locker(slow, ttl), key_of)
        .on_lost(OnLost::Cancel)
        .layer(service_fn(|_m: Msg| async move {
            let held = HeldLock::current().expect("inside a locked call");
            sleep(secs(5)).await;
            Ok::<_, BoxError>(held.is_lost())
        }));
    let outcome = timeout(BOUNDED, svc.oneshot(msg("k", 1)))
        .await
        .unwrap()
        .expect("the lock was kept");
    assert_eq!(outcome, Outcome::Done(false));
}

/// Item 9: an acquire whose reply arrives after the lease it grants has run
/// out must not start the handler: the lock is released and the try counts
/// as a failed one (here, under `fail()`: `Contended`, retry at once).
#[tokio::test]
async fn a_lease_expired_on_arrival_does_not_start_the_handler() {
    let server = server();
    let conn = manager(&server).await;
    load_lock_scripts(&conn).await;
    let layer_locker = locker(multiplexed(&server, None).await, ms(500));
    let lock_key = layer_locker.lock_key("k");
    let counter = Counter::default();
    let svc = LockLayer::new(layer_locker, key_of).layer(counter.clone());
    // The acquire is held back for longer than its TTL.
    pause_writes(&conn, secs(1)).await;
    let err = timeout(BOUNDED, svc.oneshot(msg("k", 1)))
        .await
        .unwrap()
        .expect_err("no handler runs on an expired lease");
    assert_eq!(counter.calls(), 0, "the handler ran on an expired lease");
    let busy = downcast::<Contended>(&err);
    assert_eq!((busy.key(), busy.retry_after()), ("k", Duration::ZERO));
    // Released, not left to its TTL (500 ms from the end of the pause).
    assert!(!held(&conn, &lock_key).await, "the late lock was kept");
}

/// Item 7: a renewal that fails with a transport error (not a confirmed
/// loss) must not strand the lock. Here every renewal runs on the server
/// (renewing the lock for a whole TTL) but its reply is lost; when the call
/// gives the lock up as lost, it must still release it (token-checked)
/// instead of leaving it a full TTL with nobody owning it.
#[tokio::test]
async fn a_renewal_whose_reply_is_lost_still_releases_the_lock() {
    let server = server();
    let conn = manager(&server).await;
    load_lock_scripts(&conn).await;
    let ttl = ms(1500);
    let lossy = Delayed::new(manager(&server).await);
    let layer_locker = locker(lossy.clone(), ttl);
    let lock_key = layer_locker.lock_key("k");
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of)
        .on_lost(OnLost::Cancel)
        .layer(slow_handler(started.clone(), secs(30)));
    let call = tokio::spawn(svc.oneshot(msg("k", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    // From now on the server runs each command, and its reply is lost
    // 50 ms later (as with a response timeout).
    *lossy.after.lock().unwrap() = ms(50);
    lossy.lose_replies.store(true, Ordering::SeqCst);

    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    assert!(!downcast::<LockLost>(&err).completed);
    // The last renewal ran shortly before the lease ran out and renewed the
    // lock for 1.5 s: only a release explains it gone within 500 ms.
    eventually("the lock is released", ms(500), async || {
        let value: Option<String> = raw(&conn, &["GET", &lock_key]).await;
        done_if(value.is_none(), format_args!("{value:?}"))
    })
    .await;
}

// ---------------------------------------------------------------------------
// Retry budget (issue 8, item 18)
// ---------------------------------------------------------------------------

/// Item 18: time in the local FIFO counts against the retry budget: a call
/// that waited behind a local holder for most of its `max_attempts` budget
/// does not then get all its tries again.
#[tokio::test]
async fn waiting_behind_local_holders_counts_against_max_attempts() {
    let server = server();
    let conn = manager(&server).await;
    let layer_locker = locker(manager(&server).await, secs(30));
    let lock_key = layer_locker.lock_key("hot");
    // 100 waits of at most 40 ms: a budget of 4 s.
    let retry = backoff(40, 40).max_attempts(101);
    let budget = retry.budget().unwrap();
    let (go_tx, go_rx) = oneshot::channel::<()>();
    let go_rx = Arc::new(Mutex::new(Some(go_rx)));
    let started = Arc::new(tokio::sync::Notify::new());
    let svc = LockLayer::new(layer_locker, key_of)
        .on_conflict(OnConflict::retry(retry).then_fail())
        .layer(service_fn({
            let (conn, lock_key, started) = (conn.clone(), lock_key.clone(), started.clone());
            move |m: Msg| {
                let (conn, lock_key, started) = (conn.clone(), lock_key.clone(), started.clone());
                let go = go_rx.lock().unwrap().take();
                async move {
                    if let Some(go) = go {
                        started.notify_one();
                        go.await.expect("go");
                        // Another process takes the key as this one leaves:
                        // the next local caller finds it busy for good.
                        let _: () = raw(&conn, &["SET", &lock_key, "rival:1", "PX", "30000"]).await;
                    }
                    Ok::<_, BoxError>(m.n)
                }
            }
        }));
    let first = tokio::spawn(svc.clone().oneshot(msg("hot", 1)));
    timeout(BOUNDED, started.notified()).await.unwrap();
    let began = Instant::now();
    let second = tokio::spawn(svc.oneshot(msg("hot", 2)));
    // The second call waits in the local queue for 80% of its budget.
    sleep(budget * 4 / 5).await;
    go_tx.send(()).unwrap();
    let _ = timeout(BOUNDED, first).await.unwrap().unwrap();
    let err = timeout(BOUNDED, second)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    let took = began.elapsed();
    assert_eq!(downcast::<Contended>(&err).key(), "hot");
    // Sanity margin for round trips; before, it took the queue wait plus a
    // whole budget of tries (about 5.2 s).
    assert!(
        took < budget + ms(500),
        "gave up after {took:?}, budget {budget:?}"
    );
}

/// Item 18: `max_elapsed` bounds the whole call, round trips included.
#[tokio::test]
async fn max_elapsed_counts_round_trips() {
    let server = server();
    let holder = locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "hot").await; // also loads the scripts
    let delayed = Delayed::new(manager(&server).await);
    *delayed.before.lock().unwrap() = ms(100); // every round trip: 100 ms
    let limit = ms(300);
    let svc = LockLayer::new(locker(delayed, secs(30)), key_of)
        .on_conflict(OnConflict::retry(
            backoff(5, 20).unlimited_attempts().max_elapsed(limit),
        ))
        .layer(Counter::default());
    let began = Instant::now();
    let err = timeout(BOUNDED, svc.oneshot(msg("hot", 1)))
        .await
        .unwrap()
        .unwrap_err();
    let took = began.elapsed();
    assert_eq!(downcast::<Contended>(&err).key(), "hot");
    // The limit, plus the try in flight at the deadline, plus margin;
    // before, ~30 tries of 100 ms each (about 3 s).
    assert!(took < limit + ms(600), "gave up after {took:?}");
    holder.release(&lease).await.unwrap();
}
