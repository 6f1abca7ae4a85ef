//! Integration tests for `lockgate::Queue` and `lockgate::queue::Waiter`
//! against real, private `redis-server` processes (one per test, started
//! through `lockgate::testing::RedisServer`; never port 6379).
//!
//! The tests check behaviour and invariants: every message claimed exactly
//! once, none lost, due order, claims that prove ownership, dead letters,
//! de-duplication, the key layout other producers rely on, and a waiter that
//! keeps working across connection loss. Timings only appear as generous
//! sanity bounds ("woke before the deadline"), and leases and delays are
//! short so that the file stays quick.

use crate::support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use lockgate::queue::{Stats, Waiter, Wake};
use lockgate::testing::RedisServer;
use lockgate::{Error, PushOptions, Queue};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use support::{
    BOUNDED, counts, done_if, eventually, hash_tag, manager, ms, raw, secs, server, stats,
};
use tokio::time::{Instant, sleep, timeout};

/// A lease that never runs out during a test.
const LONG: Duration = secs(60);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Email {
    to: String,
    n: u64,
}

fn email(n: u64) -> Email {
    Email {
        to: format!("user{n}@example.com"),
        n,
    }
}

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn queue<T>(conn: ConnectionManager, name: &str) -> Queue<T>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    Queue::new(conn, name).expect("valid queue name")
}

/// The name of one of queue `name`'s keys under the default prefix (for
/// names without `}` or `\`, which appear verbatim in the hash tag).
fn key(name: &str, part: &str) -> String {
    format!("lockgate:{{{name}}}:{part}")
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Claims one batch and asserts nothing was buried.
async fn claim<T>(q: &Queue<T>, max: usize, lease: Duration) -> Vec<lockgate::Job<T>>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let claimed = q.claim(max, lease).await.expect("claim");
    assert_eq!(claimed.buried, 0, "nothing should have been buried");
    claimed.jobs
}

/// Claims exactly one job.
async fn claim_one<T>(q: &Queue<T>, lease: Duration) -> lockgate::Job<T>
where
    T: Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut jobs = claim(q, 10, lease).await;
    assert_eq!(jobs.len(), 1, "expected exactly one job, got {jobs:?}");
    jobs.pop().unwrap()
}

/// Claims a single message that was scheduled `delay` ahead, `since` being
/// taken before the call that scheduled it.
///
/// The first claim, made right away, must return nothing (and report the
/// next due time, in the future and at most `delay` ahead), unless the test
/// itself was stalled for `delay` or longer, which is the only case in which
/// getting the message is allowed. The second claim, made once the reported
/// time has passed, must return it.
async fn claim_when_due<T>(q: &Queue<T>, since: Instant, delay: Duration) -> lockgate::Job<T>
where
    T: Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut claimed = q.claim(10, LONG).await.expect("claim");
    assert_eq!(claimed.buried, 0);
    if let Some(job) = claimed.jobs.pop() {
        assert!(
            since.elapsed() >= delay,
            "claimed {job:?} {:?} before it was due",
            since.elapsed()
        );
        assert!(claimed.jobs.is_empty());
        return job;
    }
    let next_due = claimed.next_due.expect("something is scheduled");
    assert!(next_due > Duration::ZERO, "{next_due:?}");
    assert!(next_due <= delay, "{next_due:?} is beyond {delay:?}");
    let s = stats(q).await;
    assert!(
        (s.due, s.later) == (0, 1) || since.elapsed() >= delay,
        "not yet due, yet {s:?}"
    );
    sleep(next_due).await;
    let claimed = q.claim(10, LONG).await.expect("claim");
    assert_eq!(claimed.jobs.len(), 1, "not claimable once due: {claimed:?}");
    claimed.jobs.into_iter().next().unwrap()
}

/// Asserts the state counts (ignoring `oldest_due_age`).
#[track_caller]
fn assert_counts(s: Stats, due: u64, later: u64, active: u64, dead: u64) {
    assert_eq!(
        counts(&s),
        (due, later, active, dead),
        "(due, later, active, dead) of {s:?}"
    );
}

/// Pushes with a caller id (so a retried push cannot duplicate), retrying
/// while the producer's connection manager reconnects after the server cut
/// its connection.
async fn push_retrying<T>(q: &Queue<T>, msg: T, id: &str)
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let mut last = None;
    for _ in 0..20 {
        match q.push_with(&msg, PushOptions::new().id(id)).await {
            Ok(_) => return,
            Err(e) => {
                assert!(e.is_retryable(), "push failed for good: {e}");
                last = Some(e);
                sleep(ms(50)).await;
            }
        }
    }
    panic!("push kept failing: {last:?}");
}

/// Claims, retrying while the connection manager reconnects.
async fn claim_retrying<T>(q: &Queue<T>) -> Vec<lockgate::Job<T>>
where
    T: Serialize + serde::de::DeserializeOwned,
{
    let mut last = None;
    for _ in 0..20 {
        match q.claim(10, LONG).await {
            Ok(c) => return c.jobs,
            Err(e) => {
                assert!(e.is_retryable(), "claim failed for good: {e}");
                last = Some(e);
                sleep(ms(50)).await;
            }
        }
    }
    panic!("claim kept failing: {last:?}");
}

/// Consumes rings left in the bell by earlier pushes, until a short wait
/// runs to its deadline.
async fn drain(waiter: &mut Waiter<redis::Client, ConnectionManager>) {
    for _ in 0..10 {
        let deadline = Instant::now() + ms(100);
        match waiter.wait(Some(deadline)).await.expect("wait") {
            Wake::Deadline => return,
            _ => continue,
        }
    }
    panic!("the bell kept ringing with nothing pushed");
}

