//! Worker end to end, against real redis-server processes.

use crate::support;

use std::sync::{Arc, Mutex};

use lockgate::{BoxError, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use serde::{Deserialize, Serialize};
use support::{
    Holds, backoff, counts, done_if, eventually, manager, ms, secs, server, stats, stop,
};
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    n: u32,
    key: String,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_handle_every_message_once_with_per_key_exclusion() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "orders").unwrap();
    let total = 2000;
    let msgs: Vec<Msg> = (0..total)
        .map(|n| Msg {
            n,
            key: format!("k{}", n % 10),
        })
        .collect();
    queue.push_many(&msgs).await.unwrap();

    let holds = Holds::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    let mut metrics = Vec::new();
    for _ in 0..2 {
        // Each worker on its own connection, as in two processes.
        let conn = manager(&server).await;
        let queue: Queue<Msg> = Queue::new(conn.clone(), "orders").unwrap();
        let locker = Locker::new(conn).ttl(secs(5)).unwrap();
        let backoff = backoff(1, 5).max_attempts(3);
        let holds = holds.clone();
        let service = ServiceBuilder::new()
            .layer(
                LockLayer::new(locker, |job: &Job<Msg>| job.key.clone())
                    .on_conflict(OnConflict::retry(backoff).then_defer(queue.clone(), ms(5))),
            )
            .service_fn(move |job: Job<Msg>| {
                let holds = holds.clone();
                async move {
                    let start = Instant::now();
                    tokio::time::sleep(ms(1)).await;
                    holds.record(&job.key, job.n, start, Instant::now());
                    Ok::<_, BoxError>(())
                }
            });
        let worker = Worker::new(server.client(), queue, service)
            .concurrency(8)
            .unwrap()
            .lease(secs(10))
            .unwrap();
        metrics.push(worker.metrics());
        let mut stop = stop_rx.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    eventually("every message is handled", secs(60), async || {
        let n = holds.handled();
        done_if(n >= total as usize, format_args!("{n} handled"))
    })
    .await;
    stop_tx.send(true).unwrap();
    for worker in workers {
        worker.await.unwrap().unwrap();
    }

    holds.assert_each_once(total as usize);
    holds.assert_exclusive();
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
    let done: u64 = metrics.iter().map(|m| m.snapshot().done).sum();
    let deferred: u64 = metrics.iter().map(|m| m.snapshot().deferred).sum();
    assert_eq!(done, total as u64);
    println!("done {done}, deferred {deferred}");
}

#[tokio::test]
async fn delayed_messages_are_never_early() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<u32> = Queue::new(conn, "delayed").unwrap();
    let started: Arc<Mutex<Vec<(u32, std::time::SystemTime, std::time::SystemTime)>>> =
        Default::default();
    let log = started.clone();
    let service = tower::service_fn(move |job: Job<u32>| {
        let log = log.clone();
        async move {
            log.lock()
                .unwrap()
                .push((*job, job.due_at(), std::time::SystemTime::now()));
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    for n in 0..20u32 {
        queue
            .push_after(n, ms(20 + 15 * u64::from(n)))
            .await
            .unwrap();
    }
    eventually("every handler has started", secs(10), async || {
        let n = started.lock().unwrap().len();
        done_if(n >= 20, format_args!("{n} handled"))
    })
    .await;
    stop(stop_tx, run).await;
    for (n, due, at) in started.lock().unwrap().iter() {
        // Same machine, so the server's clock is ours: a handler never starts
        // before its message is due.
        assert!(at >= due, "message {n} started before it was due");
    }
}

/// A LockLayer over the worker's `Job`, with a handler of the plain payload
/// (the job mapped with `into_payload` below the layer), defers the job in
/// place: same id, deferrals counted, so `max_deferrals` ends a key that
/// never frees instead of copying the message forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_layer_over_the_job_defers_it_in_place_for_a_payload_handler() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "mapped").unwrap();
    let locker = Locker::new(conn).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(10)).max_deferrals(3)),
        )
        .map_request(|job: Job<Msg>| job.into_payload())
        .service_fn(|_: Msg| async { Ok::<_, BoxError>(()) });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .max_attempts(1)
        .unwrap();
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    let pushed = queue
        .push(Msg {
            n: 1,
            key: "busy".into(),
        })
        .await
        .unwrap();
    let deadline = Instant::now() + secs(10);
    while queue.stats().await.unwrap().dead < 1 {
        assert!(
            Instant::now() < deadline,
            "never dead-lettered: {:?}",
            metrics.snapshot()
        );
        tokio::time::sleep(ms(10)).await;
    }
    stop_tx.send(()).unwrap();
    run.await.unwrap().unwrap();
    let dead = queue.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].id, pushed.id,
        "the message was copied, not rescheduled"
    );
    assert_eq!(dead[0].deferrals, 3);
    assert!(
        dead[0].error.as_deref().unwrap_or("").contains("deferred"),
        "{dead:?}"
    );
    assert_eq!(metrics.snapshot().deferred, 3);
    assert!(locker.release(&holder).await.unwrap());
}

