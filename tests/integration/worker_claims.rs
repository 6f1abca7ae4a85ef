//! Worker behaviour around claims: in-place deferral by claim, lease renewal
//! racing a deferral, lost settle replies, the backlog hand-off, and shutdown
//! while settling. Against real redis-server processes.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use lockgate::queue::Wake;
use lockgate::{BoxError, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use support::{acquired, done_if, eventually, manager, ms, raw, secs, server, stats, stop};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    a: u32,
    b: String,
}

/// A multiplexed connection whose requests give up after `timeout` while
/// the connection stays (a connection manager would reconnect, and the
/// server would drop the paused command): the server still runs the command
/// later, and its reply is lost.
async fn impatient_connection(
    server: &lockgate::testing::RedisServer,
    timeout: std::time::Duration,
) -> MultiplexedConnection {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(timeout));
    server
        .client()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("connection to the test server")
}

/// Item 11: a job under a `LockLayer` that defers into the same queue (and
/// mapped to its payload below it) is rescheduled in place by its claim,
/// whatever the bytes a producer wrote: same id, its deferral count grows
/// (so `max_deferrals` fires), and the stored payload keeps its bytes and
/// unknown fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferral_by_claim_keeps_id_count_and_foreign_bytes() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "py").unwrap();
    // As redis-py's json.dumps writes them (", " and ": "), and with a field
    // `Msg` does not know, pushed raw as another producer would.
    let payloads = [
        ("py-1", r#"{"a": 1, "b": "x"}"#),
        ("py-2", r#"{"b":"x","a":2,"extra":{"k":[1, 2]}}"#),
    ];
    for (id, payload) in payloads {
        let record = format!("0:0:0:{payload}");
        let _: i64 = raw(&conn, &["HSETNX", "lockgate:{py}:data", id, &record]).await;
        let _: i64 = raw(&conn, &["ZADD", "lockgate:{py}:schedule", "0", id]).await;
    }
    // The key is held elsewhere for the whole test.
    let locker = Locker::new(conn.clone()).ttl(secs(60)).unwrap();
    let _held = acquired(&locker, "x").await;

    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.b.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(5)).max_deferrals(3)),
        )
        .map_request(|job: Job<Msg>| job.into_payload())
        .service_fn(|_: Msg| async { Ok::<_, BoxError>(()) });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .max_attempts(1)
        .unwrap();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));

    eventually("both messages are dead letters", secs(10), async || {
        let n = stats(&queue).await.dead;
        done_if(n == 2, format_args!("{n} dead"))
    })
    .await;
    stop(stop_tx, run).await;

    let ids: Vec<String> = raw(&conn, &["HKEYS", "lockgate:{py}:data"]).await;
    assert_eq!(ids.len(), 2, "no copies under new ids: {ids:?}");
    let mut dead = queue.dead_letters(None, 100).await.unwrap().letters;
    dead.sort_by(|x, y| x.id.cmp(&y.id));
    for (letter, (id, payload)) in dead.iter().zip(payloads) {
        assert_eq!(letter.id, id, "the producer's id is kept");
        assert_eq!(letter.deferrals, 3, "deferrals counted on the same message");
        assert_eq!(
            String::from_utf8_lossy(&letter.payload),
            payload,
            "stored bytes unchanged"
        );
    }
}

/// Item 10: the worker's lease renewal racing an in-place deferral of the
/// same job is no lost lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_racing_a_deferral_is_no_lost_lease() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "race").unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(60)).unwrap();
    let _held = acquired(&locker, "busy").await;
    let msgs: Vec<Msg> = (0..20)
        .map(|a| Msg {
            a,
            b: "busy".into(),
        })
        .collect();
    queue.push_many(&msgs).await.unwrap();

    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.b.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(1))),
        )
        .service_fn(|_: Job<Msg>| async { Ok::<_, BoxError>(()) });
    // Lease 30 ms: renewed every 10 ms, so renewals often meet a deferral.
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(8)
        .unwrap()
        .lease(ms(30))
        .unwrap();
    let metrics = worker.metrics();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    eventually("many deferrals", secs(20), async || {
        let n = metrics.snapshot().deferred;
        done_if(n >= 2000, format_args!("{n} deferred"))
    })
    .await;
    stop(stop_tx, run).await;
    let snapshot = metrics.snapshot();
    assert_eq!(snapshot.lost_leases, 0, "{snapshot:?}");
}