/// Waits until a wait returns `Rung`, tolerating at most one error (the
/// waiter's connection was cut); returns how many errors were seen.
async fn wait_for_ring(waiter: &mut Waiter<redis::Client, ConnectionManager>, what: &str) -> usize {
    let mut errors = 0;
    loop {
        let deadline = Instant::now() + secs(5);
        match timeout(BOUNDED, waiter.wait(Some(deadline))).await {
            Err(_) => panic!("{what}: wait outlived its deadline"),
            Ok(Ok(Wake::Rung)) => return errors,
            Ok(Ok(other)) => panic!("{what}: expected a ring, got {other:?}"),
            Ok(Err(e)) => {
                errors += 1;
                assert!(errors <= 1, "{what}: wait failed twice in a row: {e}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Invariants under concurrency
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_take_every_message_exactly_once() {
    const MESSAGES: u64 = 10_000;
    const BATCHES: [usize; 8] = [1, 7, 50, 13, 100, 3, 64, 25];
    let server = server();
    // Claimers share two connection managers; the producer has a third.
    let conns = [manager(&server).await, manager(&server).await];
    let producer: Queue<u64> = queue(manager(&server).await, "inv");

    let pushed_all = Arc::new(AtomicBool::new(false));
    let claiming = Arc::new(AtomicBool::new(true));
    let push = {
        let producer = producer.clone();
        let pushed_all = pushed_all.clone();
        tokio::spawn(async move {
            let receipts = producer.push_many(0..MESSAGES).await.expect("push_many");
            pushed_all.store(true, Ordering::SeqCst);
            receipts
        })
    };

    let mut claimers = Vec::new();
    for (i, batch) in BATCHES.into_iter().enumerate() {
        let q: Queue<u64> = queue(conns[i % 2].clone(), "inv");
        let pushed_all = pushed_all.clone();
        claimers.push(tokio::spawn(async move {
            // Jobs are held (not acknowledged) until every message has been
            // claimed, so all 10,000 leases hold at once.
            let mut held = Vec::new();
            loop {
                let done = pushed_all.load(Ordering::SeqCst);
                let jobs = claim(&q, batch, LONG).await;
                if jobs.is_empty() {
                    if done {
                        return held;
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                held.extend(jobs);
            }
        }));
    }
    // Recovery running alongside must not take any message: every lease holds.
    let recoverer = {
        let q: Queue<u64> = queue(conns[0].clone(), "inv");
        let claiming = claiming.clone();
        tokio::spawn(async move {
            let (mut requeued, mut buried) = (0, 0);
            while claiming.load(Ordering::SeqCst) {
                let r = q.recover(1).await.expect("recover");
                requeued += r.requeued;
                buried += r.buried;
                sleep(ms(2)).await;
            }
            (requeued, buried)
        })
    };

    let receipts = push.await.expect("pusher panicked");
    let mut owners = Vec::new();
    for (i, claimer) in claimers.into_iter().enumerate() {
        let held = claimer.await.expect("claimer panicked");
        owners.extend(held.into_iter().map(|job| (i, job)));
    }
    let jobs: Vec<_> = owners.iter().map(|(_, job)| job).collect();
    claiming.store(false, Ordering::SeqCst);
    assert_eq!(recoverer.await.unwrap(), (0, 0), "recover took held leases");

    // Pushed: 10,000 distinct fresh ids, message i under receipt i.
    assert_eq!(receipts.len(), MESSAGES as usize);
    assert!(receipts.iter().all(|r| r.created && r.due.is_some()));
    let pushed: HashMap<String, u64> = receipts
        .iter()
        .enumerate()
        .map(|(i, r)| (r.id.clone(), i as u64))
        .collect();
    assert_eq!(pushed.len(), MESSAGES as usize, "push ids collide");

    // Claimed: each exactly once, first attempt, and nothing else.
    let mut claimed = HashMap::new();
    for job in &jobs {
        assert_eq!(job.attempt(), 1, "{job:?}");
        assert_eq!(job.deferrals(), 0, "{job:?}");
        if let Some(earlier) = claimed.insert(job.id().to_owned(), *job.payload()) {
            panic!(
                "{} claimed twice (payloads {earlier} and {})",
                job.id(),
                job.payload()
            );
        }
    }
    assert_eq!(claimed, pushed, "claimed messages differ from pushed ones");
    // Every claim call has a claim number of its own: no two claimers ever
    // hold the same one (it is what proves ownership).
    let mut owner_of_claim = HashMap::new();
    for (claimer, job) in &owners {
        let owner = *owner_of_claim.entry(job.claim()).or_insert(*claimer);
        assert_eq!(
            owner,
            *claimer,
            "claim {} shared by two claimers",
            job.claim()
        );
    }

    let s = stats(&producer).await;
    assert_counts(s, 0, 0, MESSAGES, 0);
    assert_eq!(s.oldest_due_age, None);

    // Every ack succeeds, spread over both connections.
    let acker = [
        queue::<u64>(conns[0].clone(), "inv"),
        queue::<u64>(conns[1].clone(), "inv"),
    ];
    for (n, chunk) in jobs.chunks(500).enumerate() {
        let q = &acker[n % 2];
        let acked = join_all(chunk.iter().map(|job| q.ack(job))).await;
        for (job, acked) in chunk.iter().zip(acked) {
            assert!(acked.expect("ack"), "ack of {} refused", job.id());
        }
    }
    assert_eq!(stats(&producer).await, Stats::default());
    // Nothing left behind: no payloads, no errors.
    let conn = producer.connection();
    assert_eq!(raw::<u64>(conn, &["HLEN", &key("inv", "data")]).await, 0);
    assert_eq!(raw::<u64>(conn, &["HLEN", &key("inv", "errors")]).await, 0);
}

// ---------------------------------------------------------------------------
// Order and due times
// ---------------------------------------------------------------------------

#[tokio::test]
async fn due_messages_are_claimed_in_due_order() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "order");
    for delay in [250, 50, 200, 0, 100, 150] {
        q.push_after(delay, ms(delay)).await.unwrap();
    }
    // Until all are due.
    eventually("all messages are due", BOUNDED, async || {
        let s = stats(&q).await;
        done_if(s.later == 0, s)
    })
    .await;
    let jobs = claim(&q, 100, LONG).await;
    let payloads: Vec<u64> = jobs.iter().map(|j| **j).collect();
    assert_eq!(payloads, [0, 50, 100, 150, 200, 250]);
    assert!(jobs.windows(2).all(|w| w[0].due_at() <= w[1].due_at()));
    assert!(jobs.iter().all(|j| j.enqueued_at() <= j.due_at()));
}

#[tokio::test]
async fn messages_due_in_the_same_millisecond_come_in_push_order() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "fifo");
    let receipts = q.push_many(0..500u64).await.unwrap();
    // One batch is one script call: one server "now" for all.
    let due = receipts[0].due.expect("scheduled");
    assert!(receipts.iter().all(|r| r.created && r.due == Some(due)));

    let mut payloads = Vec::new();
    loop {
        let jobs = claim(&q, 50, LONG).await;
        if jobs.is_empty() {
            break;
        }
        assert!(jobs.len() <= 50);
        payloads.extend(jobs.iter().map(|j| **j));
    }
    assert_eq!(payloads, (0..500).collect::<Vec<u64>>());
}

#[tokio::test]
async fn a_delayed_message_is_claimable_once_due_and_not_before() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "delayed");
    let before = SystemTime::now();
    let since = Instant::now();
    let pushed = q.push_after(email(1), ms(300)).await.unwrap();
    assert!(pushed.created);
    assert!(pushed.due.unwrap() > before, "{pushed:?}");

    let job = claim_when_due(&q, since, ms(300)).await;
    assert_eq!(job.id(), pushed.id);
    assert_eq!(*job, email(1));
    assert_eq!(Some(job.due_at()), pushed.due);
    assert!(job.enqueued_at() < job.due_at());
    assert!(q.ack(&job).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
}

#[tokio::test]
async fn push_at_in_the_past_is_due_now_and_in_the_future_is_not() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "at");
    let past = SystemTime::now() - secs(5);
    let pushed = q.push_at(1, past).await.unwrap();
    assert_eq!(
        pushed.due.map(unix_ms),
        Some(unix_ms(past)),
        "due at the given time"
    );
    let s = stats(&q).await;
    assert_counts(s, 1, 0, 0, 0);
    assert!(s.oldest_due_age.unwrap() >= secs(5), "{s:?}");
    let job = claim_one(&q, LONG).await;
    assert_eq!(*job, 1);
    assert!(q.ack(&job).await.unwrap());

    let since = Instant::now();
    let future = SystemTime::now() + ms(300);
    let pushed = q.push_at(2, future).await.unwrap();
    assert_eq!(pushed.due.map(unix_ms), Some(unix_ms(future)));
    let job = claim_when_due(&q, since, ms(300)).await;
    assert_eq!(*job, 2);
    assert_eq!(unix_ms(job.due_at()), unix_ms(future));
}

// ---------------------------------------------------------------------------
// Leases and claims
// ---------------------------------------------------------------------------

