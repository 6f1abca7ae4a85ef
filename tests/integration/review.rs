//! Tests for the ten suspected defects of the code review (issue 36), one
//! or two per item, written before any fix: each asserts what the library
//! should do (every message handled once, no stall, start orders, the
//! bounds an item is about). Faults are injected with `Faulty`, a
//! connection that fails or slows the commands a rule picks, and with
//! `CLIENT PAUSE`. Each test runs its own redis-server.

use crate::support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::layer::DeferDelay;
use lockgate::{
    BoxError, HeldLock, Job, LockLayer, Locker, OnConflict, OnLost, PushOptions, Queue, Worker,
};
use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};
use serde::{Deserialize, Serialize};
use support::{acquired, backoff, done_if, eventually, manager, ms, raw, secs, server, stop};
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tower::{ServiceBuilder, service_fn};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    n: u32,
    key: String,
}

fn msg(n: u32, key: &str) -> Msg {
    Msg {
        n,
        key: key.to_owned(),
    }
}

/// The queue every test uses, and its index of keyed partitions.
const QUEUE: &str = "q";
const INDEX: &str = "lockgate:{q}:partitions";

/// The lock a key's messages are claimed with.
fn lock_of(key: &str) -> String {
    format!("lockgate:lock:{{{key}}}")
}

/// Pushes message `n` with key `key` for each pair, in order.
async fn push_keyed<C>(queue: &Queue<Msg, C>, msgs: &[(u32, &str)])
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let msgs = msgs
        .iter()
        .map(|(n, key)| (msg(*n, key), PushOptions::new().key(*key)));
    queue.push_many_with(msgs).await.unwrap();
}

// ---------------------------------------------------------------------------
// Recording handlers
// ---------------------------------------------------------------------------

/// One handler start: the message, when, and its stalls before it.
#[derive(Debug, Clone)]
struct Start {
    n: u32,
    at: Instant,
    stalls: u32,
}

/// Every handler start, in order. Cloning shares the record.
#[derive(Clone, Default)]
struct Starts(Arc<Mutex<Vec<Start>>>);

impl Starts {
    fn record(&self, job: &Job<Msg>) {
        let (n, stalls) = (job.n, job.stalls());
        let at = Instant::now();
        self.0.lock().unwrap().push(Start { n, at, stalls });
    }

    fn all(&self) -> Vec<Start> {
        self.0.lock().unwrap().clone()
    }

    fn order(&self) -> Vec<u32> {
        self.all().iter().map(|s| s.n).collect()
    }

    /// How many times each message started.
    fn counts(&self) -> BTreeMap<u32, usize> {
        let mut counts = BTreeMap::new();
        for start in self.all() {
            *counts.entry(start.n).or_default() += 1;
        }
        counts
    }

    /// Whether every message of `ns` started within `within`.
    async fn started_within(&self, ns: &[u32], within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let counts = self.counts();
            if ns.iter().all(|n| counts.contains_key(n)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            sleep(ms(10)).await;
        }
    }

    /// Waits until every message of `ns` started (at most `within`).
    async fn until_started(&self, ns: &[u32], within: Duration) {
        let started = self.started_within(ns, within).await;
        assert!(
            started,
            "messages {ns:?} not all started within {within:?}: {:?}",
            self.order()
        );
    }

    /// The first start of message `n`, waited for up to `within`.
    async fn first(&self, n: u32, within: Duration) -> Start {
        self.until_started(&[n], within).await;
        self.all().into_iter().find(|s| s.n == n).unwrap()
    }

    fn assert_each_once_without_stalls(&self, ns: impl IntoIterator<Item = u32>) {
        let counts = self.counts();
        for n in ns {
            assert_eq!(counts.get(&n), Some(&1), "message {n}: {counts:?}");
        }
        let stalled: Vec<Start> = self.all().into_iter().filter(|s| s.stalls > 0).collect();
        assert!(stalled.is_empty(), "started after a stall: {stalled:?}");
    }
}

/// A handler that records its start, then works for `work`.
fn sleeping(
    starts: Starts,
    work: Duration,
) -> impl tower::Service<Job<Msg>, Response = (), Error = BoxError, Future = impl Send>
+ Clone
+ Send
+ 'static {
    service_fn(move |job: Job<Msg>| {
        let starts = starts.clone();
        async move {
            starts.record(&job);
            sleep(work).await;
            Ok::<_, BoxError>(())
        }
    })
}

/// A worker running in a task of its own, and what stops it.
type Running = (oneshot::Sender<()>, JoinHandle<lockgate::Result<()>>);

fn spawn<C, K, S>(worker: Worker<Msg, C, K, S>) -> Running
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: lockgate::queue::Connector,
    S: tower::Service<Job<Msg>> + Send + 'static,
    S::Response: lockgate::worker::WorkerResponse + Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    S::Future: Send + 'static,
{
    let (tx, shutdown) = support::shutdown_signal();
    (tx, tokio::spawn(worker.run_until(shutdown)))
}

async fn stop_all(runs: Vec<Running>) {
    for (tx, run) in runs {
        stop(tx, run).await;
    }
}

