//! Deferred into the key's line (`DeferDelay::until_released`): messages
//! whose key a `LockLayer` found busy wait in the key's line in the queue
//! and are claimed one at a time with the key's lock (the one every
//! `Locker` takes) when it is released, in the order they joined; a
//! message pushed with the key waits behind them; a holder killed with
//! SIGKILL strands nothing.
//!
//! The SIGKILL test runs this test binary again as a child process (the
//! ignored test `holder_child`, driven by an environment variable).

use crate::support;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::layer::DeferDelay;
use lockgate::{BoxError, Job, LockLayer, Locker, OnConflict, Outcome, Queue, Worker};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use support::{BOUNDED, done_if, eventually, manager, ms, raw, secs, server, shutdown_signal};
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt, service_fn};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

const QUEUE: &str = "orders";

/// What the worker's handler saw: message number, deferrals, start, end.
type Log = Arc<Mutex<Vec<(u32, u32, Instant, Instant)>>>;

/// A worker on `queue` whose messages join their key's line while it is
/// busy.
fn line_worker(
    server: &lockgate::testing::RedisServer,
    conn: ConnectionManager,
    queue: &Queue<Msg>,
    ttl: Duration,
    permits: Option<u32>,
    log: Log,
) -> impl std::future::Future<Output = lockgate::Result<()>> + Send + 'static + use<> {
    let locker = Locker::new(conn).ttl(ttl).unwrap();
    let mut layer = LockLayer::new(locker, job_key);
    if let Some(n) = permits {
        layer = layer.permits(n).unwrap();
    }
    let service = ServiceBuilder::new()
        .layer(layer.on_conflict(OnConflict::defer(
            queue.clone(),
            DeferDelay::until_released(),
        )))
        .service_fn(move |job: Job<Msg>| handle(log.clone(), job));
    let (tx, shutdown) = shutdown_signal();
    // Kept alive by the future: the worker stops when the test ends.
    std::mem::forget(tx);
    Worker::new(server.client(), queue.clone(), service)
        .concurrency(4)
        .unwrap()
        .run_until(shutdown)
}

async fn handle(log: Log, job: Job<Msg>) -> Result<(), BoxError> {
    let start = Instant::now();
    tokio::time::sleep(ms(10)).await;
    log.lock()
        .unwrap()
        .push((job.n, job.deferrals(), start, Instant::now()));
    Ok(())
}

fn key_of(m: &Msg) -> String {
    m.key.clone()
}

fn job_key(job: &Job<Msg>) -> String {
    job.key.clone()
}

async fn wait_for(release: Option<tokio::sync::oneshot::Receiver<()>>) -> Result<(), BoxError> {
    if let Some(release) = release {
        let _ = release.await;
    }
    Ok(())
}

/// How many messages wait in `key`'s line in `queue`.
async fn in_line(queue: &Queue<Msg>, key: &str) -> i64 {
    let stats = queue.key_stats(100).await.unwrap();
    let load = stats.backlogs.iter().find(|l| l.key == key);
    load.map_or(0, |l| l.waiting as i64)
}

/// The lock of `key`: the one every `Locker` takes.
fn lock_of(key: &str) -> String {
    format!("lockgate:lock:{{{key}}}")
}

/// A holder of `key`'s lock, through the same layer configuration
/// as the worker's (a request that is not a queued message): it holds the
/// key until `release` fires.
async fn hold_until(
    conn: ConnectionManager,
    queue: Queue<Msg>,
    key: &str,
    ttl: Duration,
    release: tokio::sync::oneshot::Receiver<()>,
) -> Result<Outcome<()>, BoxError> {
    hold_permit_until(conn, queue, key, ttl, None, release).await
}