#[tokio::test]
async fn an_expired_lease_is_redelivered_and_the_stale_holder_is_refused() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "lease");
    q.push(email(7)).await.unwrap();
    let stale = claim_one(&q, ms(200)).await;
    assert_eq!(stale.attempt(), 1);

    // A lease that holds is not recovered.
    let none = q.recover(3).await.unwrap();
    assert_eq!((none.requeued, none.buried), (0, 0));

    sleep(ms(250)).await;
    let r = q.recover(3).await.unwrap();
    assert_eq!((r.requeued, r.buried), (1, 0));
    assert_counts(stats(&q).await, 1, 0, 0, 0);

    // Back on the schedule, the stale holder can do nothing with it.
    assert!(!q.ack(&stale).await.unwrap());
    assert_counts(stats(&q).await, 1, 0, 0, 0);

    let fresh = claim_one(&q, LONG).await;
    assert_eq!(fresh.id(), stale.id());
    // A lease that ran out is a stall, not a failed attempt.
    assert_eq!((fresh.attempt(), fresh.stalls()), (1, 1));
    assert_ne!(fresh.claim(), stale.claim());
    assert_eq!(*fresh, email(7));

    // Taken by another worker: every operation with the stale claim is
    // refused and changes nothing.
    assert!(!q.ack(&stale).await.unwrap());
    assert_eq!(q.retry(&stale, Duration::ZERO, "x").await.unwrap(), None);
    assert_eq!(q.defer(&stale, Duration::ZERO).await.unwrap(), None);
    assert!(!q.bury(&stale, "x").await.unwrap());
    assert_eq!(q.extend([&stale], LONG).await.unwrap(), [false]);
    assert_counts(stats(&q).await, 0, 0, 1, 0);
    assert!(q.dead_letters(None, 100).await.unwrap().letters.is_empty());
    assert_eq!(
        raw::<Option<String>>(
            q.connection(),
            &["HGET", &key("lease", "errors"), stale.id()]
        )
        .await
        .as_deref(),
        Some("lease expired: the worker died or stalled"),
        "the stale holder's retry must not overwrite the recorded error"
    );

    // The new holder's claim still works.
    assert!(q.ack(&fresh).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
    assert!(!q.ack(&fresh).await.unwrap(), "acked twice");
}

#[tokio::test]
async fn extending_a_lease_keeps_recover_away() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "extend");
    q.push_many([1u64, 2, 3]).await.unwrap();
    let mut jobs = claim(&q, 10, ms(500)).await;
    assert_eq!(jobs.len(), 3);
    // The third is not extended: it shows what recover does without renewal.
    let control = jobs.pop().unwrap();
    sleep(ms(100)).await;
    assert_eq!(q.extend(&jobs, secs(3)).await.unwrap(), [true, true]);
    // Past the original lease.
    sleep(ms(550)).await;
    let r = q.recover(5).await.unwrap();
    assert_eq!(
        (r.requeued, r.buried),
        (1, 0),
        "recover must take exactly the lease that was not extended"
    );
    assert_counts(stats(&q).await, 1, 0, 2, 0);
    assert!(!q.ack(&control).await.unwrap());
    assert!(
        q.extend(Vec::<&lockgate::Job<u64>>::new(), LONG)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(matches!(
        q.extend(&jobs, Duration::ZERO).await,
        Err(Error::Config(_))
    ));
    for job in &jobs {
        assert!(q.ack(job).await.unwrap());
    }
    let control = claim_one(&q, LONG).await;
    assert_eq!((*control, control.attempt(), control.stalls()), (3, 1, 1));
    assert!(q.ack(&control).await.unwrap());

    // Extending a claim that was lost to recovery fails.
    q.push(3).await.unwrap();
    let stale = claim_one(&q, ms(20)).await;
    sleep(ms(60)).await;
    assert_eq!(q.recover(5).await.unwrap().requeued, 1);
    assert_eq!(q.extend([&stale], LONG).await.unwrap(), [false]);
    assert_counts(stats(&q).await, 1, 0, 0, 0);
    // Also when the message was claimed again meanwhile.
    let fresh = claim_one(&q, LONG).await;
    assert_eq!(
        q.extend([&stale, &fresh], LONG).await.unwrap(),
        [false, true]
    );
    assert!(q.ack(&fresh).await.unwrap());
}

// ---------------------------------------------------------------------------
// Retries, deferrals, dead letters
// ---------------------------------------------------------------------------

#[tokio::test]
async fn retry_counts_failures_records_errors_and_respects_its_delay() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "retry");
    let errors = key("retry", "errors");
    let id = q.push(email(3)).await.unwrap().id;

    let job = claim_one(&q, LONG).await;
    assert_eq!(job.attempt(), 1);
    let due = q.retry(&job, Duration::ZERO, "boom 1").await.unwrap();
    assert!(due.is_some());
    assert!(!q.ack(&job).await.unwrap(), "retry released the claim");
    assert_eq!(
        raw::<Option<String>>(q.connection(), &["HGET", &errors, &id])
            .await
            .as_deref(),
        Some("boom 1")
    );

    let job = claim_one(&q, LONG).await;
    assert_eq!((job.attempt(), job.deferrals()), (2, 0));
    assert_eq!(Some(job.due_at()), due);
    q.retry(&job, Duration::ZERO, "boom 2")
        .await
        .unwrap()
        .unwrap();

    let job = claim_one(&q, LONG).await;
    assert_eq!(job.attempt(), 3);
    assert_eq!(*job, email(3), "payload survives retries");
    let since = Instant::now();
    let before = SystemTime::now();
    let due = q.retry(&job, ms(200), "boom 3").await.unwrap().unwrap();
    assert!(unix_ms(due) >= unix_ms(before) + 200, "retry delay ignored");
    let job = claim_when_due(&q, since, ms(200)).await;
    assert_eq!(job.attempt(), 4);
    assert_eq!(Some(job.due_at()), Some(due));
    assert_eq!(
        raw::<Option<String>>(q.connection(), &["HGET", &errors, &id])
            .await
            .as_deref(),
        Some("boom 3")
    );
    assert!(q.bury(&job, "boom 4, giving up").await.unwrap());
    let dead = q.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, id);
    // Three retries and the final failure that buried it.
    assert_eq!(dead[0].failures, 4);
    assert_eq!(dead[0].error.as_deref(), Some("boom 4, giving up"));
    assert_eq!(dead[0].decode::<Email>().unwrap(), email(3));

    // An ack after failures leaves no error behind.
    assert!(q.requeue_dead(&id).await.unwrap());
    let job = claim_one(&q, LONG).await;
    q.retry(&job, Duration::ZERO, "again")
        .await
        .unwrap()
        .unwrap();
    let job = claim_one(&q, LONG).await;
    assert_eq!(job.attempt(), 2);
    assert!(q.ack(&job).await.unwrap());
    assert_eq!(raw::<u64>(q.connection(), &["HLEN", &errors]).await, 0);
    assert_eq!(stats(&q).await, Stats::default());
}

#[tokio::test]
async fn defer_counts_deferrals_not_attempts() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "defer");
    q.push(9).await.unwrap();
    for deferrals in 0..3 {
        let job = claim_one(&q, LONG).await;
        assert_eq!((job.attempt(), job.deferrals()), (1, deferrals));
        q.defer(&job, Duration::ZERO).await.unwrap().unwrap();
        assert!(!q.ack(&job).await.unwrap(), "defer released the claim");
    }
    let job = claim_one(&q, LONG).await;
    assert_eq!((job.attempt(), job.deferrals()), (1, 3));
    // A deferral after a failure keeps the failure count.
    q.retry(&job, Duration::ZERO, "failed")
        .await
        .unwrap()
        .unwrap();
    let job = claim_one(&q, LONG).await;
    assert_eq!((job.attempt(), job.deferrals()), (2, 3));
    let since = Instant::now();
    q.defer(&job, ms(200)).await.unwrap().unwrap();
    let job = claim_when_due(&q, since, ms(200)).await;
    assert_eq!((job.attempt(), job.deferrals()), (2, 4));
    assert!(q.ack(&job).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
}

