//! Message priorities: among due messages a claim takes higher priorities
//! first, in push order within one; a message keeps its priority through
//! every way back to the schedule.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::{BoxError, Job, PushOptions, Queue, Worker};
use redis::aio::ConnectionManager;
use support::{manager, ms, secs, server};

type Q = Queue<u32, ConnectionManager>;

fn prio(p: u8) -> PushOptions {
    PushOptions::new().priority(p)
}

/// Claims everything that is due, a few at a time, and returns the payloads
/// in claim order (acknowledging each batch).
async fn claim_all(queue: &Q, batch: usize) -> Vec<Job<u32>> {
    let mut all = Vec::new();
    loop {
        let claimed = queue.claim(batch, secs(30)).await.unwrap();
        if claimed.jobs.is_empty() {
            return all;
        }
        for job in &claimed.jobs {
            assert!(queue.ack(job).await.unwrap());
        }
        all.extend(claimed.jobs);
    }
}

#[tokio::test]
async fn a_mixed_backlog_is_claimed_strictly_by_priority_and_in_push_order_within_one() {
    let server = server();
    let queue: Q = Queue::new(manager(&server).await, "mixed").unwrap();
    let priorities = [0u8, 3, 9, 0, 1, 3, 9, 5, 0, 1, 5, 3, 9, 0, 2];
    let mut expected: Vec<(u8, u32)> = Vec::new();
    // Several rounds, one message at a time and in batches: push order spans
    // many milliseconds and many scripts.
    for round in 0..4u32 {
        let msgs: Vec<(u32, PushOptions)> = priorities
            .iter()
            .enumerate()
            .map(|(i, p)| (round * 100 + i as u32, prio(*p)))
            .collect();
        if round % 2 == 0 {
            queue
                .push_many_with(msgs.iter().map(|(n, o)| (n, o.clone())))
                .await
                .unwrap();
        } else {
            for (n, options) in &msgs {
                queue.push_with(n, options.clone()).await.unwrap();
            }
        }
        expected.extend(
            priorities
                .iter()
                .enumerate()
                .map(|(i, p)| (*p, round * 100 + i as u32)),
        );
        tokio::time::sleep(ms(2)).await;
    }
    // Higher priority first; push order (the numbers grow with it) within.
    expected.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let claimed: Vec<(u8, u32)> = claim_all(&queue, 7)
        .await
        .iter()
        .map(|job| (job.priority(), **job))
        .collect();
    assert_eq!(claimed, expected);
    assert_eq!(support::counts(&support::stats(&queue).await), (0, 0, 0, 0));
}

#[tokio::test]
async fn a_delayed_high_priority_message_overtakes_due_low_priority_ones_once_due() {
    let server = server();
    let queue: Q = Queue::new(manager(&server).await, "overtake").unwrap();
    for n in 0..5 {
        queue.push_with(n, prio(1)).await.unwrap();
    }
    queue.push_with(99, prio(9).after(ms(200))).await.unwrap();
    let stats = support::stats(&queue).await;
    assert_eq!((stats.due, stats.later), (5, 1));
    assert!(stats.next_due_in.is_some_and(|d| d <= ms(200)), "{stats:?}");

    let first = queue.claim(1, secs(30)).await.unwrap();
    assert_eq!(*first.jobs[0], 0);
    assert!(
        first.next_due.is_some_and(|d| d == Duration::ZERO),
        "more are due"
    );
    tokio::time::sleep(ms(250)).await;
    let next = queue.claim(2, secs(30)).await.unwrap();
    let got: Vec<u32> = next.jobs.iter().map(|j| **j).collect();
    assert_eq!(got, [99, 1]);
    assert_eq!(next.jobs[0].priority(), 9);
}

#[tokio::test]
async fn retries_deferrals_releases_recoveries_and_redrives_keep_the_priority() {
    let server = server();
    let queue: Q = Queue::new(manager(&server).await, "keep").unwrap();
    queue.push_many([1, 2, 3]).await.unwrap();
    queue.push_with(7, prio(6)).await.unwrap();
    let next = |queue: Q| async move {
        let job = queue.claim(1, secs(30)).await.unwrap().jobs.remove(0);
        (job.priority(), *job, job)
    };

    let (p, n, job) = next(queue.clone()).await;
    assert_eq!((p, n), (6, 7));
    queue.retry(&job, Duration::ZERO, "boom").await.unwrap();
    let (p, n, job) = next(queue.clone()).await;
    assert_eq!((p, n, job.attempt()), (6, 7, 2));
    queue.defer(&job, Duration::ZERO).await.unwrap();
    let (p, n, job) = next(queue.clone()).await;
    assert_eq!((p, n, job.deferrals()), (6, 7, 1));
    queue.release(&job).await.unwrap();
    let (p, n, job) = next(queue.clone()).await;
    assert_eq!((p, n), (6, 7));
    queue.bury(&job, "dead").await.unwrap();
    assert!(queue.requeue_dead(job.id()).await.unwrap());

    // A lease that runs out: recovered with its priority.
    let short = queue.claim(1, ms(50)).await.unwrap();
    assert_eq!((short.jobs[0].priority(), *short.jobs[0]), (6, 7));
    tokio::time::sleep(ms(100)).await;
    assert_eq!(queue.recover(3).await.unwrap().requeued, 1);
    let order: Vec<(u8, u32)> = claim_all(&queue, 10)
        .await
        .iter()
        .map(|j| (j.priority(), **j))
        .collect();
    assert_eq!(order, [(6, 7), (0, 1), (0, 2), (0, 3)]);
}

