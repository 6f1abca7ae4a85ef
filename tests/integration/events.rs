//! Lifecycle events and completed messages: two processes follow one queue
//! and see every transition of a run once, in a consistent order per
//! message; a follower survives `CLIENT KILL`; completed retention stays
//! within its bounds; with events off nothing is written.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::time::Duration;

use futures_util::StreamExt;
use lockgate::queue::{EventKind, EventsFrom};
use lockgate::{BoxError, Job, LockLayer, OnConflict, Queue, Worker};
use redis::aio::ConnectionManager;
use support::{manager, ms, secs, server};
use tokio::time::{Instant, timeout};
use tower::ServiceBuilder;

/// Turns the ignored test `child` into a follower: `<redis url>;<queue>`.
const CHILD: &str = "LOCKGATE_EVENTS_CHILD";

/// A follower process: prints `event <kind> <id> <attempt>` for every event
/// from the beginning, until the message `end` is removed.
#[tokio::test]
#[ignore = "run as a child process by the events tests"]
async fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let (url, name) = spec.split_once(';').expect("<url>;<queue>");
    let client = redis::Client::open(url).unwrap();
    let queue: Queue<u32> =
        Queue::new(client.get_connection_manager().await.unwrap(), name).unwrap();
    let mut events = std::pin::pin!(queue.events(client, EventsFrom::Beginning).await.unwrap());
    println!("following");
    while let Some(event) = events.next().await {
        let event = event.unwrap();
        println!("event {} {} {}", event.kind, event.id, event.attempt);
        if event.kind == EventKind::Removed && event.id == "end" {
            return;
        }
    }
}