/// Lease expiries are stalls, capped by `recover`'s `max_stalls`: the
/// attempt number does not move, and the dead letter says which limit it hit.
#[tokio::test]
async fn recover_buries_after_max_stalls() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "attempts");
    let id = q.push(email(5)).await.unwrap().id;

    let job = claim_one(&q, ms(20)).await;
    assert_eq!((job.attempt(), job.stalls()), (1, 0));
    sleep(ms(60)).await;
    let r = q.recover(2).await.unwrap();
    assert_eq!((r.requeued, r.buried), (1, 0));

    let job = claim_one(&q, ms(20)).await;
    assert_eq!((job.attempt(), job.stalls()), (1, 1));
    sleep(ms(60)).await;
    let r = q.recover(2).await.unwrap();
    assert_eq!((r.requeued, r.buried), (0, 1));
    assert_counts(stats(&q).await, 0, 0, 0, 1);
    assert!(!q.ack(&job).await.unwrap());

    let dead = q.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    let letter = &dead[0];
    assert_eq!(letter.id, id);
    assert_eq!((letter.failures, letter.stalls), (0, 2));
    assert!(
        letter
            .error
            .as_deref()
            .unwrap()
            .starts_with("lease expired 2 times (limit 2): "),
        "{letter:?}"
    );
    assert_eq!(letter.decode::<Email>().unwrap(), email(5));
    assert!(letter.buried_at <= SystemTime::now());
}

#[tokio::test]
async fn dead_letters_are_listed_and_requeued_and_stats_follow() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "dead");
    for (n, id) in ["a", "b", "c"].into_iter().enumerate() {
        q.push_with(email(n as u64), PushOptions::new().id(id))
            .await
            .unwrap();
    }
    q.push_with(email(9), PushOptions::new().id("later").after(secs(60)))
        .await
        .unwrap();
    assert_counts(stats(&q).await, 3, 1, 0, 0);

    // a fails once before it is buried; b is buried at once; c stays active.
    let jobs = claim(&q, 10, LONG).await;
    let ids: Vec<&str> = jobs.iter().map(|j| j.id()).collect();
    assert_eq!(ids, ["a", "b", "c"]);
    q.retry(&jobs[0], Duration::ZERO, "a failed")
        .await
        .unwrap()
        .unwrap();
    let a = claim_one(&q, LONG).await;
    assert_eq!(a.attempt(), 2);
    assert!(q.bury(&a, "a is hopeless").await.unwrap());
    assert!(q.bury(&jobs[1], "b is hopeless").await.unwrap());
    let s = stats(&q).await;
    assert_counts(s, 0, 1, 1, 2);
    assert_eq!(s.oldest_due_age, None);

    let dead = q.dead_letters(None, 100).await.unwrap().letters;
    let listed: Vec<(&str, u32, Option<&str>)> = dead
        .iter()
        .map(|d| (d.id.as_str(), d.failures, d.error.as_deref()))
        .collect();
    assert_eq!(
        listed,
        [
            // `bury` counts the delivery it ends as a failed attempt.
            ("a", 2, Some("a is hopeless")),
            ("b", 1, Some("b is hopeless"))
        ]
    );
    assert_eq!(dead[0].decode::<Email>().unwrap(), email(0));
    assert_eq!(dead[1].decode::<Email>().unwrap(), email(1));
    assert!(dead[0].buried_at <= dead[1].buried_at);
    let first = q.dead_letters(None, 1).await.unwrap();
    assert_eq!(first.letters, dead[..1]);
    let second = q.dead_letters(first.next.as_ref(), 1).await.unwrap();
    assert_eq!((second.letters.as_slice(), second.next), (&dead[1..], None));

    // Re-drive one: due now, attempts reset.
    assert!(q.requeue_dead("a").await.unwrap());
    assert!(!q.requeue_dead("a").await.unwrap(), "not dead any more");
    assert!(!q.requeue_dead("missing").await.unwrap());
    assert!(!q.requeue_dead("c").await.unwrap(), "active, not dead");
    assert!(matches!(
        q.requeue_dead("").await,
        Err(Error::InvalidKey(_))
    ));
    assert_counts(stats(&q).await, 1, 1, 1, 1);
    let a = claim_one(&q, LONG).await;
    assert_eq!((a.id(), a.attempt(), a.deferrals()), ("a", 1, 0));
    assert_eq!(*a, email(0));
    assert!(q.ack(&a).await.unwrap());

    // Re-drive the rest.
    assert_eq!(q.requeue_all_dead().await.unwrap(), 1);
    assert_eq!(q.requeue_all_dead().await.unwrap(), 0);
    assert_counts(stats(&q).await, 1, 1, 1, 0);
    let b = claim_one(&q, LONG).await;
    assert_eq!((b.id(), b.attempt()), ("b", 1));
    assert!(q.ack(&b).await.unwrap());
    assert!(q.ack(&jobs[2]).await.unwrap());
    assert!(q.dead_letters(None, 100).await.unwrap().letters.is_empty());
    assert_counts(stats(&q).await, 0, 1, 0, 0);
}

/// More than [`lockgate::queue::MAX_BATCH`] messages in every bulk
/// operation: push_many, recover and requeue_all_dead each loop over
/// batches.
#[tokio::test]
async fn bulk_operations_cross_batch_boundaries() {
    const MESSAGES: u64 = 2_500;
    assert!(MESSAGES as usize > 2 * lockgate::queue::MAX_BATCH);
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "bulk");
    let receipts = q.push_many(0..MESSAGES).await.unwrap();
    assert_eq!(receipts.len(), MESSAGES as usize);
    assert!(receipts.iter().all(|r| r.created));
    let ids: HashSet<&str> = receipts.iter().map(|r| r.id.as_str()).collect();
    assert_eq!(ids.len(), MESSAGES as usize);
    assert_counts(stats(&q).await, MESSAGES, 0, 0, 0);
    assert_eq!(
        raw::<u64>(q.connection(), &["HLEN", &key("bulk", "data")]).await,
        MESSAGES
    );

    // Claim everything in maximal batches under a short lease...
    let mut jobs = Vec::new();
    loop {
        let batch = claim(&q, lockgate::queue::MAX_BATCH, ms(20)).await;
        if batch.is_empty() {
            break;
        }
        jobs.extend(batch);
    }
    let mut payloads: Vec<u64> = jobs.iter().map(|j| **j).collect();
    assert_eq!(payloads, (0..MESSAGES).collect::<Vec<_>>(), "push order");
    // ...let every lease run out, and bury them all in one recover call.
    sleep(ms(60)).await;
    let r = q.recover(1).await.unwrap();
    assert_eq!((r.requeued, r.buried), (0, MESSAGES as usize));
    assert_counts(stats(&q).await, 0, 0, 0, MESSAGES);
    let mut listed = 0;
    let mut after = None;
    loop {
        let page = q
            .dead_letters(after.as_ref(), lockgate::queue::MAX_BATCH)
            .await
            .unwrap();
        listed += page.letters.len();
        after = page.next;
        if after.is_none() {
            break;
        }
    }
    assert_eq!(listed, MESSAGES as usize);

    assert_eq!(q.requeue_all_dead().await.unwrap(), MESSAGES as usize);
    assert_counts(stats(&q).await, MESSAGES, 0, 0, 0);
    payloads.clear();
    loop {
        let batch = claim(&q, lockgate::queue::MAX_BATCH, LONG).await;
        if batch.is_empty() {
            break;
        }
        assert!(batch.iter().all(|j| j.attempt() == 1));
        payloads.extend(batch.iter().map(|j| **j));
    }
    payloads.sort_unstable();
    assert_eq!(payloads, (0..MESSAGES).collect::<Vec<_>>());
    q.purge().await.unwrap();
    assert_eq!(stats(&q).await, Stats::default());
}