/// The same for one of the key's `permits` (`None`: its lock).
async fn hold_permit_until(
    conn: ConnectionManager,
    queue: Queue<Msg>,
    key: &str,
    ttl: Duration,
    permits: Option<u32>,
    release: tokio::sync::oneshot::Receiver<()>,
) -> Result<Outcome<()>, BoxError> {
    let release = Arc::new(Mutex::new(Some(release)));
    let mut layer = LockLayer::new(Locker::new(conn).ttl(ttl).unwrap(), key_of);
    if let Some(n) = permits {
        layer = layer.permits(n)?;
    }
    let svc = layer.on_conflict(OnConflict::defer(queue, DeferDelay::until_released()));
    let svc = tower::Layer::layer(
        &svc,
        service_fn(move |_m: Msg| wait_for(release.lock().unwrap().take())),
    );
    svc.oneshot(msg(0, key)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_messages_wait_in_the_key_s_line_and_newcomers_with_the_key_behind_them() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    let lock_key = lock_of("A");

    // Someone holds A.
    let (release, released) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn(hold_until(
        conn.clone(),
        queue.clone(),
        "A",
        secs(30),
        released,
    ));
    eventually("A is held", BOUNDED, async || {
        done_if(support::exists(&conn, &lock_key).await, "")
    })
    .await;

    let log: Log = Default::default();
    let worker = tokio::spawn(line_worker(
        &server,
        manager(&server).await,
        &queue,
        secs(30),
        None,
        log.clone(),
    ));
    // Five messages join A's line, one after another, and one on a free key
    // B runs at once.
    queue.push(msg(100, "B")).await.unwrap();
    for n in 1..=5 {
        queue.push(msg(n, "A")).await.unwrap();
        eventually("the message joins A's line", BOUNDED, async || {
            let len = in_line(&queue, "A").await;
            done_if(len == i64::from(n), len)
        })
        .await;
    }
    eventually("B ran", BOUNDED, async || {
        done_if(log.lock().unwrap().len() == 1, "")
    })
    .await;
    assert!(log.lock().unwrap().iter().all(|(n, ..)| *n == 100));

    // Released: the line runs; a newcomer pushed with its key right after
    // waits behind it.
    release.send(()).unwrap();
    let with_key = lockgate::PushOptions::new().key("A");
    queue.push_with(msg(6, "A"), with_key).await.unwrap();
    assert_eq!(
        holder.await.unwrap().unwrap(),
        Outcome::Done(()),
        "the holder ran"
    );
    eventually("every message ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n == 7, n)
    })
    .await;
    let runs: Vec<_> = log.lock().unwrap().iter().skip(1).cloned().collect();
    let order: Vec<u32> = runs.iter().map(|(n, ..)| *n).collect();
    assert_eq!(order, [1, 2, 3, 4, 5, 6], "not in push order");
    // One deferral per message: into the line once, claimed when its
    // turn came (the newcomer never deferred).
    for (n, deferrals, ..) in &runs {
        let expected = u32::from(*n != 6);
        assert_eq!(
            *deferrals, expected,
            "message {n} was deferred {deferrals} times"
        );
    }
    // One at a time.
    for pair in runs.windows(2) {
        assert!(
            pair[0].3 <= pair[1].2,
            "messages {} and {} overlapped",
            pair[0].0,
            pair[1].0
        );
    }
    eventually("nothing waits or holds A", BOUNDED, async || {
        let left = (
            in_line(&queue, "A").await,
            support::exists(&conn, &lock_key).await,
        );
        done_if(left == (0, false), left)
    })
    .await;
    // The last acknowledgement may still be on its way (the worker writes
    // them after the handler returns, in batches).
    support::queue_drained(&queue).await;
    worker.abort();
}

/// Messages claimed together, whose handlers race to find the key busy,
/// take their places in the line by push time: each runs once, one at a
/// time, in push order, deferred once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_claimed_together_join_the_line_once_each_in_push_order() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    let lock_key = lock_of("A");
    let (release, released) = tokio::sync::oneshot::channel();
    let holder = tokio::spawn(hold_until(
        conn.clone(),
        queue.clone(),
        "A",
        secs(30),
        released,
    ));
    eventually("A is held", BOUNDED, async || {
        done_if(support::exists(&conn, &lock_key).await, "")
    })
    .await;
    // Pushed before any worker runs, a few ms apart: the worker claims them
    // in one batch, and its four slots race to defer them.
    for n in 1..=8 {
        queue.push(msg(n, "A")).await.unwrap();
        tokio::time::sleep(ms(2)).await;
    }
    let log: Log = Default::default();
    let worker = tokio::spawn(line_worker(
        &server,
        manager(&server).await,
        &queue,
        secs(30),
        None,
        log.clone(),
    ));
    eventually("all eight wait in line", BOUNDED, async || {
        let len = in_line(&queue, "A").await;
        done_if(len == 8, len)
    })
    .await;
    release.send(()).unwrap();
    assert_eq!(holder.await.unwrap().unwrap(), Outcome::Done(()));
    eventually("every message ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n == 8, n)
    })
    .await;
    let runs = log.lock().unwrap().clone();
    let order: Vec<u32> = runs.iter().map(|(n, ..)| *n).collect();
    assert_eq!(order, [1, 2, 3, 4, 5, 6, 7, 8], "each once, in push order");
    assert_eq!(most_at_once(&runs), 1, "one at a time");
    assert!(
        runs.iter().all(|(_, deferrals, ..)| *deferrals == 1),
        "{runs:?}"
    );
    worker.abort();
}