// ---------------------------------------------------------------------------
// Fault injection
// ---------------------------------------------------------------------------

/// What `Faulty` does with a command (or a pipeline holding it).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Pass,
    /// Fails without sending it, with an error reply (as an `OOM` would).
    Fail,
    /// Sends it, and hands its reply back this much later.
    SlowReply(Duration),
    /// Pauses the server for 1 s (`CLIENT PAUSE 1000 ALL`), then sends it.
    PauseFirst,
    /// Sends it twice and hands back the second reply: the first lost on
    /// the way, the call resent unchanged (as the library resends a call
    /// that is safe to resend).
    Twice,
}

type Rule = Arc<dyn Fn(&[Vec<u8>]) -> Fault + Send + Sync>;

/// A connection that fails or slows the commands its rule picks (by their
/// arguments); everything else goes through unchanged.
#[derive(Clone)]
struct Faulty<C = ConnectionManager> {
    inner: C,
    rule: Rule,
}

impl<C> Faulty<C> {
    fn new(inner: C, rule: impl Fn(&[Vec<u8>]) -> Fault + Send + Sync + 'static) -> Self {
        let rule = Arc::new(rule);
        Self { inner, rule }
    }

    /// The first fault the rule picks among `cmds`.
    fn fault<'a>(&self, cmds: impl Iterator<Item = &'a Cmd>) -> Fault {
        let args = |cmd: &Cmd| -> Vec<Vec<u8>> {
            let simple = cmd.args_iter().filter_map(|arg| match arg {
                redis::Arg::Simple(bytes) => Some(bytes.to_vec()),
                _ => None,
            });
            simple.collect()
        };
        let mut faults = cmds.map(|cmd| (self.rule)(&args(cmd)));
        faults.find(|f| *f != Fault::Pass).unwrap_or(Fault::Pass)
    }
}

fn injected() -> RedisError {
    (
        ErrorKind::Server(ServerErrorKind::ResponseError),
        "injected by the test",
    )
        .into()
}

/// Pauses the server for 1 s (its clients' commands wait, then run).
async fn pause_server(conn: &mut (impl ConnectionLike + Send)) -> redis::RedisResult<()> {
    let mut pause = redis::cmd("CLIENT");
    pause.arg("PAUSE").arg(1000).arg("ALL");
    pause.query_async(conn).await
}