// ---------------------------------------------------------------------------
// Ids, removal, purge
// ---------------------------------------------------------------------------

#[tokio::test]
async fn caller_ids_deduplicate_in_every_state() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "dedup");
    let first = q
        .push_with(email(1), PushOptions::new().id("x").after(secs(60)))
        .await
        .unwrap();
    assert!(first.created);
    assert_eq!(first.id, "x");
    let due = first.due.expect("scheduled");

    // Scheduled: reported with its due time, nothing changed.
    let again = q
        .push_with(email(2), PushOptions::new().id("x"))
        .await
        .unwrap();
    assert_eq!(
        (again.id.as_str(), again.created, again.due),
        ("x", false, Some(due))
    );
    assert_counts(stats(&q).await, 0, 1, 0, 0);
    q.remove("x").await.unwrap();

    q.push_with(email(1), PushOptions::new().id("x"))
        .await
        .unwrap();
    // Within one batch: the first wins.
    let batch = q
        .push_many_with([
            (email(3), PushOptions::new().id("y")),
            (email(4), PushOptions::new().id("y")),
            (email(5), PushOptions::new().id("x")),
        ])
        .await
        .unwrap();
    let created: Vec<bool> = batch.iter().map(|p| p.created).collect();
    assert_eq!(created, [true, false, false]);

    // Active: reported without a due time.
    let jobs = claim(&q, 10, LONG).await;
    assert_eq!(jobs.len(), 2);
    let x = jobs.iter().find(|j| j.id() == "x").unwrap();
    let y = jobs.iter().find(|j| j.id() == "y").unwrap();
    assert_eq!((**x).clone(), email(1));
    assert_eq!((**y).clone(), email(3));
    let again = q
        .push_with(email(6), PushOptions::new().id("x"))
        .await
        .unwrap();
    assert_eq!((again.created, again.due), (false, None));
    assert_counts(stats(&q).await, 0, 0, 2, 0);
    // The payload is the original one on the next delivery.
    q.retry(x, Duration::ZERO, "once more")
        .await
        .unwrap()
        .unwrap();
    let x = claim_one(&q, LONG).await;
    assert_eq!(*x, email(1));

    // Dead: reported without a due time; the dead letter keeps its payload.
    assert!(q.bury(&x, "dead").await.unwrap());
    let again = q
        .push_with(email(7), PushOptions::new().id("x"))
        .await
        .unwrap();
    assert_eq!((again.created, again.due), (false, None));
    let dead = q.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].decode::<Email>().unwrap(), email(1));
    assert_counts(stats(&q).await, 0, 0, 1, 1);
    assert!(q.ack(y).await.unwrap());

    // Empty ids are refused before anything is written, even in a batch.
    assert!(matches!(
        q.push_with(email(8), PushOptions::new().id("")).await,
        Err(Error::InvalidKey(_))
    ));
    assert!(matches!(
        q.push_many_with([
            (email(8), PushOptions::new().id("fine")),
            (email(9), PushOptions::new().id("")),
        ])
        .await,
        Err(Error::InvalidKey(_))
    ));
    assert_counts(stats(&q).await, 0, 0, 0, 1);
    assert!(
        !q.remove("fine").await.unwrap(),
        "part of a refused batch was written"
    );
}

#[tokio::test]
async fn ids_with_colons_and_unicode_round_trip() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "ids");
    // The active set stores "<id>:<claim>"; ids ending in ":<digits>" must
    // not confuse it.
    for (n, id) in ["order:7", "7:8:9", "ü {x} \\", " "]
        .into_iter()
        .enumerate()
    {
        q.push_with(n as u64, PushOptions::new().id(id))
            .await
            .unwrap();
        let job = claim_one(&q, ms(20)).await;
        assert_eq!(job.id(), id);
        sleep(ms(60)).await;
        assert_eq!(q.recover(5).await.unwrap().requeued, 1, "{id:?}");
        let job = claim_one(&q, LONG).await;
        assert_eq!((job.id(), job.attempt(), job.stalls()), (id, 1, 1));
        q.retry(&job, Duration::ZERO, "e").await.unwrap().unwrap();
        let job = claim_one(&q, LONG).await;
        assert!(q.bury(&job, "e").await.unwrap());
        assert!(q.requeue_dead(id).await.unwrap());
        let job = claim_one(&q, LONG).await;
        assert!(q.ack(&job).await.unwrap());
        assert_eq!(stats(&q).await, Stats::default(), "{id:?}");
    }
}

#[tokio::test]
async fn remove_and_purge() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<u64> = queue(conn.clone(), "rm");

    // Scheduled.
    q.push_with(1, PushOptions::new().id("s").after(secs(60)))
        .await
        .unwrap();
    assert!(q.remove("s").await.unwrap());
    assert!(!q.remove("s").await.unwrap());
    assert!(!q.remove("never").await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());

    // Dead (with its error).
    q.push_with(2, PushOptions::new().id("d")).await.unwrap();
    let job = claim_one(&q, LONG).await;
    assert!(q.bury(&job, "bad").await.unwrap());
    assert!(q.remove("d").await.unwrap());
    assert!(q.dead_letters(None, 100).await.unwrap().letters.is_empty());
    assert_eq!(stats(&q).await, Stats::default());
    assert_eq!(raw::<u64>(&conn, &["HLEN", &key("rm", "errors")]).await, 0);

    // Active: left to its worker, whose ack succeeds.
    q.push_with(3, PushOptions::new().id("a")).await.unwrap();
    let job = claim_one(&q, LONG).await;
    assert!(!q.remove("a").await.unwrap());
    assert!(q.ack(&job).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
    // The id is free again.
    assert!(
        q.push_with(4, PushOptions::new().id("a"))
            .await
            .unwrap()
            .created
    );
    assert_eq!(*claim_one(&q, LONG).await, 4);

    // Purge: every message in every state, every key of the queue, and no
    // other queue's keys.
    let other: Queue<u64> = queue(conn.clone(), "other");
    other.push(0).await.unwrap();
    q.push_many([5u64, 6, 7]).await.unwrap();
    q.push_after(8, secs(60)).await.unwrap();
    let jobs = claim(&q, 2, LONG).await;
    assert!(q.bury(&jobs[0], "x").await.unwrap());
    assert_counts(stats(&q).await, 1, 1, 2, 1);
    q.purge().await.unwrap();
    assert_eq!(stats(&q).await, Stats::default());
    assert!(claim(&q, 10, LONG).await.is_empty());
    assert!(!q.ack(&jobs[1]).await.unwrap());
    // Only the claim counter stays: claim numbers are never reused, so a
    // claim from before the purge cannot match a message pushed after it.
    let mut left: Vec<String> = raw(&conn, &["KEYS", "*"]).await;
    // (And the claims' records, for resends after a lost reply, until
    // they expire within 2 s.)
    left.retain(|k| k.contains("{rm}") && !k.contains(":claims:"));
    assert_eq!(left, [key("rm", "claims")], "purge left {left:?}");
    assert_counts(stats(&other).await, 1, 0, 0, 0);
    // And the queue works after a purge.
    q.push(9).await.unwrap();
    assert_eq!(*claim_one(&q, LONG).await, 9);
}