/// Item 8: an ack that ran on the server but whose reply was lost is no lost
/// lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_whose_reply_was_lost_is_no_lost_lease() {
    let server = server();
    let admin = manager(&server).await;
    let conn = impatient_connection(&server, ms(200)).await;
    let queue: Queue<Msg, _> = Queue::new(conn, "lost-ack").unwrap();
    for a in 0..2 {
        queue.push(Msg { a, b: "k".into() }).await.unwrap();
    }
    let handler_admin = admin.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let service = tower::service_fn(move |_: Job<Msg>| {
        let admin = handler_admin.clone();
        // The first message loads the ack script (an unknown script would
        // fail with NOSCRIPT after the pause, not run).
        let second = handler_calls.fetch_add(1, Ordering::SeqCst) == 1;
        async move {
            if second {
                tokio::time::sleep(ms(100)).await;
                // The ack hangs server-side, times out client-side, and runs
                // when the pause ends; its resend then finds nothing to ack.
                let _: () = raw(&admin, &["CLIENT", "PAUSE", "700", "WRITE"]).await;
            }
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(1)
        .unwrap()
        .prefetch(0)
        .lease(secs(20))
        .unwrap();
    let metrics = worker.metrics();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    eventually("both messages are settled", secs(10), async || {
        let s = metrics.snapshot();
        done_if(s.done + s.lost_leases + s.unconfirmed >= 2, s)
    })
    .await;
    stop(stop_tx, run).await;
    let s = metrics.snapshot();
    assert!(s.redis_errors > 0, "the reply was lost: {s:?}");
    assert_eq!(s.lost_leases, 0, "{s:?}");
    assert_eq!(s.done, 2, "{s:?}");
    let left: i64 = raw(&admin, &["HLEN", "lockgate:{lost-ack}:data"]).await;
    assert_eq!(left, 0);
}

/// Item 8: a retry whose reply was lost and whose resend is refused is
/// counted as unconfirmed, not as a lost lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_whose_reply_was_lost_is_unconfirmed_not_lost() {
    let server = server();
    let admin = manager(&server).await;
    let conn = impatient_connection(&server, ms(200)).await;
    let queue: Queue<Msg, _> = Queue::new(conn, "lost-retry").unwrap();
    queue
        .push(Msg {
            a: 1,
            b: "k".into(),
        })
        .await
        .unwrap();
    let handler_admin = admin.clone();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler_calls = calls.clone();
    let service = tower::service_fn(move |_: Job<Msg>| {
        let admin = handler_admin.clone();
        // The first call fails plainly (loading the retry script: an
        // unknown script would fail with NOSCRIPT after the pause, not run);
        // the second's retry hangs server-side, times out client-side and
        // runs when the pause ends; its resend is refused.
        let call = handler_calls.fetch_add(1, Ordering::SeqCst);
        async move {
            match call {
                0 => Err::<(), BoxError>("boom".into()),
                1 => {
                    let _: () = raw(&admin, &["CLIENT", "PAUSE", "700", "WRITE"]).await;
                    Err("boom".into())
                }
                _ => Ok(()),
            }
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .lease(secs(20))
        .unwrap()
        .retry_backoff(support::backoff(10, 10));
    let metrics = worker.metrics();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    eventually("the message is settled", secs(10), async || {
        let s = metrics.snapshot();
        done_if(s.done == 1, s)
    })
    .await;
    stop(stop_tx, run).await;
    let s = metrics.snapshot();
    assert!(s.redis_errors > 0, "the reply was lost: {s:?}");
    assert_eq!(s.lost_leases, 0, "{s:?}");
    assert_eq!(s.unconfirmed, 1, "{s:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// Item 13: a burst due at one instant reaches every idle worker at once,
/// not after the 2 s safety timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_reaches_every_idle_worker_without_the_safety_timer() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "burst").unwrap();
    let mut runs = Vec::new();
    let mut handled = Vec::new();
    for _ in 0..4 {
        let queue: Queue<Msg> = Queue::new(manager(&server).await, "burst").unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        handled.push(count.clone());
        let service = tower::service_fn(move |_: Job<Msg>| {
            let count = count.clone();
            async move {
                tokio::time::sleep(ms(20)).await;
                count.fetch_add(1, Ordering::SeqCst);
                Ok::<_, BoxError>(())
            }
        });
        let worker = Worker::new(server.client(), queue, service)
            .concurrency(1)
            .unwrap()
            .prefetch(0);
        let (stop_tx, shutdown) = support::shutdown_signal();
        let run = tokio::spawn(worker.run_until(shutdown));
        runs.push((stop_tx, run));
    }
    // Every worker is idle, blocked on the doorbell. The first push rings
    // one of them, which learns the due time and blocks again; the others
    // renew their blocks when the 2 s safety timer ends theirs, so the one
    // that knows the due time is then the longest blocked: the one a ring
    // reaches first.
    tokio::time::sleep(ms(600)).await;
    let total = 40;
    let due = SystemTime::now() + ms(1700);
    let due_instant = Instant::now() + ms(1700);
    for a in 0..total {
        queue.push_at(Msg { a, b: "k".into() }, due).await.unwrap();
    }
    eventually("the burst is handled", secs(10), async || {
        let n: usize = handled.iter().map(|c| c.load(Ordering::SeqCst)).sum();
        done_if(n >= total as usize, format_args!("{n} handled"))
    })
    .await;
    let took = due_instant.elapsed();
    let per_worker: Vec<usize> = handled.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    for (stop_tx, run) in runs {
        stop(stop_tx, run).await;
    }
    assert!(
        per_worker.iter().all(|n| *n >= 1),
        "every idle worker takes part: {per_worker:?} (burst took {took:?})"
    );
    assert!(took < secs(1) + ms(500), "burst took {took:?}");
}

/// Item 13, at the waiter: a waiter that returns on its deadline has ended
/// its own `BLPOP` before the caller's next command goes out, so a ring that
/// command passes on (a claim leaving due messages, here a push) reaches
/// another idle waiter, not the returning one's own connection.
/// `current_thread`: a background task runs only when the test task yields,
/// which makes the old order (ring first, poke later) deterministic.
#[tokio::test(flavor = "current_thread")]
async fn a_waiter_woken_by_its_deadline_passes_a_ring_on() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "handoff").unwrap();
    // Loads the push script, so that the push below is one command.
    let warm_up: Queue<Msg> = Queue::new(conn, "warm-up").unwrap();
    warm_up
        .push(Msg {
            a: 0,
            b: "k".into(),
        })
        .await
        .unwrap();
    let mut first = queue.waiter(server.client());
    let mut second = queue.waiter(server.client());
    // `first` blocks before `second`: it is the longest blocked, the one
    // Redis hands a ring to while its BLPOP is still in flight.
    let first_queue = queue.clone();
    let first = tokio::spawn(async move {
        let woke = first.wait(Some(Instant::now() + ms(300))).await.unwrap();
        // At once, over the queue's shared connection: rings the bell.
        first_queue
            .push(Msg {
                a: 1,
                b: "k".into(),
            })
            .await
            .unwrap();
        (woke, first)
    });
    tokio::time::sleep(ms(100)).await;
    let started = Instant::now();
    let woke = second.wait(Some(started + secs(2))).await.unwrap();
    let waited = started.elapsed();
    let (first_woke, _first) = first.await.unwrap();
    assert_eq!(first_woke, Wake::Deadline);
    assert_eq!(
        woke,
        Wake::Rung,
        "the ring reached the other waiter (after {waited:?})"
    );
}

/// Item 14: a handler that finished while shutdown waits gets its
/// settlement written, even when writing it outlasts the shutdown timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_a_settlement_in_progress_finish() {
    let server = server();
    let admin = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(manager(&server).await, "bye").unwrap();
    queue
        .push(Msg {
            a: 1,
            b: "k".into(),
        })
        .await
        .unwrap();
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let done_tx = Arc::new(std::sync::Mutex::new(Some(done_tx)));
    let handler_admin = admin.clone();
    let service = tower::service_fn(move |_: Job<Msg>| {
        let admin = handler_admin.clone();
        let done_tx = done_tx.clone();
        async move {
            // Scripts are refused (not run) until the test allows them
            // again: the settlement is being retried, not yet written, when
            // shutdown times out.
            let _: () = raw(&admin, &["ACL", "SETUSER", "default", "-eval", "-evalsha"]).await;
            if let Some(tx) = done_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            Err::<(), BoxError>("boom".into())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(1)
        .unwrap()
        .lease(secs(10))
        .unwrap()
        .shutdown_timeout(ms(100));
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    done_rx.await.unwrap();
    let _ = stop_tx.send(());
    tokio::time::sleep(ms(400)).await;
    let _: () = raw(&admin, &["ACL", "SETUSER", "default", "+@all"]).await;
    tokio::time::timeout(secs(20), run)
        .await
        .expect("run_until returns")
        .unwrap()
        .unwrap();
    let st = stats(&queue).await;
    assert_eq!(st.active, 0, "not left in the active set: {st:?}");
    assert_eq!(st.due + st.later, 1, "retried: {st:?}");
}

/// Item 11: a handler (with no lock layer of its own) that forwards a new
/// message, byte for byte equal to the job it runs, through a `LockLayer`
/// deferring into the same queue: the forwarded message is pushed under an
/// id of its own, and the running job is acknowledged. (Matching by bytes
/// took the forwarded request for the running job.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handlers_forwarded_twin_is_a_new_message() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "twin").unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(60)).unwrap();
    let _held = acquired(&locker, "busy").await;
    async fn sub_handler(_: Msg) -> Result<(), BoxError> {
        Ok(())
    }
    let forward = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |m: &Msg| m.b.clone())
                .on_conflict(OnConflict::defer(queue.clone(), secs(60))),
        )
        .service_fn(sub_handler);
    let service = tower::service_fn(move |job: Job<Msg>| {
        let forward = forward.clone();
        async move {
            let twin = job.payload().clone();
            let outcome = tower::ServiceExt::oneshot(forward, twin)
                .await
                .expect("the forward call");
            assert!(outcome.is_deferred());
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    let outer = queue
        .push(Msg {
            a: 1,
            b: "busy".into(),
        })
        .await
        .unwrap();
    eventually("the running job is acknowledged", secs(10), async || {
        let s = metrics.snapshot();
        done_if(s.done + s.lost_leases + s.deferred >= 1, s)
    })
    .await;
    stop(stop_tx, run).await;
    let s = metrics.snapshot();
    assert_eq!((s.done, s.deferred), (1, 0), "{s:?}");
    let ids: Vec<String> = raw(&conn, &["HKEYS", "lockgate:{twin}:data"]).await;
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_ne!(
        ids[0], outer.id,
        "the forwarded message has an id of its own"
    );
}

/// Shutdown ends even when the server stops answering while messages are
/// handed back (a frozen server, a partition; a connection without response
/// timeout hangs rather than fails): the messages not handed back come back
/// after their lease.
#[tokio::test]
async fn shutdown_ends_when_the_hand_back_hangs() {
    let server = server();
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
    let conn = server
        .client()
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    let queue: Queue<u32, MultiplexedConnection> = Queue::new(conn, "hang").unwrap();
    queue.push(1).await.unwrap();
    let started = Arc::new(tokio::sync::Notify::new());
    let service = tower::service_fn({
        let started = started.clone();
        move |_job: Job<u32>| {
            let started = started.clone();
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, BoxError>(())
            }
        }
    });
    let worker = Worker::new(server.client(), queue, service)
        .lease(secs(1))
        .unwrap()
        .shutdown_timeout(ms(100));
    let (tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    started.notified().await;
    server.pause().unwrap(); // SIGSTOP: every command now hangs
    let _ = tx.send(());
    let ended = tokio::time::timeout(secs(15), run).await;
    server.resume().unwrap();
    assert!(ended.is_ok(), "run_until did not end while the server hung");
}