impl<C: ConnectionLike + Send> ConnectionLike for Faulty<C> {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let fault = self.fault(std::iter::once(cmd));
        Box::pin(async move {
            match fault {
                Fault::Fail => return Err(injected()),
                Fault::PauseFirst => pause_server(&mut self.inner).await?,
                Fault::Twice => drop(self.inner.req_packed_command(cmd).await),
                _ => {}
            }
            let reply = self.inner.req_packed_command(cmd).await;
            if let Fault::SlowReply(late) = fault {
                sleep(late).await;
            }
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let fault = self.fault(pipeline.cmd_iter());
        Box::pin(async move {
            match fault {
                Fault::Fail => return Err(injected()),
                Fault::PauseFirst => pause_server(&mut self.inner).await?,
                Fault::Twice => {
                    let first = self.inner.req_packed_commands(pipeline, offset, count);
                    drop(first.await);
                }
                _ => {}
            }
            let reply = self
                .inner
                .req_packed_commands(pipeline, offset, count)
                .await;
            if let Fault::SlowReply(late) = fault {
                sleep(late).await;
            }
            reply
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// Whether `args` is an `EVALSHA` or an `FCALL` over `keys` keys (a keyed
/// script over a partition takes its 14 keys and more: the settlement 19).
fn is_script(args: &[Vec<u8>], keys: usize) -> bool {
    let call = args
        .first()
        .is_some_and(|c| c == b"EVALSHA" || c == b"FCALL");
    call && args.len() > 2 && args[2] == keys.to_string().as_bytes()
}

/// Whether one of `args` is `text`.
fn names(args: &[Vec<u8>], text: &str) -> bool {
    args.iter().any(|arg| arg == text.as_bytes())
}

/// Whether `args` marks a partition ready in the queue's index (`ZADD
/// <index> LT 0 <slot>`, sent after a keyed script).
fn marks_ready(args: &[Vec<u8>]) -> bool {
    args.len() > 2 && args[0] == b"ZADD" && args[1] == INDEX.as_bytes() && args[2] == b"LT"
}

/// A rule that fails the first command `picks` matches once armed, then
/// disarms and notifies.
fn fail_once(
    armed: &Arc<AtomicBool>,
    fired: &Arc<Notify>,
    picks: fn(&[Vec<u8>]) -> bool,
) -> impl Fn(&[Vec<u8>]) -> Fault + Send + Sync + 'static {
    let (armed, fired) = (armed.clone(), fired.clone());
    move |args| {
        if picks(args) && armed.swap(false, Ordering::SeqCst) {
            fired.notify_one();
            return Fault::Fail;
        }
        Fault::Pass
    }
}

// ---------------------------------------------------------------------------
// 1. Renewal behind a recovery sweep of every slot ever used
// ---------------------------------------------------------------------------

/// An index listing every slot (as one a busy queue ends up with) makes
/// each recovery sweep 16,384 round trips (seconds); renewal must not wait
/// behind it. Worker A claims the message while it sweeps; worker B starts
/// 700 ms later (its first sweep visits the message's partition first) and
/// must find the lease renewed: a lapsed lease hands the running message
/// to a second handler. The padding is due long after the test, so that
/// claims pass it by and sweeps visit it after the partitions in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_does_not_wait_behind_a_recovery_sweep_of_a_padded_index() {
    let server = server();
    let conn = manager(&server).await;
    let mut pad = redis::cmd("ZADD");
    pad.arg(INDEX);
    for slot in 0..16_384u32 {
        pad.arg(1_000_000_000_000_000u64).arg(slot);
    }
    let _: () = pad.query_async(&mut conn.clone()).await.unwrap();
    let starts = Starts::default();
    let worker = |queue| {
        let worker = Worker::new(server.client(), queue, sleeping(starts.clone(), ms(1500)));
        spawn(worker.lease(ms(300)).unwrap())
    };
    let mut runs = vec![worker(Queue::new(manager(&server).await, QUEUE).unwrap())];
    let queue: Queue<Msg> = Queue::new(conn, QUEUE).unwrap();
    push_keyed(&queue, &[(1, "k")]).await;
    let first = starts.first(1, secs(20)).await;
    tokio::time::sleep_until(first.at + ms(700)).await;
    runs.push(worker(Queue::new(manager(&server).await, QUEUE).unwrap()));
    // The handler's 1.5 s, and a margin for a second start.
    tokio::time::sleep_until(first.at + ms(2500)).await;
    let started = starts.all();
    stop_all(runs).await;
    assert_eq!(
        started.len(),
        1,
        "the message started more than once: {started:?}"
    );
}

/// Once a partition's keyed messages are all done, the next claim that
/// visits it leaves it out of the index: the sweep's cost follows the
/// slots in use, not every slot ever used. (A claim that found a message
/// at work left the entry raised for 2 s, `CLAIMING_MS`: the claim after
/// that visits it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_forgets_partitions_with_nothing_left() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    push_keyed(&queue, &[(1, "a"), (2, "b"), (3, "c")]).await;
    let starts = Starts::default();
    let worker = Worker::new(
        server.client(),
        queue.clone(),
        sleeping(starts.clone(), ms(1)),
    );
    let metrics = worker.metrics();
    let run = spawn(worker);
    eventually("every message done", secs(20), async || {
        let s = metrics.snapshot();
        done_if(s.done == 3, s)
    })
    .await;
    stop_all(vec![run]).await;
    sleep(ms(2100)).await;
    queue.recover(3).await.unwrap();
    let claimed = queue.claim(10, secs(5)).await.unwrap();
    assert!(claimed.jobs.is_empty());
    let listed: Vec<String> = raw(&conn, &["ZRANGE", INDEX, "0", "-1"]).await;
    assert!(
        listed.is_empty(),
        "emptied partitions still indexed: {listed:?}"
    );
}

// ---------------------------------------------------------------------------
// 2. Failing renewals of some keys stop the renewals of the healthy ones
// ---------------------------------------------------------------------------

/// The renewals of three keys' messages (0 to 2) fail every time on one
/// worker's connection: the messages of five other keys that it runs are
/// renewed all the same, and a second worker never runs them again. (On one
/// server every key's line is in the queue's one partition, so the failure
/// is the keys' own; on 0.1 it was a partition's, a slot of the keys' locks.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_renewals_of_some_keys_do_not_stop_the_renewal_of_the_others() {
    let server = server();
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let bad: Vec<String> = keys[..3]
        .iter()
        .map(|k| format!("lockgate:lock:{{{k}}}"))
        .collect();
    // The renewal: 15 keys per message, the 15th a lock (a claim naming no
    // key has 15 too, the last its record). The worker renews its keyed
    // messages in one call; that call fails, and so does each message of
    // the bad keys renewed alone after it.
    let renews = |args: &[Vec<u8>]| {
        if args.len() < 18 {
            return false;
        }
        let keys = std::str::from_utf8(&args[2])
            .ok()
            .and_then(|n| n.parse::<usize>().ok());
        args[0] == b"EVALSHA"
            && keys.is_some_and(|keys| keys > 0 && keys % 15 == 0)
            && args[17].starts_with(b"lockgate:lock:")
    };
    let rule = move |args: &[Vec<u8>]| match renews(args) && bad.iter().any(|b| names(args, b)) {
        true => Fault::Fail,
        false => Fault::Pass,
    };
    let faulty: Queue<Msg, Faulty> =
        Queue::new(Faulty::new(manager(&server).await, rule), QUEUE).unwrap();
    let starts = Starts::default();
    let first = Worker::new(
        server.client(),
        faulty.clone(),
        sleeping(starts.clone(), secs(2)),
    );
    let mut runs = vec![spawn(first.concurrency(8).unwrap().lease(ms(300)).unwrap())];
    let msgs: Vec<(u32, &str)> = (0..8).map(|n| (n, keys[n as usize].as_str())).collect();
    push_keyed(&faulty, &msgs).await;
    let all: Vec<u32> = (0..8).collect();
    starts.until_started(&all, secs(20)).await;
    let clean: Queue<Msg> = Queue::new(manager(&server).await, QUEUE).unwrap();
    let second = Worker::new(server.client(), clean, sleeping(starts.clone(), secs(2)));
    runs.push(spawn(
        second.concurrency(8).unwrap().lease(ms(300)).unwrap(),
    ));
    // The healthy handlers end within 2 s of their start.
    sleep(secs(3)).await;
    let counts = starts.counts();
    stop_all(runs).await;
    for n in 3..8 {
        let runs = counts.get(&n);
        assert_eq!(runs, Some(&1), "healthy message {n} ran again: {counts:?}");
    }
}

// ---------------------------------------------------------------------------
// 3. Permits: a continued message overtakes one waiting in the buffer
// ---------------------------------------------------------------------------

/// A key with 2 permits on a worker with one handler slot: P2 is claimed
/// into the buffer while P1 runs, and P1's acknowledgement continues with
/// P3. They start in push order all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_permit_message_does_not_overtake_one_waiting_in_the_buffer() {
    let server = server();
    let queue: Queue<Msg> = Queue::new(manager(&server).await, QUEUE).unwrap();
    let msgs = (1..=3).map(|n| (msg(n, "k"), PushOptions::new().key("k").permits(2)));
    queue.push_many_with(msgs).await.unwrap();
    let starts = Starts::default();
    let recorded = starts.clone();
    let service = service_fn(move |job: Job<Msg>| {
        let starts = recorded.clone();
        async move {
            starts.record(&job);
            // P1 runs long enough for P2 to be claimed into the buffer.
            sleep(if job.n == 1 { ms(300) } else { ms(10) }).await;
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue, service);
    let run = spawn(worker.concurrency(1).unwrap());
    starts.until_started(&[1, 2, 3], secs(20)).await;
    stop_all(vec![run]).await;
    assert_eq!(starts.order(), [1, 2, 3], "not in push order");
}

// ---------------------------------------------------------------------------
// 4. defer_to_key copies, then removes
// ---------------------------------------------------------------------------

/// An unkeyed message whose key A is busy moves into A's line; the index
/// update after the copy fails once. The message still runs exactly once:
/// the retried original and the copy in A's line (found by the next push
/// with the key) are not both live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deferral_into_the_key_s_line_that_fails_halfway_runs_the_message_once() {
    let server = server();
    let conn = manager(&server).await;
    let (armed, fired) = (Arc::new(AtomicBool::new(true)), Arc::new(Notify::new()));
    let rule = fail_once(&armed, &fired, marks_ready);
    let queue: Queue<Msg, Faulty> =
        Queue::new(Faulty::new(manager(&server).await, rule), QUEUE).unwrap();
    let holder = support::locker(conn.clone(), secs(30));
    let lease = acquired(&holder, "A").await;
    let starts = Starts::default();
    let layer =
        LockLayer::new(Locker::new(conn.clone()), |job: &Job<Msg>| job.key.clone()).on_conflict(
            OnConflict::defer(queue.clone(), DeferDelay::until_released()),
        );
    let service = ServiceBuilder::new()
        .layer(layer)
        .service(sleeping(starts.clone(), ms(10)));
    let worker = Worker::new(server.client(), queue.clone(), service);
    let run = spawn(worker.retry_backoff(backoff(300, 300)));
    queue.push(msg(1, "A")).await.unwrap();
    timeout(secs(10), fired.notified())
        .await
        .expect("the index update after the copy into A's line was tried");
    // A is free before the original's retry is due.
    assert!(holder.release(&lease).await.unwrap());
    starts.until_started(&[1], secs(10)).await;
    // A push with the key marks its partition: whatever waits in A's line
    // runs before it.
    push_keyed(&queue, &[(2, "A")]).await;
    starts.until_started(&[2], secs(10)).await;
    sleep(ms(300)).await;
    stop_all(vec![run]).await;
    assert_eq!(
        starts.counts().get(&1),
        Some(&1),
        "order: {:?}",
        starts.order()
    );
}

// ---------------------------------------------------------------------------
// 5. A claim or a continuing acknowledgement whose reply is lost
// ---------------------------------------------------------------------------

/// A multiplexed connection whose requests give up after `timeout` while
/// the connection stays: the server runs a paused command later, and its
/// reply is lost.
async fn impatient_connection(
    server: &lockgate::testing::RedisServer,
    timeout: Duration,
) -> MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
    let client = server.client();
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connection to the test server")
}