// ---------------------------------------------------------------------------
// Malformed records and other producers
// ---------------------------------------------------------------------------

#[tokio::test]
async fn malformed_records_are_buried_and_the_rest_is_delivered() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Email> = queue(conn.clone(), "q");
    q.push_with(email(1), PushOptions::new().id("good1"))
        .await
        .unwrap();
    // Written by hand: a payload that is not JSON, and a record without the
    // header. Score 0: due before everything else.
    let (data, schedule) = (key("q", "data"), key("q", "schedule"));
    let _: i64 = raw(&conn, &["HSET", &data, "bad", "123:0:0:not json"]).await;
    let _: i64 = raw(&conn, &["ZADD", &schedule, "0", "bad"]).await;
    let _: i64 = raw(&conn, &["HSET", &data, "bad2", "{}"]).await;
    let _: i64 = raw(&conn, &["ZADD", &schedule, "0", "bad2"]).await;
    // Valid JSON of the wrong shape.
    let _: i64 = raw(&conn, &["HSET", &data, "bad3", "5:1:0:{\"to\":1}"]).await;
    let _: i64 = raw(&conn, &["ZADD", &schedule, "1", "bad3"]).await;
    q.push_with(email(2), PushOptions::new().id("good2"))
        .await
        .unwrap();

    let claimed = q.claim(10, LONG).await.unwrap();
    assert_eq!(claimed.buried, 3, "{claimed:?}");
    let ids: Vec<&str> = claimed.jobs.iter().map(|j| j.id()).collect();
    assert_eq!(ids, ["good1", "good2"]);
    assert_eq!(*claimed.jobs[0], email(1));
    assert_eq!(*claimed.jobs[1], email(2));
    assert_counts(stats(&q).await, 0, 0, 2, 3);

    let dead: BTreeMap<String, _> = q
        .dead_letters(None, 100)
        .await
        .unwrap()
        .letters
        .into_iter()
        .map(|d| (d.id.clone(), d))
        .collect();
    assert_eq!(dead.keys().collect::<Vec<_>>(), ["bad", "bad2", "bad3"]);
    let error = |id: &str| dead[id].error.clone().unwrap_or_default().to_lowercase();
    assert!(error("bad").contains("decode"), "{:?}", dead["bad"]);
    assert_eq!(dead["bad"].payload, b"not json");
    assert!(dead["bad"].decode::<Email>().is_err());
    assert!(error("bad2").contains("malformed"), "{:?}", dead["bad2"]);
    assert_eq!(dead["bad2"].payload, b"{}");
    assert!(error("bad3").contains("decode"), "{:?}", dead["bad3"]);
    assert_eq!(dead["bad3"].failures, 1);

    // The queue keeps working.
    for job in &claimed.jobs {
        assert!(q.ack(job).await.unwrap());
    }
    q.push(email(3)).await.unwrap();
    assert_eq!(*claim_one(&q, LONG).await, email(3));
    // A fixed record can be re-driven.
    let _: i64 = raw(
        &conn,
        &["HSET", &data, "bad", "123:0:0:{\"to\":\"x\",\"n\":4}"],
    )
    .await;
    assert!(q.requeue_dead("bad").await.unwrap());
    let job = claim_one(&q, LONG).await;
    assert_eq!((job.id(), job.n), ("bad", 4));
}