/// A follower process, killed if the test ends early.
struct Follower(std::process::Child);

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Per message, the kinds of its events in order, as a follower printed them.
fn by_message(lines: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["event", kind, id, _attempt] = words[..] {
            out.entry(id.to_owned()).or_default().push(kind.to_owned());
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_see_every_transition_of_a_run_once_and_in_order() {
    let server = server();
    let name = "followed";
    let conn = manager(&server).await;
    let queue: Queue<u32> = Queue::new(conn.clone(), name)
        .unwrap()
        .record_events(100_000)
        .unwrap();
    let mut children: Vec<Follower> = (0..2)
        .map(|_| {
            Follower(support::spawn_child(
                module_path!(),
                CHILD,
                &format!("{};{name}", server.url()),
            ))
        })
        .collect();
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|child| BufReader::new(child.0.stdout.take().unwrap()).lines())
        .collect();
    // The test harness speaks first ("running 1 test", "test child ... ").
    for reader in &mut readers {
        let greeting = reader
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.ends_with("following"));
        assert!(greeting.is_some(), "a follower ended before it started");
    }

    // 1,000 messages: every tenth fails once (retried), one fails for good
    // (dead), those of the hot key meet its lock (deferred) while another
    // holder keeps it for 300 ms.
    let total = 1000u32;
    let ids: Vec<String> = (0..total).map(|n| format!("m{n}")).collect();
    queue
        .push_many_with(
            (0..total).map(|n| (n, lockgate::PushOptions::new().id(ids[n as usize].clone()))),
        )
        .await
        .unwrap();
    let holder = support::locker(conn.clone(), ms(300));
    let _held = support::acquired(&holder, "hot").await;
    let layer = LockLayer::new(support::locker(conn.clone(), secs(5)), |job: &Job<u32>| {
        if **job % 50 == 7 {
            "hot".to_owned()
        } else {
            format!("k{}", **job)
        }
    })
    .on_conflict(OnConflict::defer(queue.clone(), ms(100)));
    let service = ServiceBuilder::new()
        .layer(layer)
        .service_fn(|job: Job<u32>| async move {
            if *job == 13 || (job.is_multiple_of(10) && job.attempt() == 1) {
                return Err::<(), BoxError>(format!("failing {}", *job).into());
            }
            Ok(())
        });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(20)
        .unwrap()
        .max_attempts(2)
        .unwrap()
        .retry_backoff(
            lockgate::Backoff::exponential(ms(5), ms(5))
                .unwrap()
                .unlimited_attempts(),
        );
    let metrics = worker.metrics();
    let drained = {
        let queue = queue.clone();
        async move {
            let deadline = Instant::now() + secs(60);
            loop {
                let s = queue.stats().await.unwrap();
                if (s.due, s.later, s.active) == (0, 0, 0) && s.dead == 1 {
                    return;
                }
                assert!(Instant::now() < deadline, "the run did not finish: {s:?}");
                tokio::time::sleep(ms(20)).await;
            }
        }
    };
    timeout(secs(90), worker.run_until(drained))
        .await
        .unwrap()
        .unwrap();
    // The end marker: pushed and removed, so the followers stop.
    queue
        .push_with(0, lockgate::PushOptions::new().id("end").after(secs(60)))
        .await
        .unwrap();
    assert!(queue.remove("end").await.unwrap());

    let mut seen = Vec::new();
    for (reader, child) in readers.into_iter().zip(&mut children) {
        let lines: Vec<String> = reader.map_while(Result::ok).collect();
        assert!(child.0.wait().unwrap().success());
        seen.push(by_message(&lines));
    }
    assert_eq!(
        seen[0], seen[1],
        "the two followers saw different histories"
    );
    let history = &seen[0];
    let m = metrics.snapshot();
    let mut counts: HashMap<&str, u64> = HashMap::new();
    for (id, kinds) in history {
        if id == "end" {
            assert_eq!(kinds, &["pushed", "removed"]);
            continue;
        }
        assert_eq!(
            kinds.first().map(String::as_str),
            Some("pushed"),
            "{id}: {kinds:?}"
        );
        // After the push: claimed, then one outcome, again and again; the
        // last outcome is final (done or dead).
        let mut rest = kinds[1..].iter();
        let mut last = "";
        while let Some(kind) = rest.next() {
            assert_eq!(kind, "claimed", "{id}: {kinds:?}");
            let outcome = rest
                .next()
                .unwrap_or_else(|| panic!("{id}: claimed last: {kinds:?}"));
            assert!(
                ["done", "retried", "deferred", "dead"].contains(&outcome.as_str()),
                "{id}: {kinds:?}"
            );
            *counts.entry(outcome.as_str()).or_default() += 1;
            last = outcome;
        }
        let expected = if id == "m13" { "dead" } else { "done" };
        assert_eq!(last, expected, "{id}: {kinds:?}");
    }
    assert_eq!(history.len() as u32, total + 1);
    assert_eq!(counts["done"], u64::from(total) - 1);
    assert_eq!(counts["dead"], 1);
    assert_eq!(counts["retried"], m.retried, "{m:?}");
    assert_eq!(
        counts.get("deferred").copied().unwrap_or(0),
        m.deferred,
        "{m:?}"
    );
    assert!(m.deferred > 0 && m.retried >= 100, "{m:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_reconnected_after_client_kill_misses_nothing() {
    let server = server();
    let conn = support::reconnecting_manager(&server).await;
    let queue: Queue<u32, ConnectionManager> = Queue::new(conn.clone(), "killed")
        .unwrap()
        .record_events(10_000)
        .unwrap();
    // Something before: "now" starts after it.
    queue.push(1000).await.unwrap();
    let mut events = Box::pin(
        queue
            .events(server.client(), EventsFrom::Now)
            .await
            .unwrap(),
    );
    // Pushed right away: "now" was resolved when `events` returned.
    queue.push_many(0..100u32).await.unwrap();
    let mut pushed = Vec::new();
    while pushed.len() < 100 {
        pushed.push(
            timeout(secs(5), events.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap(),
        );
    }
    // Kill every client connection (the follower's blocked XREAD too).
    let killed: i64 = server
        .query(redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("normal"))
        .unwrap();
    assert!(killed >= 1);
    support::eventually("the producer reconnects", secs(10), async || {
        support::done_if(queue.push_many(100..200u32).await.is_ok(), "push failed")
    })
    .await;
    while pushed.len() < 200 {
        pushed.push(
            timeout(secs(10), events.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap(),
        );
    }
    let ids: std::collections::BTreeSet<&str> = pushed.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids.len(), 200, "an event was delivered twice or missed");
    assert!(
        pushed
            .iter()
            .all(|e| e.kind == EventKind::Pushed && e.attempt == 1)
    );
    // Nothing more comes.
    assert!(timeout(ms(300), events.next()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_messages_are_kept_within_their_bounds() {
    let server = server();
    let conn = manager(&server).await;
    let keep = 50;
    let queue: Queue<u32> = Queue::new(conn.clone(), "kept")
        .unwrap()
        .keep_completed(Some(keep), None)
        .unwrap();
    let total = 100_000u32;
    queue.push_many(0..total).await.unwrap();
    let service = tower::service_fn(|_: Job<u32>| async { Ok::<_, BoxError>(()) });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(50)
        .unwrap();
    let metrics = worker.metrics();
    let key = "lockgate:{kept}:completed";
    let watch = async {
        let mut most = 0;
        while metrics.snapshot().done < u64::from(total) {
            let len: usize = support::raw(&conn, &["XLEN", key]).await;
            most = most.max(len);
            tokio::time::sleep(ms(5)).await;
        }
        most
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stopped));
    let most = timeout(secs(120), watch).await.unwrap();
    support::stop(stop, run).await;
    assert!(most <= keep, "{most} completed messages kept, limit {keep}");
    let kept = queue.completed(100).await.unwrap();
    assert_eq!(kept.len(), keep);
    assert!(
        kept.windows(2)
            .all(|w| w[0].completed_at >= w[1].completed_at)
    );
    assert!(kept.iter().all(|c| c.attempt == 1 && !c.payload.is_empty()));
    // The data of acknowledged messages is gone, as without retention.
    assert!(!support::exists(&conn, "lockgate:{kept}:data").await);

    // By age: only what completed in the last 200 ms stays.
    let aged: Queue<u32> = Queue::new(conn.clone(), "aged")
        .unwrap()
        .keep_completed(None, Some(ms(200)))
        .unwrap();
    aged.push_many(0..10u32).await.unwrap();
    for job in aged.claim(10, secs(30)).await.unwrap().jobs {
        aged.ack(&job).await.unwrap();
    }
    assert_eq!(aged.completed(100).await.unwrap().len(), 10);
    tokio::time::sleep(ms(300)).await;
    aged.push(10).await.unwrap();
    let job = aged.claim(1, secs(30)).await.unwrap().jobs.remove(0);
    aged.ack(&job).await.unwrap();
    let left = aged.completed(100).await.unwrap();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].payload, b"10");
    // Bad settings are refused.
    assert!(
        Queue::<u32>::new(conn.clone(), "x")
            .unwrap()
            .keep_completed(None, None)
            .is_err()
    );
    assert!(
        Queue::<u32>::new(conn.clone(), "x")
            .unwrap()
            .keep_completed(Some(0), None)
            .is_err()
    );
    assert!(
        Queue::<u32>::new(conn, "x")
            .unwrap()
            .record_events(0)
            .is_err()
    );
}

#[tokio::test]
async fn with_events_off_nothing_is_written() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<u32> = Queue::new(conn.clone(), "quiet").unwrap();
    queue.push_many(0..10u32).await.unwrap();
    let claimed = queue.claim(10, secs(30)).await.unwrap();
    queue.ack(&claimed.jobs[0]).await.unwrap();
    queue.ack_many(&claimed.jobs[1..5]).await.unwrap();
    queue
        .retry(&claimed.jobs[5], Duration::ZERO, "x")
        .await
        .unwrap();
    queue.bury(&claimed.jobs[6], "x").await.unwrap();
    for key in ["events", "completed"] {
        assert!(
            !support::exists(&conn, &format!("lockgate:{{quiet}}:{key}")).await,
            "{key}"
        );
    }
}

/// Issue 38: the activity of a busy queue counts every message of the
/// window, the newest included. (It read the *first* 1,000 events entries
/// since the window's start, so on a busy queue the newest buckets showed
/// nothing.) 1,100 acknowledgements, each its own entry, after the entries
/// of the pushes and claims.
#[tokio::test]
async fn activity_counts_the_newest_messages_of_a_busy_queue() {
    let server = server();
    let queue: Queue<u32> = Queue::new(manager(&server).await, "busy")
        .unwrap()
        .record_events(100_000)
        .unwrap();
    queue.push_many(0..1100u32).await.unwrap();
    let mut jobs = Vec::new();
    while jobs.len() < 1100 {
        jobs.extend(queue.claim(1000, secs(60)).await.unwrap().jobs);
    }
    for job in &jobs {
        assert!(queue.ack(job).await.unwrap());
    }
    let activity = queue.activity(secs(60), 6).await.unwrap();
    assert_eq!(activity.done.iter().sum::<u64>(), 1100, "{activity:?}");
    assert_eq!(
        activity.done[5], 1100,
        "all in the newest bucket: {activity:?}"
    );
    assert_eq!(activity.failed, [0; 6]);
}

/// Each second's counts go to the bucket it ends in: the current second to
/// the newest bucket, a second 25 s ago to the bucket of 30 to 40 s ago
/// counted from the window's start; a slot last written an hour ago reads
/// as zero. (The counts are the `activity` hash of docs/internals.md, written here
/// directly at known seconds.)
#[tokio::test]
async fn activity_puts_each_second_in_its_bucket() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<u32> = Queue::new(conn.clone(), "seconds")
        .unwrap()
        .record_events(1000)
        .unwrap();
    // The queue records events: its stream exists.
    queue.push(1).await.unwrap();
    let (now, _): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let slot = |second: u64| (second % 3600).to_string();
    let counts = [
        (slot(now), format!("{now} 7 1")),
        (slot(now - 25), format!("{} 3 2", now - 25)),
        // Another turn of the ring: an hour before its second.
        (slot(now - 45), format!("{} 100 100", now - 45 - 3600)),
    ];
    for (field, value) in counts {
        let _: i64 = support::raw(
            &conn,
            &["HSET", "lockgate:{seconds}:activity", &field, &value],
        )
        .await;
    }
    let activity = queue.activity(secs(60), 6).await.unwrap();
    assert!(activity.recorded);
    assert_eq!(activity.done, [0, 0, 0, 3, 0, 7]);
    assert_eq!(activity.failed, [0, 0, 0, 2, 0, 1]);
}