/// Runs each keyed script once, so that the server has them all loaded (as
/// it has on a queue in use): a script sent during a pause then runs at
/// its end rather than answering `NOSCRIPT`.
async fn warm_up<C>(queue: &Queue<Msg, C>)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    push_keyed(queue, &[(99, "warm")]).await;
    let claimed = queue.claim(1, secs(5)).await.unwrap();
    let job = claimed.jobs.first().expect("the warm-up message");
    assert_eq!(queue.extend([job], secs(5)).await.unwrap(), [true]);
    assert!(queue.ack_and_next(job, secs(5)).await.unwrap().0);
    queue.recover(3).await.unwrap();
}

/// Whether `args` is the keyed claim script taking key k's head.
fn claims_k(args: &[Vec<u8>]) -> bool {
    is_script(args, 19) && names(args, &lock_of("k")) && !names(args, "PUBLISH")
}

/// Whether `args` is the keyed settlement acknowledging a message of key k.
fn acks_k(args: &[Vec<u8>]) -> bool {
    is_script(args, 19) && names(args, &lock_of("k")) && names(args, "ack")
}

/// The server is paused for 1 s (`CLIENT PAUSE 1000 ALL`) just before the
/// worker sends the first script `picks` (the claim taking message 1 of
/// key k, or the acknowledgement of message 1 continuing with message 2):
/// the script runs at the pause's end, after the connection's 500 ms
/// response timeout, and its reply is lost. Message `next` must start
/// soon after the pause ends (the lease is 5 s), each message once and
/// without a stall, and no lease counts as lost.
async fn lost_reply(picks: fn(&[Vec<u8>]) -> bool, next: u32) {
    lost_reply_of(picks, next, true).await;
}