/// The key layout of `src/queue/lua/prelude.lua` with plain Redis commands.
/// (Producers in other languages call `scripts/push.lua` instead, see
/// tests/integration/producer.rs: a hand-written HSETNX + ZADD puts an existing id back
/// on the schedule. This record is in the older three-counter form, which
/// must still be read.)
#[tokio::test]
async fn a_producer_in_another_language_can_enqueue_with_raw_commands() {
    let server = server();
    let q: Queue<Email> = queue(manager(&server).await, "polyglot");
    let mut waiter = q.waiter(server.client());
    drain(&mut waiter).await;

    // The foreign producer has a connection of its own.
    let foreign = manager(&server).await;
    let now = unix_ms(SystemTime::now());
    let record = format!("{now}:0:0:{{\"to\":\"ext@example.com\",\"n\":42}}");
    let added: i64 = raw(
        &foreign,
        &["HSETNX", "lockgate:{polyglot}:data", "ext-1", &record],
    )
    .await;
    assert_eq!(added, 1);
    let _: i64 = raw(
        &foreign,
        &[
            "ZADD",
            "lockgate:{polyglot}:schedule",
            &now.to_string(),
            "ext-1",
        ],
    )
    .await;
    let _: i64 = raw(&foreign, &["LPUSH", "lockgate:{polyglot}:bell", "1"]).await;

    let wake = timeout(BOUNDED, waiter.wait(Some(Instant::now() + secs(5))))
        .await
        .expect("bounded")
        .unwrap();
    assert_eq!(wake, Wake::Rung);
    let job = claim_one(&q, LONG).await;
    assert_eq!(job.id(), "ext-1");
    assert_eq!(
        *job,
        Email {
            to: "ext@example.com".into(),
            n: 42
        }
    );
    assert_eq!(job.attempt(), 1);
    assert_eq!(unix_ms(job.enqueued_at()), now);
    assert_eq!(unix_ms(job.due_at()), now);
    assert!(q.ack(&job).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
}

// ---------------------------------------------------------------------------
// Configuration and key names
// ---------------------------------------------------------------------------

#[tokio::test]
async fn bad_configuration_is_refused() {
    let server = server();
    let conn = manager(&server).await;
    assert!(matches!(
        Queue::<u64>::new(conn.clone(), ""),
        Err(Error::Config(_))
    ));
    let q: Queue<u64> = queue(conn.clone(), "cfg");
    assert!(matches!(q.clone().prefix(""), Err(Error::Config(_))));
    assert!(matches!(q.clone().prefix("a{b"), Err(Error::Config(_))));
    assert!(matches!(q.clone().prefix("a}b"), Err(Error::Config(_))));
    assert!(matches!(q.claim(0, LONG).await, Err(Error::Config(_))));
    assert!(matches!(
        q.claim(lockgate::queue::MAX_BATCH + 1, LONG).await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        q.claim(1, Duration::ZERO).await,
        Err(Error::Config(_))
    ));
    assert!(matches!(
        q.claim(1, Duration::from_micros(500)).await,
        Err(Error::Config(_))
    ));
    // Refused calls touched nothing; the boundaries themselves work.
    assert!(raw::<Vec<String>>(&conn, &["KEYS", "*"]).await.is_empty());
    assert!(q.claim(lockgate::queue::MAX_BATCH, LONG).await.is_ok());
    assert!(q.claim(1, ms(1)).await.is_ok());

    let prefixed = queue::<u64>(conn.clone(), "cfg")
        .prefix("app:jobs")
        .unwrap();
    assert_eq!(prefixed.name(), "cfg");
    prefixed.push(1).await.unwrap();
    let keys: Vec<String> = raw(&conn, &["KEYS", "*"]).await;
    assert!(keys.contains(&"app:jobs:{cfg}:data".to_owned()), "{keys:?}");
    assert_eq!(stats(&q).await, Stats::default(), "prefixes are separate");
}

#[tokio::test]
async fn every_key_of_a_queue_shares_one_hash_tag() {
    let server = server();
    let conn = manager(&server).await;
    let names = ["a}b", "a", "ü", "a{b", "}", "\\", "with space:and:colons"];
    for name in names {
        let q: Queue<u64> = queue(conn.clone(), name);
        assert_eq!(q.name(), name);
        // Populate all seven keys: data, schedule, bell (a push to an empty
        // schedule rings), claims and active (a held claim), dead and errors
        // (a buried message).
        q.push_many([1u64, 2]).await.unwrap();
        let jobs = claim(&q, 2, LONG).await;
        assert_eq!(jobs.len(), 2);
        assert!(q.bury(&jobs[0], "dead").await.unwrap());
        q.push_after(3, secs(60)).await.unwrap();
        assert_counts(stats(&q).await, 0, 1, 1, 1);
    }

    let mut keys: Vec<String> = raw(&conn, &["KEYS", "*"]).await;
    // Beside them only the prefix's list of queue names, no queue's key.
    let listed = keys.iter().position(|k| k == "lockgate:queues");
    keys.remove(listed.expect("the list of queue names"));
    // The claims' records (`<stem>:claims:<token>`, for a resend after a
    // lost reply; gone within 2 s) share their queue's tag too.
    let (records, _): (Vec<String>, Vec<String>) =
        keys.iter().cloned().partition(|k| k.contains(":claims:"));
    assert_eq!(records.len(), names.len(), "{records:?}");
    let tags: std::collections::HashSet<&str> = records.iter().map(|k| hash_tag(k)).collect();
    keys.retain(|k| !k.contains(":claims:"));
    let queue_tags: std::collections::HashSet<&str> = keys.iter().map(|k| hash_tag(k)).collect();
    assert_eq!(tags, queue_tags, "{records:?}");
    assert_eq!(keys.len(), names.len() * 7, "{keys:?}");
    let mut by_tag: HashMap<&str, Vec<&str>> = HashMap::new();
    for k in &keys {
        by_tag.entry(hash_tag(k)).or_default().push(k);
    }
    assert_eq!(
        by_tag.len(),
        names.len(),
        "queues share a hash tag: {by_tag:?}"
    );
    for (tag, keys) in &by_tag {
        assert_eq!(keys.len(), 7, "tag {tag:?}: {keys:?}");
        let mut suffixes: Vec<&str> = keys.iter().map(|k| k.rsplit(':').next().unwrap()).collect();
        suffixes.sort_unstable();
        assert_eq!(
            suffixes,
            [
                "active", "bell", "claims", "data", "dead", "errors", "schedule"
            ],
            "tag {tag:?}"
        );
    }
    // Plain names appear verbatim in the tag.
    for name in ["a", "ü"] {
        assert!(by_tag.contains_key(name), "{by_tag:?}");
    }

    // The queues are independent: purging one leaves the others.
    let q: Queue<u64> = queue(conn.clone(), "a}b");
    q.purge().await.unwrap();
    let mut keys: Vec<String> = raw(&conn, &["KEYS", "*"]).await;
    keys.retain(|k| !k.contains(":claims:") && k != "lockgate:queues");
    // All but the purged queue's claim counter are the others' keys.
    assert_eq!(keys.len(), (names.len() - 1) * 7 + 1);
    for name in names.iter().filter(|n| **n != "a}b") {
        assert_counts(stats(&queue::<u64>(conn.clone(), name)).await, 0, 1, 1, 1);
    }
}

// ---------------------------------------------------------------------------
// Waiter
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_wakes_on_a_push_from_another_connection() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "wake");
    let producer: Queue<u64> = queue(manager(&server).await, "wake");
    let mut waiter = q.waiter(server.client());
    drain(&mut waiter).await;

    let push = tokio::spawn(async move {
        sleep(ms(200)).await;
        producer.push(11).await.unwrap()
    });
    let start = Instant::now();
    let deadline = start + secs(5);
    let wake = timeout(BOUNDED, waiter.wait(Some(deadline)))
        .await
        .expect("bounded")
        .unwrap();
    assert_eq!(wake, Wake::Rung);
    assert!(Instant::now() < deadline, "woke only at the deadline");
    assert!(start.elapsed() >= ms(150), "woke before the push");
    let pushed = push.await.unwrap();
    let job = claim_one(&q, LONG).await;
    assert_eq!(job.id(), pushed.id);
    assert!(q.ack(&job).await.unwrap());

    // A push that is not earlier than the head does not ring; one that is
    // earlier does (a delayed head moved forward).
    q.push_after(1, secs(60)).await.unwrap();
    drain(&mut waiter).await;
    q.push_after(2, secs(120)).await.unwrap();
    let wake = waiter.wait(Some(Instant::now() + ms(300))).await.unwrap();
    assert_eq!(wake, Wake::Deadline, "a later message rang the bell");
    q.push(3).await.unwrap();
    let wake = waiter.wait(Some(Instant::now() + secs(5))).await.unwrap();
    assert_eq!(wake, Wake::Rung);
}

#[tokio::test]
async fn waiter_returns_at_its_deadline_when_nothing_is_pushed() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "quiet");
    let mut waiter = q.waiter(server.client());
    for wait in [ms(300), ms(50)] {
        let start = Instant::now();
        let wake = timeout(BOUNDED, waiter.wait(Some(start + wait)))
            .await
            .expect("bounded")
            .unwrap();
        assert_eq!(wake, Wake::Deadline);
        let elapsed = start.elapsed();
        assert!(elapsed >= wait, "returned early: {elapsed:?}");
        assert!(elapsed < wait + secs(1), "late: {elapsed:?}");
    }
    // A deadline in the past returns at once.
    let wake = waiter.wait(Some(Instant::now() - ms(1))).await.unwrap();
    assert_eq!(wake, Wake::Deadline);
}