/// A handler that forwards a *different* message through a LockLayer
/// deferring into its own queue: the forwarded message is pushed as a new
/// message, and the job being handled is acknowledged normally (it is not
/// mistaken for the request the inner layer deferred).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_deferral_does_not_take_over_the_running_job() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "nested").unwrap();
    let locker = Locker::new(conn).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    async fn sub_handler(_: Msg) -> Result<(), BoxError> {
        Ok(())
    }
    let forward = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |m: &Msg| m.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), secs(60))),
        )
        .service_fn(sub_handler);
    let handled: Arc<Mutex<Vec<u32>>> = Default::default();
    let log = handled.clone();
    let service = tower::service_fn(move |job: Job<Msg>| {
        let (forward, log) = (forward.clone(), log.clone());
        async move {
            log.lock().unwrap().push(job.n);
            if job.n == 1 {
                // Forward a new message for a busy key: it gets deferred.
                let sub = Msg {
                    n: 2,
                    key: "busy".into(),
                };
                let outcome = tower::ServiceExt::oneshot(forward, sub)
                    .await
                    .expect("the forward call");
                assert!(outcome.is_deferred());
            }
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    let outer = queue
        .push(Msg {
            n: 1,
            key: "free".into(),
        })
        .await
        .unwrap();
    eventually("the outer job is acknowledged", secs(10), || async {
        let s = stats(&queue).await;
        done_if(
            metrics.snapshot().done == 1 && s.later == 1 && s.active == 0,
            s,
        )
    })
    .await;
    stop(stop_tx, run).await;
    assert_eq!(
        *handled.lock().unwrap(),
        vec![1],
        "the outer job ran more than once"
    );
    assert_eq!(metrics.snapshot().lost_leases, 0);
    // The forwarded message waits under an id of its own.
    let claimed = queue.claim(10, secs(5)).await.unwrap();
    assert!(
        claimed.jobs.is_empty(),
        "the forwarded message is due in 60 s"
    );
    assert_ne!(claimed.next_due, None);
    assert!(queue.remove(&outer.id).await.is_ok());
    assert!(locker.release(&holder).await.unwrap());
}

/// A middleware that calls its inner service from its own future (here an
/// `async` wrapper): the LockLayer over the `Job` inside still defers the
/// worker's job in place, since the claim travels in the request. Same id,
/// deferrals counted up to `max_deferrals`, and the stored JSON kept as
/// another producer wrote it (a field `Msg` does not know survives).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferring_behind_an_async_middleware_reschedules_the_running_job_in_place() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "wrapped").unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    let inner = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(10)).max_deferrals(3)),
        )
        .map_request(|job: Job<Msg>| job.into_payload())
        .service_fn(|_: Msg| async { Ok::<_, BoxError>(()) });
    // A logging wrapper as users write them: the inner call is made inside
    // the wrapper's future, not in its `call`.
    let service = tower::service_fn(move |job: Job<Msg>| {
        let inner = inner.clone();
        async move {
            tokio::task::yield_now().await;
            // (Boxed to help the compiler see that it is `Send`.)
            let call: std::pin::Pin<
                Box<dyn Future<Output = Result<lockgate::Outcome<()>, BoxError>> + Send>,
            > = Box::pin(tower::ServiceExt::oneshot(inner, job));
            call.await
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .max_attempts(1)
        .unwrap();
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    // Another producer's JSON: spacing, field order and a field of its own.
    let raw: Queue<serde_json::Value> = Queue::new(conn.clone(), "wrapped").unwrap();
    let pushed = raw
        .push(serde_json::json!({"key": "busy", "extra": "kept", "n": 1}))
        .await
        .unwrap();
    eventually("the message is dead-lettered", secs(10), || async {
        let s = stats(&queue).await;
        done_if(s.dead == 1, (s, metrics.snapshot()))
    })
    .await;
    stop_tx.send(()).unwrap();
    run.await.unwrap().unwrap();
    let dead = queue.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(
        dead[0].id, pushed.id,
        "the message was copied, not rescheduled"
    );
    assert_eq!(dead[0].deferrals, 3);
    let stored: serde_json::Value = serde_json::from_slice(&dead[0].payload).unwrap();
    assert_eq!(
        stored["extra"], "kept",
        "the stored JSON was rewritten: {stored}"
    );
    assert_eq!(metrics.snapshot().deferred, 3);
    assert!(locker.release(&holder).await.unwrap());
}

/// Behind tower's `Buffer` the LockLayer runs on the buffer's task: the
/// claim travels in the request (the `Job` itself), so a deferral there
/// reschedules the worker's job in place. Same id, its deferral counted, no
/// copy; it comes back once the key is free and is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_behind_a_buffer_is_deferred_in_place() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "buffered").unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    // (message id, deferrals) of each handled job.
    let handled = Arc::new(Mutex::new(Vec::new()));
    let log = handled.clone();
    let service = ServiceBuilder::new()
        .buffer(8)
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(200))),
        )
        .service_fn(move |job: Job<Msg>| {
            log.lock()
                .unwrap()
                .push((job.id().to_owned(), job.deferrals()));
            async { Ok::<_, BoxError>(()) }
        });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    let pushed = queue
        .push(Msg {
            n: 7,
            key: "busy".into(),
        })
        .await
        .unwrap();
    eventually("the deferral", secs(10), || async {
        done_if(metrics.snapshot().deferred >= 1, metrics.snapshot())
    })
    .await;
    let ids: Vec<String> = support::raw(&conn, &["HKEYS", "lockgate:{buffered}:data"]).await;
    assert_eq!(ids, vec![pushed.id.clone()], "rescheduled, not copied");
    assert!(locker.release(&holder).await.unwrap());
    eventually("the job is handled", secs(10), || async {
        let s = stats(&queue).await;
        done_if(
            handled.lock().unwrap().len() == 1 && s.due + s.later + s.active == 0,
            s,
        )
    })
    .await;
    stop_tx.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(*handled.lock().unwrap(), vec![(pushed.id.clone(), 1)]);
    let snapshot = metrics.snapshot();
    assert_eq!(
        (
            snapshot.deferred,
            snapshot.done,
            snapshot.dead,
            snapshot.lost_leases
        ),
        (1, 1, 0, 0),
        "{snapshot:?}"
    );
}