// ---------------------------------------------------------------------------
// A holder killed with SIGKILL
// ---------------------------------------------------------------------------

/// Environment variable that turns the ignored test `holder_child` into a
/// process holding `A`'s lock until it is killed: `<redis url>`.
const CHILD: &str = "LOCKGATE_LINE_HOLDER";

#[tokio::test]
#[ignore = "run as a child process by the SIGKILL test"]
async fn holder_child() {
    let Ok(url) = std::env::var(CHILD) else {
        return;
    };
    let client = redis::Client::open(url).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    let (_never, held_for_ever) = tokio::sync::oneshot::channel();
    // The watchdog renews the lock while this process lives.
    let _ = hold_until(conn, queue, "A", ms(600), held_for_ever).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_killed_with_sigkill_strands_no_message_in_line() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    let lock_key = lock_of("A");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            support::test_named(module_path!(), "holder_child").as_str(),
            "--ignored",
            "--test-threads",
            "1",
        ])
        .env(CHILD, server.url())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawning the holder");
    eventually("the child holds A", BOUNDED, async || {
        done_if(support::exists(&conn, &lock_key).await, "")
    })
    .await;

    let log: Log = Default::default();
    let worker = tokio::spawn(line_worker(
        &server,
        manager(&server).await,
        &queue,
        secs(30),
        None,
        log.clone(),
    ));
    for n in 1..=3 {
        queue.push(msg(n, "A")).await.unwrap();
        eventually("the message joins A's line", BOUNDED, async || {
            let len = in_line(&queue, "A").await;
            done_if(len == i64::from(n), len)
        })
        .await;
    }
    // The holder renews its 600 ms lock for a while: nothing runs.
    tokio::time::sleep(ms(1500)).await;
    assert!(log.lock().unwrap().is_empty(), "ran while A was held");

    // Killed: no release, no publish; only the lock's expiry frees A.
    child.kill().unwrap();
    child.wait().unwrap();
    eventually("every message in line ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n == 3, n)
    })
    .await;
    let order: Vec<u32> = log.lock().unwrap().iter().map(|(n, ..)| *n).collect();
    assert_eq!(order, [1, 2, 3]);
    worker.abort();
}

// ---------------------------------------------------------------------------
// Keys with n permits
// ---------------------------------------------------------------------------

/// The permits set of `key`: the one every `Locker` takes from.
fn permits_set(key: &str) -> String {
    format!("lockgate:permits:{{{key}}}")
}