/// A worker's loop: claim; when nothing is due, wait for the bell or the
/// next due time. A delayed message pushed while the worker sleeps on an
/// empty queue is delivered once due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_worker_gets_a_delayed_message_once_due() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "worker");
    let producer: Queue<u64> = queue(manager(&server).await, "worker");
    let mut waiter = q.waiter(server.client());
    drain(&mut waiter).await;

    let pushed_at = Arc::new(std::sync::Mutex::new(None));
    let push = {
        let pushed_at = pushed_at.clone();
        tokio::spawn(async move {
            sleep(ms(100)).await;
            *pushed_at.lock().unwrap() = Some(Instant::now());
            producer.push_after(5, ms(300)).await.unwrap()
        })
    };
    let give_up = Instant::now() + secs(5);
    let (mut rings, mut claims) = (0, 0);
    let job = loop {
        assert!(Instant::now() < give_up, "the message never arrived");
        let claimed = q.claim(10, LONG).await.unwrap();
        claims += 1;
        if let Some(job) = claimed.jobs.into_iter().next() {
            break job;
        }
        let deadline = match claimed.next_due {
            Some(d) => Instant::now() + d,
            None => give_up,
        };
        if timeout(BOUNDED, waiter.wait(Some(deadline.min(give_up))))
            .await
            .expect("bounded")
            .unwrap()
            == Wake::Rung
        {
            rings += 1;
        }
    };
    let pushed = push.await.unwrap();
    assert_eq!(job.id(), pushed.id);
    let pushed_at = pushed_at.lock().unwrap().unwrap();
    assert!(pushed_at.elapsed() >= ms(300), "delivered early");
    assert_eq!(rings, 1, "one ring for the push to an empty schedule");
    assert!(claims <= 5, "the worker polled: {claims} claims");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_survives_the_server_closing_idle_connections() {
    let server = RedisServer::builder()
        .arg("--timeout")
        .arg("1")
        .start()
        .expect("redis-server with --timeout 1");
    let q: Queue<u64> = queue(manager(&server).await, "idle");
    let producer: Queue<u64> = queue(manager(&server).await, "idle");
    let mut waiter = q.waiter(server.client());
    drain(&mut waiter).await;

    // Blocked across the idle timeout (and across a server-side block that
    // ran out): a blocked client is not idle.
    let start = Instant::now();
    let wake = timeout(BOUNDED, waiter.wait(Some(start + ms(2500))))
        .await
        .expect("bounded")
        .expect("a blocked waiter must not lose its connection");
    assert_eq!(wake, Wake::Deadline);
    push_retrying(&producer, 1, "one").await;
    let errors = wait_for_ring(&mut waiter, "after a long block").await;
    assert_eq!(errors, 0, "the waiter was blocked the whole time");
    let job = claim_retrying(&q).await.pop().expect("the pushed message");
    assert!(q.ack(&job).await.unwrap());

    // Idle between two waits (as while a worker processes a job): the server
    // closes the waiter's connection.
    sleep(ms(2500)).await;
    push_retrying(&producer, 2, "two").await;
    wait_for_ring(&mut waiter, "after an idle gap").await;
    let job = claim_retrying(&q).await.pop().expect("the pushed message");
    assert_eq!(job.id(), "two");
    assert!(q.ack(&job).await.unwrap());

    // And it keeps working.
    drain(&mut waiter).await;
    push_retrying(&producer, 3, "three").await;
    assert_eq!(wait_for_ring(&mut waiter, "afterwards").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_survives_client_kill() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "kill");
    let producer: Queue<u64> = queue(manager(&server).await, "kill");
    let admin = server.multiplexed().await.unwrap();
    let mut waiter = q.waiter(server.client());
    drain(&mut waiter).await;

    // Killed while blocked.
    let killed: i64 = raw(&admin, &["CLIENT", "KILL", "TYPE", "normal"]).await;
    assert!(killed >= 3, "killed {killed} clients");
    // At most one error; then it waits normally again.
    let mut errors = 0;
    loop {
        match timeout(BOUNDED, waiter.wait(Some(Instant::now() + ms(300))))
            .await
            .expect("bounded")
        {
            Ok(Wake::Deadline) => break,
            Ok(other) => panic!("nothing was pushed, got {other:?}"),
            Err(e) => {
                errors += 1;
                assert!(errors <= 1, "wait failed twice: {e}");
            }
        }
    }
    push_retrying(&producer, 1, "one").await;
    let more = wait_for_ring(&mut waiter, "after a kill while blocked").await;
    assert!(errors + more <= 1);
    let job = claim_retrying(&q).await.pop().expect("the pushed message");
    assert!(q.ack(&job).await.unwrap());

    // Killed while not blocked (between waits).
    raw::<i64>(&admin, &["CLIENT", "KILL", "TYPE", "normal"]).await;
    push_retrying(&producer, 2, "two").await;
    wait_for_ring(&mut waiter, "after a kill between waits").await;
    let job = claim_retrying(&q).await.pop().expect("the pushed message");
    assert_eq!(job.id(), "two");
    assert!(q.ack(&job).await.unwrap());
}

// ---------------------------------------------------------------------------
// Stale claims never act on a message re-pushed under the same id
// ---------------------------------------------------------------------------

/// `remove` refuses a message being processed: deleting it under its worker
/// would let that worker's claim act on a later message with the same id.
#[tokio::test]
async fn removing_an_active_message_is_refused() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "repush");
    q.push_with(1, PushOptions::new().id("x")).await.unwrap();
    let old = claim_one(&q, LONG).await;
    assert!(
        !q.remove("x").await.unwrap(),
        "an active message was removed"
    );
    let again = q.push_with(2, PushOptions::new().id("x")).await.unwrap();
    assert!(
        !again.created,
        "the active message is still there: a duplicate id"
    );
    assert!(q.ack(&old).await.unwrap());
    assert_eq!(stats(&q).await, Stats::default());
}

/// After `purge`, claims of the purged queue are refused: none of them can
/// ack, bury or recover a message pushed afterwards under the same id.
#[tokio::test]
async fn claims_from_before_a_purge_cannot_touch_new_messages() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "purged");
    q.push_with(1, PushOptions::new().id("x")).await.unwrap();
    let old = claim_one(&q, ms(20)).await;
    q.purge().await.unwrap();
    q.push_with(2, PushOptions::new().id("x")).await.unwrap();
    assert!(!q.ack(&old).await.unwrap());
    assert!(!q.bury(&old, "too late").await.unwrap());
    sleep(ms(60)).await;
    assert_eq!(q.recover(1).await.unwrap(), Default::default());
    assert!(q.dead_letters(None, 100).await.unwrap().letters.is_empty());
    let job = claim_one(&q, LONG).await;
    assert_eq!(*job, 2);
}

/// `recover` keeps looping while a batch came back full, even when some of
/// the expired leases had no record left (deleted by hand): none is left
/// behind.
#[tokio::test]
async fn recover_handles_every_expired_lease_even_when_records_vanished() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "recover-all");
    q.push_many(0..1001u64).await.unwrap();
    let first = claim(&q, 1000, ms(20)).await;
    let second = claim(&q, 1000, ms(20)).await;
    assert_eq!((first.len(), second.len()), (1000, 1));
    raw::<i64>(
        q.connection(),
        &["HDEL", &key("recover-all", "data"), first[0].id()],
    )
    .await;
    sleep(ms(60)).await;
    let r = q.recover(5).await.unwrap();
    assert_eq!(r.requeued, 1000);
    assert_counts(stats(&q).await, 1000, 0, 0, 0);
}

/// A waiter that returned on its deadline (its worker now busy) must not
/// keep a `BLPOP` blocked: Redis would hand the next ring to it, the longest
/// blocked client, instead of to the idle waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_waiter_does_not_take_the_ring_from_an_idle_one() {
    let server = server();
    let q: Queue<u64> = queue(manager(&server).await, "two-waiters");
    let mut busy = q.waiter(server.client());
    let mut idle = q.waiter(server.client());
    // Drain any stale ring, then let `busy` time out: its worker goes to work.
    let soon = || Some(tokio::time::Instant::now() + ms(50));
    while busy.wait(soon()).await.unwrap() == Wake::Rung {}
    assert_eq!(busy.wait(soon()).await.unwrap(), Wake::Deadline);
    let producer = q.clone();
    tokio::spawn(async move {
        sleep(ms(200)).await;
        producer.push(1).await.unwrap();
    });
    let started = std::time::Instant::now();
    let woken = idle
        .wait(Some(tokio::time::Instant::now() + secs(3)))
        .await
        .unwrap();
    assert_eq!(woken, Wake::Rung, "the idle waiter slept through the push");
    assert!(started.elapsed() < secs(2));
}