/// Whether `args` is the claim script of messages without a key.
fn claims_plain(args: &[Vec<u8>]) -> bool {
    (is_script(args, 8) || is_script(args, 9)) && names(args, "lockgate:{q}:claims")
}

/// As `lost_reply`, for messages with key k (`keyed`) or without a key.
async fn lost_reply_of(picks: fn(&[Vec<u8>]) -> bool, next: u32, keyed: bool) {
    let server = server();
    let conn = impatient_connection(&server, ms(500)).await;
    let (armed, pause_end) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(None)));
    let (arm, paused) = (armed.clone(), pause_end.clone());
    let rule = move |args: &[Vec<u8>]| {
        if picks(args) && arm.swap(false, Ordering::SeqCst) {
            *paused.lock().unwrap() = Some(Instant::now() + secs(1));
            return Fault::PauseFirst;
        }
        Fault::Pass
    };
    let queue: Queue<Msg, Faulty<MultiplexedConnection>> =
        Queue::new(Faulty::new(conn, rule), QUEUE).unwrap();
    warm_up(&queue).await;
    armed.store(true, Ordering::SeqCst);
    match keyed {
        true => push_keyed(&queue, &[(1, "k"), (2, "k")]).await,
        false => drop(queue.push_many([msg(1, "k"), msg(2, "k")]).await.unwrap()),
    }
    let starts = Starts::default();
    let worker = Worker::new(server.client(), queue, sleeping(starts.clone(), ms(1)))
        .concurrency(1)
        .unwrap()
        .prefetch(0)
        .lease(secs(5))
        .unwrap();
    let metrics = worker.metrics();
    let run = spawn(worker);
    let started = starts.first(next, secs(20)).await;
    starts.until_started(&[1, 2], secs(20)).await;
    stop_all(vec![run]).await;
    let end = pause_end.lock().unwrap().expect("the server was paused");
    let after = started.at.saturating_duration_since(end);
    let s = metrics.snapshot();
    assert!(
        after < secs(1),
        "message {next} started {after:?} after the pause's end; {s:?}"
    );
    starts.assert_each_once_without_stalls([1, 2]);
    assert_eq!((s.lost_leases, s.unconfirmed), (0, 0), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_is_lost_does_not_strand_its_message_for_a_lease() {
    lost_reply(claims_k, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_messages_without_a_key_whose_reply_is_lost_strands_nothing() {
    lost_reply_of(claims_plain, 1, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuing_ack_whose_reply_is_lost_does_not_strand_the_next_message() {
    lost_reply(acks_k, 2).await;
}

// ---------------------------------------------------------------------------
// 6. HeldLock::lost for keyed messages
// ---------------------------------------------------------------------------

/// Reports `"dropped"` when the handler's future is dropped.
struct DropReport(tokio::sync::mpsc::UnboundedSender<(&'static str, Instant)>);

impl Drop for DropReport {
    fn drop(&mut self) {
        let _ = self.0.send(("dropped", Instant::now()));
    }
}

/// A keyed message under a `LockLayer` with `OnLost::Cancel` whose lock
/// another client takes mid-run: `HeldLock::lost` fires (or the handler is
/// cancelled) within about a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_lock_lost_fires_for_a_keyed_message_whose_lock_is_taken() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    push_keyed(&queue, &[(1, "k")]).await;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let started = Arc::new(Notify::new());
    let layer = LockLayer::new(Locker::new(conn.clone()), |job: &Job<Msg>| job.key.clone())
        .on_lost(OnLost::Cancel);
    let notify = started.clone();
    let service = ServiceBuilder::new()
        .layer(layer)
        .service_fn(move |_: Job<Msg>| {
            let (tx, started) = (tx.clone(), notify.clone());
            async move {
                let held = HeldLock::current().expect("the key's lock");
                let _report = DropReport(tx.clone());
                started.notify_one();
                let what = tokio::select! {
                    () = held.lost() => "lost",
                    () = sleep(secs(4)) => "finished",
                };
                let _ = tx.send((what, Instant::now()));
                Ok::<_, BoxError>(())
            }
        });
    let worker = Worker::new(server.client(), queue, service);
    let run = spawn(worker.lease(ms(300)).unwrap());
    timeout(secs(10), started.notified())
        .await
        .expect("the handler started");
    let _: () = raw(&conn, &["SET", &lock_of("k"), "other", "PX", "20000"]).await;
    let taken = Instant::now();
    let (what, at) = timeout(secs(10), events.recv()).await.unwrap().unwrap();
    stop_all(vec![run]).await;
    let after = at - taken;
    assert!(
        what != "finished" && after < ms(1500),
        "{what} {after:?} after the lock was taken"
    );
}

// ---------------------------------------------------------------------------
// 7. A forwarded `into_payload` through a deferring LockLayer
// ---------------------------------------------------------------------------

/// As `a_handlers_forwarded_twin_is_a_new_message` (tests/integration/worker_claims.rs),
/// with the job's own payload (`into_payload`) forwarded: the forwarded
/// message is pushed under an id of its own and the running job is
/// acknowledged, not deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_forwarded_payload_is_a_new_message() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "twin").unwrap();
    let locker = support::locker(conn.clone(), secs(60));
    let _held = acquired(&locker, "busy").await;
    async fn sub_handler(_: Msg) -> Result<(), BoxError> {
        Ok(())
    }
    let forward = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |m: &Msg| m.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), secs(60))),
        )
        .service_fn(sub_handler);
    let service = service_fn(move |job: Job<Msg>| {
        let forward = forward.clone();
        async move {
            let payload = job.into_payload();
            let outcome = tower::ServiceExt::oneshot(forward, payload)
                .await
                .expect("the forward call");
            assert!(outcome.is_deferred());
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let run = spawn(worker);
    let outer = queue.push(msg(1, "busy")).await.unwrap();
    eventually("the running job is settled", secs(10), async || {
        let s = metrics.snapshot();
        done_if(s.done + s.lost_leases + s.deferred >= 1, s)
    })
    .await;
    stop_all(vec![run]).await;
    let s = metrics.snapshot();
    assert_eq!((s.done, s.deferred, s.lost_leases), (1, 0, 0), "{s:?}");
    let ids: Vec<String> = raw(&conn, &["HKEYS", "lockgate:{twin}:data"]).await;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_ne!(
        ids[0], outer.id,
        "the forwarded message has an id of its own"
    );
}

// ---------------------------------------------------------------------------
// 8. A HeldLock that outlives its message and the next one's fence
// ---------------------------------------------------------------------------

/// Message 1 of key k leaves a clone of its `HeldLock` to a task that asks
/// for a fence once message 2 (handed the lock by 1's acknowledgement)
/// runs: that late request is refused, or its fence differs from 2's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_lock_outliving_its_message_does_not_share_the_next_one_s_fence() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    push_keyed(&queue, &[(1, "k"), (2, "k")]).await;
    let (second_runs, late_asked) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let late: Arc<Mutex<Option<Result<u64, String>>>> = Arc::default();
    let second: Arc<Mutex<Option<u64>>> = Arc::default();
    let shared = (second_runs, late_asked, late.clone(), second.clone());
    let layer = LockLayer::new(Locker::new(conn.clone()), |job: &Job<Msg>| job.key.clone());
    let service = ServiceBuilder::new()
        .layer(layer)
        .service_fn(move |job: Job<Msg>| {
            let (second_runs, late_asked, late, second) = shared.clone();
            async move {
                let held = HeldLock::current().expect("the key's lock");
                if job.n == 1 {
                    tokio::spawn(async move {
                        second_runs.notified().await;
                        let fence = held.fence().await.map_err(|e| e.to_string());
                        *late.lock().unwrap() = Some(fence);
                        late_asked.notify_one();
                    });
                    return Ok::<_, BoxError>(());
                }
                second_runs.notify_one();
                timeout(secs(5), late_asked.notified()).await?;
                *second.lock().unwrap() = Some(held.fence().await?);
                Ok(())
            }
        });
    let worker = Worker::new(server.client(), queue, service);
    let run = spawn(worker.concurrency(1).unwrap());
    eventually("message 2 has its fence", secs(10), async || {
        done_if(second.lock().unwrap().is_some(), "")
    })
    .await;
    stop_all(vec![run]).await;
    let (late, second) = (
        late.lock().unwrap().clone(),
        second.lock().unwrap().unwrap(),
    );
    if let Some(Ok(fence)) = late {
        assert_ne!(fence, second, "message 1's late task got message 2's fence");
    }
}

// ---------------------------------------------------------------------------
// 9. Shutdown: continued jobs during drain
// ---------------------------------------------------------------------------

/// Key k's messages run back to back (each claimed by the previous one's
/// acknowledgement, whose reply is slowed by 150 ms: half the lease; a
/// reply slower than the lease would let the next message's lease run out
/// before the worker learns of it, whatever the worker does) while a slow message
/// keeps the shutdown draining for 2.5 s; the shutdown comes while message
/// 1's acknowledgement is on its way. The message it continued with is
/// neither lost to its 300 ms lease nor run twice: a worker started after
/// the first one returned runs the rest at once, none after a stall.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_continued_during_shutdown_do_not_lapse() {
    let server = server();
    let lock = lock_of("k");
    let rule = move |args: &[Vec<u8>]| match is_script(args, 19)
        && names(args, "ack")
        && names(args, &lock)
    {
        true => Fault::SlowReply(ms(150)),
        false => Fault::Pass,
    };
    let queue: Queue<Msg, Faulty> =
        Queue::new(Faulty::new(manager(&server).await, rule), QUEUE).unwrap();
    warm_up(&queue).await;
    push_keyed(
        &queue,
        &[(0, "slow"), (1, "k"), (2, "k"), (3, "k"), (4, "k")],
    )
    .await;
    let starts = Starts::default();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let stop_tx = Arc::new(Mutex::new(Some(stop_tx)));
    let recorded = starts.clone();
    let service = service_fn(move |job: Job<Msg>| {
        let (starts, stop_tx) = (recorded.clone(), stop_tx.clone());
        async move {
            starts.record(&job);
            sleep(if job.n == 0 { ms(2500) } else { ms(400) }).await;
            let stop = (job.n == 1)
                .then(|| stop_tx.lock().unwrap().take())
                .flatten();
            if let Some(stop) = stop {
                tokio::spawn(async move {
                    sleep(ms(100)).await;
                    let _ = stop.send(());
                });
            }
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue, service)
        .concurrency(2)
        .unwrap()
        .lease(ms(300))
        .unwrap()
        .shutdown_timeout(secs(20));
    let first = tokio::spawn(worker.run_until(shutdown));
    timeout(secs(30), first)
        .await
        .expect("the first worker stopped")
        .unwrap()
        .unwrap();
    let restarted = Instant::now();
    let clean: Queue<Msg> = Queue::new(manager(&server).await, QUEUE).unwrap();
    let second = Worker::new(server.client(), clean, sleeping(starts.clone(), ms(400)));
    let run = spawn(second.lease(ms(300)).unwrap());
    starts.until_started(&[0, 1, 2, 3, 4], secs(20)).await;
    sleep(ms(500)).await;
    stop_all(vec![run]).await;
    let resumed = starts
        .all()
        .into_iter()
        .find(|s| s.at >= restarted)
        .expect("a start");
    starts.assert_each_once_without_stalls(0..=4);
    assert!(
        resumed.at - restarted < secs(1),
        "resumed {:?} after the restart",
        resumed.at - restarted
    );
}

// ---------------------------------------------------------------------------
// 10. Errors after a script ran, counted as failures
// ---------------------------------------------------------------------------

/// Message 1 of key k fails its first attempt; the index update after its
/// retry was written fails once. No lease counts as lost (the retry was
/// written), and the key goes on well before the index's 30 s recheck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_index_update_after_a_keyed_retry_is_no_lost_lease_and_stalls_nothing() {
    let server = server();
    let (armed, fired) = (Arc::new(AtomicBool::new(false)), Arc::new(Notify::new()));
    let rule = fail_once(&armed, &fired, marks_ready);
    let queue: Queue<Msg, Faulty> =
        Queue::new(Faulty::new(manager(&server).await, rule), QUEUE).unwrap();
    push_keyed(&queue, &[(1, "k"), (2, "k")]).await;
    let starts = Starts::default();
    let recorded = starts.clone();
    let service = service_fn(move |job: Job<Msg>| {
        let (starts, armed) = (recorded.clone(), armed.clone());
        async move {
            starts.record(&job);
            if job.n == 1 && job.attempt() == 1 {
                armed.store(true, Ordering::SeqCst);
                return Err::<(), BoxError>("the first attempt fails".into());
            }
            Ok(())
        }
    });
    let worker = Worker::new(server.client(), queue, service)
        .retry_backoff(backoff(10, 10))
        .lease(secs(5))
        .unwrap();
    let metrics = worker.metrics();
    let run = spawn(worker);
    timeout(secs(10), fired.notified())
        .await
        .expect("the index update failed");
    let failed = Instant::now();
    let went_on = starts.started_within(&[2], secs(5)).await;
    stop_all(vec![run]).await;
    let s = metrics.snapshot();
    let counted = (s.lost_leases, s.unconfirmed);
    assert!(
        counted == (0, 0) && went_on,
        "lost leases and unconfirmed {counted:?} (want none); key k went on within 5 s: {went_on} (starts {:?}, {:?} after the failure)",
        starts.order(),
        failed.elapsed()
    );
}

// ---------------------------------------------------------------------------
// The first recovery of 5 minutes visits every keyed partition
// ---------------------------------------------------------------------------

/// The first recovery of every 5 minutes visits every keyed partition, the
/// safety net for a lease missing from the leases index. Its turn was
/// taken before the sweep ran: a sweep that failed left the next full one
/// 5 minutes away. A failed full sweep now gives its turn back.
#[tokio::test]
async fn a_full_recovery_sweep_that_fails_is_the_next_recoverys_to_make() {
    let server = server();
    let conn = manager(&server).await;
    // Armed by the first SET that takes the full sweep's turn, the next
    // script call (the sweep's first) fails, once.
    let armed = Arc::new(AtomicBool::new(false));
    let rule = {
        let (armed, once) = (armed.clone(), AtomicBool::new(true));
        move |args: &[Vec<u8>]| {
            let takes_turn = args.first().is_some_and(|a| a == b"SET")
                && args
                    .get(1)
                    .is_some_and(|key| key.ends_with(b":recovering:full"));
            if takes_turn && once.swap(false, Ordering::SeqCst) {
                armed.store(true, Ordering::SeqCst);
            } else if args.first().is_some_and(|a| a == b"EVALSHA")
                && armed.swap(false, Ordering::SeqCst)
            {
                return Fault::Fail;
            }
            Fault::Pass
        }
    };
    let queue: Queue<Msg, Faulty> = Queue::new(Faulty::new(conn.clone(), rule), QUEUE).unwrap();
    push_keyed(&queue, &[(1, "a")]).await;
    // Claimed by a worker that dies; its lease is missing from the index.
    assert_eq!(queue.claim(1, ms(100)).await.unwrap().jobs.len(), 1);
    let index: Vec<String> = raw(&conn, &["KEYS", "*:keyed:leases"]).await;
    assert_eq!(index.len(), 1, "{index:?}");
    let _: i64 = raw(&conn, &["DEL", &index[0]]).await;
    sleep(ms(200)).await;
    assert!(queue.recover(3).await.is_err(), "the full sweep failed");
    let recovered = queue.recover(3).await.unwrap();
    assert_eq!(
        recovered.requeued, 1,
        "the next recovery sweeps every partition"
    );
}

/// A read ahead that acknowledged a run's earlier message and found
/// nothing more in line, its reply lost and the call resent: the resend
/// finds the message gone, and answered that it acknowledged nothing, so
/// the message's `done` event was never recorded. The call now keeps what
/// it acknowledged in its record, which answers the resend.
#[tokio::test]
async fn a_read_ahead_resent_after_a_lost_reply_records_what_it_acknowledged() {
    let server = server();
    let rule = |args: &[Vec<u8>]| match is_script(args, 19) && names(args, "ahead") {
        true => Fault::Twice,
        false => Fault::Pass,
    };
    let queue: Queue<Msg, Faulty> = Queue::new(Faulty::new(manager(&server).await, rule), QUEUE)
        .unwrap()
        .record_events(100)
        .unwrap();
    push_keyed(&queue, &[(1, "k"), (2, "k")]).await;
    let run = queue.claim_runs(1, secs(10), 2).await.unwrap().jobs;
    assert_eq!(run.len(), 2);
    let (held, ahead) = queue
        .extend_run(&run[1], &run[..1], secs(10), 8)
        .await
        .unwrap();
    assert!(held && ahead.is_empty());
    let events = queue.events_after("0", 100).await.unwrap();
    let done: Vec<&str> = (events.iter())
        .filter(|e| e.kind == lockgate::queue::EventKind::Done)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(done, [run[0].id()], "{events:?}");
}

// ---------------------------------------------------------------------------
// A release marks no partition that holds nothing
// ---------------------------------------------------------------------------

/// The hash slot of `key`'s lock (CRC16-XMODEM, as Redis Cluster).
fn slot_of(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(key.as_bytes()) % 16_384
}

/// A key waiting for a lock other code holds is woken by the release in the
/// queue's partition, and in its lock slot's (where 0.1 kept a key's line)
/// only if it waits there too: a release never puts a partition that holds
/// nothing in the index, where each claim would visit it for nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_marks_no_partition_that_holds_nothing() {
    let server = server();
    let conn = manager(&server).await;
    let lock_slot = slot_of("k").to_string();
    let marked = Arc::new(AtomicBool::new(false));
    let seen = marked.clone();
    let rule = move |args: &[Vec<u8>]| {
        if marks_ready(args) && names(args, &lock_slot) {
            seen.store(true, Ordering::SeqCst);
        }
        Fault::Pass
    };
    let queue: Queue<Msg, Faulty> = Queue::new(Faulty::new(conn.clone(), rule), QUEUE).unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(60)).unwrap();
    let lease = acquired(&locker, "k").await;
    push_keyed(&queue, &[(1, "k")]).await;
    let starts = Starts::default();
    let worker = Worker::new(server.client(), queue, sleeping(starts.clone(), ms(1)));
    let running = spawn(worker);
    // The claim finds the lock held and waits for its release.
    sleep(ms(300)).await;
    assert!(starts.all().is_empty(), "ran while the lock was held");
    assert!(locker.release(&lease).await.unwrap());
    starts.until_started(&[1], secs(5)).await;
    stop_all(vec![running]).await;
    assert!(
        !marked.load(Ordering::SeqCst),
        "the release marked the empty partition of slot {}",
        slot_of("k")
    );
}