#[tokio::test]
async fn activity_counts_what_a_queue_did_in_one_round_trip() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<u32> = Queue::new(conn.clone(), "busy")
        .unwrap()
        .record_events(1000)
        .unwrap();
    queue.push_many(0..10u32).await.unwrap();
    let claimed = queue.claim(10, secs(30)).await.unwrap().jobs;
    queue.ack_many(&claimed[..7]).await.unwrap();
    queue.retry(&claimed[7], Duration::ZERO, "x").await.unwrap();
    queue.bury(&claimed[8], "y").await.unwrap();
    let activity = queue.activity(secs(60), 6).await.unwrap();
    assert!(activity.recorded);
    assert_eq!(activity.bucket, secs(10));
    assert_eq!((activity.done.len(), activity.failed.len()), (6, 6));
    assert_eq!(activity.done.iter().sum::<u64>(), 7);
    assert_eq!(activity.failed.iter().sum::<u64>(), 2);
    assert_eq!(
        activity.done[5], 7,
        "everything happened in the last bucket"
    );
    assert_eq!(
        (
            activity.stats.due,
            activity.stats.active,
            activity.stats.dead
        ),
        (1, 1, 1)
    );
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (1, 0, 1, 1)
    );

    let quiet: Queue<u32> = Queue::new(conn, "quiet-activity").unwrap();
    quiet.push(1).await.unwrap();
    let activity = quiet.activity(secs(60), 6).await.unwrap();
    assert!(!activity.recorded);
    assert_eq!(activity.done, [0; 6]);
    assert_eq!(activity.stats.due, 1);
}