/// The other placement (docs/layer.md, "Composing"): tower's `Buffer` inside
/// the LockLayer over the `Job`. A deferral reschedules the claimed job in
/// place (no copy); the handler's `call` runs on the buffer's task, where
/// `HeldLock::current()` is not set, but the future it returns runs in the
/// layer's call, where it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_inside_the_lock_layer_defers_in_place_and_the_future_sees_the_lock() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "buffered-inside").unwrap();
    let locker = Locker::new(conn.clone()).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    // (message, lock seen in `call`, lock seen in the future)
    let handled = Arc::new(Mutex::new(Vec::new()));
    let log = handled.clone();
    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(200))),
        )
        .map_request(|job: Job<Msg>| job.into_payload())
        .buffer(8)
        .service_fn(move |m: Msg| {
            let in_call = lockgate::HeldLock::current().is_some();
            let log = log.clone();
            async move {
                let in_future = lockgate::HeldLock::current().is_some();
                log.lock().unwrap().push((m.n, in_call, in_future));
                Ok::<_, BoxError>(())
            }
        });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    let pushed = queue
        .push(Msg {
            n: 7,
            key: "busy".into(),
        })
        .await
        .unwrap();
    eventually("the deferral", secs(10), || async {
        done_if(metrics.snapshot().deferred >= 1, metrics.snapshot())
    })
    .await;
    assert!(locker.release(&holder).await.unwrap());
    eventually("the handler", secs(10), || async {
        let s = stats(&queue).await;
        done_if(
            handled.lock().unwrap().len() == 1 && s.due + s.later + s.active == 0,
            s,
        )
    })
    .await;
    stop_tx.send(()).unwrap();
    run.await.unwrap().unwrap();
    assert_eq!(*handled.lock().unwrap(), vec![(7, false, true)]);
    let snapshot = metrics.snapshot();
    assert_eq!((snapshot.deferred, snapshot.dead), (1, 0), "{snapshot:?}");
    assert!(
        !queue.remove(&pushed.id).await.unwrap(),
        "the job deferred in place was handled and acknowledged"
    );
}