#[tokio::test]
async fn stats_remove_and_purge_see_prioritized_messages() {
    let server = server();
    let queue: Q = Queue::new(manager(&server).await, "see").unwrap();
    queue.push_with(1, prio(4).id("a")).await.unwrap();
    queue
        .push_with(2, prio(4).id("b").after(secs(60)))
        .await
        .unwrap();
    queue.push_with(3, prio(8).id("c")).await.unwrap();
    queue
        .push_with(4, PushOptions::new().id("d"))
        .await
        .unwrap();
    let stats = support::stats(&queue).await;
    assert_eq!((stats.due, stats.later), (3, 1), "{stats:?}");
    assert!(stats.next_due_in.is_some_and(|d| d > secs(50)), "{stats:?}");
    // Pushing an existing id reports its due time, wherever it waits.
    let again = queue.push_with(2, prio(4).id("b")).await.unwrap();
    assert!(!again.created && again.due.is_some());
    assert!(queue.remove("c").await.unwrap());
    assert_eq!(support::stats(&queue).await.due, 2);
    assert!(queue.exists().await.unwrap());
    queue.purge().await.unwrap();
    assert!(!queue.exists().await.unwrap());
    assert_eq!(support::counts(&support::stats(&queue).await), (0, 0, 0, 0));
    // Priorities above 9 are refused before anything is written.
    let error = queue.push_with(5, prio(10)).await.unwrap_err();
    assert!(matches!(error, lockgate::Error::Config(_)), "{error:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_handles_a_backlog_by_priority() {
    let server = server();
    let queue: Q = Queue::new(manager(&server).await, "work").unwrap();
    let msgs: Vec<(u32, PushOptions)> = (0..40u32)
        .map(|n| (n, prio([0, 2, 7][n as usize % 3])))
        .collect();
    queue
        .push_many_with(msgs.iter().map(|(n, o)| (n, o.clone())))
        .await
        .unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let service = tower::service_fn({
        let order = order.clone();
        move |job: Job<u32>| {
            order.lock().unwrap().push((job.priority(), *job));
            async { Ok::<_, BoxError>(()) }
        }
    });
    // One at a time, prefetching one: the order is the claim order.
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(1)
        .unwrap()
        .prefetch(1);
    let done = {
        let order = order.clone();
        async move {
            while order.lock().unwrap().len() < 40 {
                tokio::time::sleep(ms(5)).await;
            }
        }
    };
    tokio::time::timeout(secs(20), worker.run_until(done))
        .await
        .unwrap()
        .unwrap();
    let order = order.lock().unwrap().clone();
    let priorities: Vec<u8> = order.iter().map(|(p, _)| *p).collect();
    let mut sorted = priorities.clone();
    sorted.sort_by(|a, b| b.cmp(a));
    assert_eq!(priorities, sorted, "{order:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prioritized_messages_deferred_into_a_busy_key_s_line_each_run_once() {
    use lockgate::layer::DeferDelay;
    use lockgate::{LockLayer, OnConflict};

    let server = server();
    let conn = manager(&server).await;
    let queue: Q = Queue::new(conn.clone(), "lines").unwrap();
    let msgs: Vec<(u32, PushOptions)> = (0..12u32).map(|n| (n, prio((n % 3 * 4) as u8))).collect();
    queue
        .push_many_with(msgs.iter().map(|(n, o)| (n, o.clone())))
        .await
        .unwrap();
    let holds = support::Holds::default();
    let service = tower::ServiceBuilder::new()
        .layer(
            LockLayer::new(support::locker(conn, secs(5)), |_: &Job<u32>| {
                "k".to_owned()
            })
            .on_conflict(OnConflict::defer(
                queue.clone(),
                DeferDelay::until_released(),
            )),
        )
        .service_fn({
            let holds = holds.clone();
            move |job: Job<u32>| {
                let holds = holds.clone();
                async move {
                    let start = tokio::time::Instant::now();
                    tokio::time::sleep(ms(10)).await;
                    holds.record("k", *job, start, tokio::time::Instant::now());
                    Ok::<_, BoxError>(())
                }
            }
        });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(4)
        .unwrap();
    let done = {
        let holds = holds.clone();
        async move {
            while holds.handled() < 12 {
                tokio::time::sleep(ms(5)).await;
            }
        }
    };
    tokio::time::timeout(secs(30), worker.run_until(done))
        .await
        .unwrap()
        .unwrap();
    holds.assert_each_once(12);
    holds.assert_exclusive();
    support::queue_drained(&queue).await;
}