/// The most runs of `runs` that overlap at one moment.
fn most_at_once(runs: &[(u32, u32, Instant, Instant)]) -> usize {
    support::most_at_once(runs.iter().map(|(_, _, start, end)| (*start, *end)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_in_line_take_the_permits_as_they_free_in_line_order() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();

    // Two holders take both of A's two permits.
    let mut releases = Vec::new();
    let mut holders = Vec::new();
    for _ in 0..2 {
        let (release, released) = tokio::sync::oneshot::channel();
        releases.push(release);
        holders.push(tokio::spawn(hold_permit_until(
            conn.clone(),
            queue.clone(),
            "A",
            secs(30),
            Some(2),
            released,
        )));
        let taken = holders.len() as i64;
        eventually("a permit of A is held", BOUNDED, async || {
            let held: i64 = raw(&conn, &["ZCARD", &permits_set("A")]).await;
            done_if(held == taken, held)
        })
        .await;
    }

    // Enough that some are left to run two at a time once the second
    // permit frees, however late this test sees the first ones run (a
    // loaded machine: six were sometimes all but one gone by then).
    const MESSAGES: u32 = 12;
    let log: Log = Default::default();
    let worker = tokio::spawn(line_worker(
        &server,
        manager(&server).await,
        &queue,
        secs(30),
        Some(2),
        log.clone(),
    ));
    for n in 1..=MESSAGES {
        queue.push(msg(n, "A")).await.unwrap();
        eventually("the message joins A's line", BOUNDED, async || {
            let len = in_line(&queue, "A").await;
            done_if(len == i64::from(n), len)
        })
        .await;
    }
    tokio::time::sleep(ms(100)).await;
    assert!(
        log.lock().unwrap().is_empty(),
        "ran while both permits were held"
    );

    // One permit frees: the first in line takes it, and the others
    // follow one at a time while the second holder keeps its permit.
    releases.remove(0).send(()).unwrap();
    eventually("two messages of the line ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n >= 2, n)
    })
    .await;
    assert_eq!(
        most_at_once(&log.lock().unwrap()),
        1,
        "one permit was free, two ran at once"
    );
    // The second frees: two at a time from then on.
    releases.remove(0).send(()).unwrap();
    for holder in holders {
        assert_eq!(holder.await.unwrap().unwrap(), Outcome::Done(()));
    }
    eventually("every message ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n == MESSAGES as usize, n)
    })
    .await;
    let mut runs = log.lock().unwrap().clone();
    runs.sort_by_key(|(n, ..)| *n);
    // In push order: no message ends before one pushed ahead of it has
    // started. (Two that the same freed permits let in start in two tasks,
    // microseconds apart in either order.)
    for (i, (first, _, start, _)) in runs.iter().enumerate() {
        for (then, _, _, end) in &runs[i + 1..] {
            assert!(start < end, "{then} ended before {first} started");
        }
    }
    for (n, deferrals, ..) in &runs {
        assert_eq!(*deferrals, 1, "message {n} was deferred {deferrals} times");
    }
    assert_eq!(
        most_at_once(&runs),
        2,
        "two permits, both in use at the end"
    );
    eventually("nothing waits or holds A", BOUNDED, async || {
        let left = (
            in_line(&queue, "A").await,
            support::exists(&conn, &permits_set("A")).await,
        );
        done_if(left == (0, false), left)
    })
    .await;
    // The last acknowledgement may still be on its way (the worker writes
    // them after the handler returns, in batches).
    support::queue_drained(&queue).await;
    worker.abort();
}

/// A holder that dies keeps its permit only until its lease ends: the
/// messages in line then run, in order, and nothing is stranded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_a_dead_holder_free_the_line_when_their_leases_end() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), QUEUE).unwrap();
    // What a holder that died leaves behind: its permit, leased for 500 ms
    // more by the server's clock, that nobody will release or renew.
    let (secs_now, micros): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let lease_end = (secs_now * 1000 + micros / 1000 + 500).to_string();
    let _: i64 = raw(
        &conn,
        &["ZADD", &permits_set("A"), &lease_end, "dead-holder"],
    )
    .await;

    let log: Log = Default::default();
    let worker = tokio::spawn(line_worker(
        &server,
        manager(&server).await,
        &queue,
        secs(30),
        Some(1),
        log.clone(),
    ));
    // One after another: messages claimed together would join the line in
    // whatever order their handlers find the key busy.
    for n in 1..=3 {
        queue.push(msg(n, "A")).await.unwrap();
        eventually("the message joins A's line", BOUNDED, async || {
            let len = in_line(&queue, "A").await;
            done_if(len == i64::from(n), len)
        })
        .await;
    }
    eventually("every message in line ran", BOUNDED, async || {
        let n = log.lock().unwrap().len();
        done_if(n == 3, n)
    })
    .await;
    let runs = log.lock().unwrap().clone();
    let order: Vec<u32> = runs.iter().map(|(n, ..)| *n).collect();
    assert_eq!(order, [1, 2, 3]);
    assert_eq!(most_at_once(&runs), 1, "one permit");
    assert!(
        runs.iter().all(|(_, deferrals, ..)| *deferrals == 1),
        "each deferred once: {runs:?}"
    );
    worker.abort();
}