/// A backlog reaches every idle worker: one push rings once and wakes one
/// worker, whose claim passes the wake-up on while due messages remain. Six
/// handlers over three workers with two slots each must all run at once
/// (each waits for the others); the bound is below the 2 s safety-net
/// wake-up, so this holds only through the chain of rings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_wakes_every_idle_worker() {
    let server = server();
    let queue: Queue<u32> = Queue::new(manager(&server).await, "chain").unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(6));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for _ in 0..3 {
        let barrier = barrier.clone();
        let service = tower::service_fn(move |_: Job<u32>| {
            let barrier = barrier.clone();
            async move {
                tokio::time::timeout(ms(1500), barrier.wait())
                    .await
                    .map_err(|_| "the six handlers never ran at once")?;
                Ok::<_, BoxError>(())
            }
        });
        let worker = Worker::new(server.client(), queue.clone(), service)
            .concurrency(2)
            .unwrap()
            .prefetch(0)
            .max_attempts(1)
            .unwrap();
        let mut stop = stop_rx.clone();
        let run = worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        });
        runs.push(tokio::spawn(run));
    }
    // Let the workers go idle (each blocks on the doorbell), then push.
    sleep_a_little().await;
    queue.push_many(0..6u32).await.unwrap();
    eventually("every message is handled", secs(10), || async {
        let s = stats(&queue).await;
        done_if(counts(&s) == (0, 0, 0, 0) || s.dead > 0, s)
    })
    .await;
    stop_tx.send(true).unwrap();
    for run in runs {
        run.await.unwrap().unwrap();
    }
    assert_eq!(
        stats(&queue).await.dead,
        0,
        "{:?}",
        queue.dead_letters(None, 100).await
    );
}

async fn sleep_a_little() {
    tokio::time::sleep(ms(300)).await;
}

/// Two lock layers, one inside the other: when the inner key is busy, the
/// inner layer defers the running job in place (the outer one handed it
/// on), the outer one answers `Done(Deferred)`, and the worker counts a
/// deferral instead of acknowledging the job: it comes back, under its own
/// id, and is handled once its key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_deferred_by_an_inner_layer_comes_back() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "stacked").unwrap();
    let locker = Locker::new(conn).ttl(secs(30)).unwrap();
    let holder = locker.acquire("busy").await.unwrap().lease().unwrap();
    let handled = Arc::new(Mutex::new(Vec::new()));
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locker.clone(), |job: &Job<Msg>| {
            format!("outer-{}", job.n)
        }))
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(OnConflict::defer(queue.clone(), ms(20))),
        )
        .service_fn({
            let handled = handled.clone();
            move |job: Job<Msg>| {
                let handled = handled.clone();
                async move {
                    handled
                        .lock()
                        .unwrap()
                        .push((job.id().to_owned(), job.deferrals()));
                    Ok::<_, BoxError>(())
                }
            }
        });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let metrics = worker.metrics();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stop_rx));
    let pushed = queue
        .push(Msg {
            n: 1,
            key: "busy".into(),
        })
        .await
        .unwrap();
    eventually("the job was deferred", secs(10), async || {
        let deferred = metrics.snapshot().deferred;
        done_if(deferred >= 2, deferred)
    })
    .await;
    assert!(handled.lock().unwrap().is_empty());
    assert!(locker.release(&holder).await.unwrap());
    eventually("the job was handled", secs(10), async || {
        let handled = handled.lock().unwrap().clone();
        done_if(!handled.is_empty(), format!("{handled:?}"))
    })
    .await;
    stop(stop_tx, run).await;
    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), 1, "{handled:?}");
    assert_eq!(handled[0].0, pushed.id, "deferred in place, not copied");
    assert!(handled[0].1 >= 2, "{handled:?}");
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
}

/// Issue 39: `run_until_idle` returns once the queue is drained: every
/// message due handled (a retried one and a busy key's chain included),
/// the delayed one left for later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_until_idle_returns_once_the_queue_is_drained() {
    let server = support::server();
    let queue: Queue<Msg> = Queue::new(support::manager(&server).await, "idle").unwrap();
    for n in 0..40 {
        let key = format!("k{}", n % 4);
        let options = lockgate::PushOptions::new().key(key.clone());
        queue.push_with(Msg { n, key }, options).await.unwrap();
    }
    for n in 40..60 {
        queue
            .push(Msg {
                n,
                key: String::new(),
            })
            .await
            .unwrap();
    }
    let later = Msg {
        n: 99,
        key: String::new(),
    };
    queue.push_after(later, support::secs(60)).await.unwrap();
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let service = tower::service_fn(move |job: Job<Msg>| {
        let seen = seen.clone();
        async move {
            // Message 41 fails its first attempt: retried at once.
            if job.n == 41 && job.attempt() == 1 {
                return Err::<(), BoxError>("once".into());
            }
            seen.lock().unwrap().push(job.n);
            Ok(())
        }
    });
    let backoff = lockgate::Backoff::exponential(support::ms(1), support::ms(1)).unwrap();
    let worker = Worker::new(server.client(), queue.clone(), service).retry_backoff(backoff);
    tokio::time::timeout(support::secs(20), worker.run_until_idle())
        .await
        .expect("drained")
        .unwrap();
    let mut handled = handled.lock().unwrap().clone();
    handled.sort_unstable();
    assert_eq!(handled, (0..60).collect::<Vec<_>>());
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.active, stats.later),
        (0, 0, 1),
        "{stats:?}"
    );
}

/// The shutdown future of `run_until` reads the queue through the same,
/// fresh handle the worker claims with (its first look at the queue's
/// layout is shared): the worker and the future both go on, and the worker
/// stops once the future sees the queue drained. It hung on `7f30639`:
/// the loop polled the future once without a waker, the future began the
/// first look, and the claim waited for it forever.
#[tokio::test]
async fn a_shutdown_future_that_reads_the_queue_does_not_stall_the_worker() {
    let server = server();
    let conn = manager(&server).await;
    let producer: Queue<u32> = Queue::new(conn.clone(), "drain").unwrap();
    producer.push_many([1, 2, 3]).await.unwrap();
    let queue: Queue<u32> = Queue::new(conn.clone(), "drain").unwrap();
    let service = tower::service_fn(|_: Job<u32>| async { Ok::<_, BoxError>(()) });
    let worker = Worker::new(server.client(), queue.clone(), service);
    let drained = async {
        loop {
            let stats = queue.stats().await.unwrap();
            if stats.due + stats.active == 0 {
                break;
            }
            tokio::time::sleep(ms(20)).await;
        }
    };
    let run = tokio::time::timeout(secs(10), worker.run_until(drained)).await;
    assert!(run.is_ok(), "the worker and its shutdown future stalled");
}
