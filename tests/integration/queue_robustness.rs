//! Queue robustness against real, private `redis-server` processes: claim
//! numbers that never repeat after a rollback, lease expiries counted apart
//! from handler failures, push arguments validated before any write, and
//! bounded work (dead-letter paging, retention, chunked lease renewal,
//! a re-drive that ends while poison letters are re-buried).

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lockgate::testing::RedisServer;
use lockgate::{PushOptions, Queue};
use redis::aio::ConnectionManager;
use support::{BOUNDED, manager, ms, raw, secs, server, stats};
use tokio::time::{sleep, timeout};

/// A lease that never runs out during a test.
const LONG: Duration = secs(60);

fn queue(conn: ConnectionManager, name: &str) -> Queue<u64> {
    Queue::new(conn, name).expect("valid queue name")
}

fn key(name: &str, part: &str) -> String {
    format!("lockgate:{{{name}}}:{part}")
}

async fn claim_one(q: &Queue<u64>, lease: Duration) -> lockgate::Job<u64> {
    let mut claimed = q.claim(10, lease).await.expect("claim");
    assert_eq!(claimed.buried, 0);
    assert_eq!(claimed.jobs.len(), 1, "expected exactly one job");
    claimed.jobs.pop().unwrap()
}

/// `INFO commandstats` calls of one command since the server started.
async fn calls(conn: &ConnectionManager, command: &str) -> u64 {
    let info: String = raw(conn, &["INFO", "commandstats"]).await;
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .map(|rest| rest.split(',').next().unwrap().parse().unwrap())
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Item 2: claim numbers never repeat, also after the server rolled back
// ---------------------------------------------------------------------------

/// Worker A claims a message after the last snapshot; the server dies and
/// comes back from that snapshot, so the message is scheduled again and the
/// claim counter is older. Worker B's claim must differ from A's, so that A
/// can no longer ack, retry or bury what B now holds.
#[tokio::test]
async fn claim_numbers_never_repeat_after_a_restart_from_an_older_snapshot() {
    let mut server: RedisServer = server();
    let q = queue(manager(&server).await, "rollback");
    q.push_with(7, PushOptions::new().id("m")).await.unwrap();
    q.push_with(8, PushOptions::new().id("n")).await.unwrap();
    let _: String = raw(q.connection(), &["SAVE"]).await;
    let mut a = q.claim(10, LONG).await.unwrap().jobs;
    assert_eq!(a.len(), 2);

    server.stop();
    server.restart().unwrap();
    let q = queue(manager(&server).await, "rollback");
    let b = q.claim(10, LONG).await.unwrap().jobs;
    assert_eq!(b.len(), 2, "the snapshot had both messages scheduled");
    for (a, b) in a.iter().zip(&b) {
        assert_eq!(a.id(), b.id());
        assert_ne!(a.claim(), b.claim(), "a claim number was handed out twice");
    }

    // A's claims are stale: every operation is refused and changes nothing.
    let a_m = a.remove(0);
    let a_n = a.remove(0);
    assert!(!q.ack(&a_m).await.unwrap(), "stale ack accepted");
    assert_eq!(q.retry(&a_n, Duration::ZERO, "x").await.unwrap(), None);
    assert!(!q.bury(&a_m, "x").await.unwrap());
    let s = stats(&q).await;
    assert_eq!((s.due, s.active, s.dead), (0, 2, 0));

    // B's are not.
    assert!(q.ack(&b[0]).await.unwrap());
    assert!(q.bury(&b[1], "b buries").await.unwrap());
    let s = stats(&q).await;
    assert_eq!((s.due, s.active, s.dead), (0, 0, 1));
}

// ---------------------------------------------------------------------------
// Item 12: lease expiries are counted apart from handler failures
// ---------------------------------------------------------------------------

/// A claimed message whose handler never started (its worker died with it
/// in the prefetch buffer) comes back as the same attempt.
#[tokio::test]
async fn a_lease_expiry_is_not_a_failed_attempt() {
    let server = server();
    let q = queue(manager(&server).await, "stall");
    q.push(1).await.unwrap();
    let job = claim_one(&q, ms(20)).await;
    assert_eq!(job.attempt(), 1);
    sleep(ms(60)).await;
    let r = q.recover(3).await.unwrap();
    assert_eq!((r.requeued, r.buried), (1, 0));
    let again = claim_one(&q, LONG).await;
    assert_eq!(
        again.attempt(),
        1,
        "a stall was charged as a failed attempt"
    );
    assert_eq!(again.stalls(), 1);
    // A handler failure still counts as one.
    q.retry(&again, Duration::ZERO, "handler failed")
        .await
        .unwrap()
        .unwrap();
    let third = claim_one(&q, LONG).await;
    assert_eq!((third.attempt(), third.stalls()), (2, 1));
    assert!(q.ack(&third).await.unwrap());
    let s = stats(&q).await;
    assert_eq!((s.due, s.later, s.active, s.dead), (0, 0, 0, 0));
    // Nothing is left behind: no record, no error entry.
    let left: i64 = raw(q.connection(), &["EXISTS", &key("stall", "errors")]).await;
    assert_eq!(left, 0, "the stall's error entry outlived the message");
}

/// A message that kills its worker every time still ends as a dead letter,
/// after `max_stalls` lease expiries, and the letter says which limit it hit.
#[tokio::test]
async fn a_message_that_kills_its_worker_every_time_is_buried_after_max_stalls() {
    let server = server();
    let q = queue(manager(&server).await, "poison");
    let id = q.push(5).await.unwrap().id;
    for round in 1..=3 {
        let job = claim_one(&q, ms(20)).await;
        assert_eq!(job.attempt(), 1);
        sleep(ms(60)).await;
        let r = q.recover(3).await.unwrap();
        let expected = if round < 3 { (1, 0) } else { (0, 1) };
        assert_eq!((r.requeued, r.buried), expected, "round {round}");
    }
    let s = stats(&q).await;
    assert_eq!((s.due, s.active, s.dead), (0, 0, 1));
    let dead = q.dead_letters(None, 10).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    let letter = &dead[0];
    assert_eq!(letter.id, id);
    assert_eq!((letter.failures, letter.stalls), (0, 3));
    let error = letter.error.as_deref().unwrap();
    assert!(
        error.starts_with("lease expired 3 times (limit 3): "),
        "{error}"
    );
    assert_eq!(letter.decode::<u64>().unwrap(), 5);
}

/// Records written before the stall counter existed
/// (`<enqueued>:<failures>:<deferrals>:<payload>`) are still read, and are
/// rewritten in the four-counter form by the next state change. A JSON
/// payload never starts with `<digits>:`, so the forms cannot be confused,
/// even for a payload that is a bare number.
#[tokio::test]
async fn records_in_the_three_counter_form_are_still_read() {
    let server = server();
    let q = queue(manager(&server).await, "old-form");
    let conn = q.connection().clone();
    let record = "1700000000000:2:1:12";
    let _: i64 = raw(&conn, &["HSET", &key("old-form", "data"), "old", record]).await;
    let _: i64 = raw(&conn, &["ZADD", &key("old-form", "schedule"), "0", "old"]).await;
    let job = claim_one(&q, ms(20)).await;
    assert_eq!(
        (*job, job.attempt(), job.deferrals(), job.stalls()),
        (12, 3, 1, 0)
    );
    sleep(ms(60)).await;
    assert_eq!(q.recover(3).await.unwrap().requeued, 1);
    let rewritten: String = raw(&conn, &["HGET", &key("old-form", "data"), "old"]).await;
    assert_eq!(rewritten, "1700000000000:2:1:1:12");
    let job = claim_one(&q, LONG).await;
    assert_eq!(
        (*job, job.attempt(), job.deferrals(), job.stalls()),
        (12, 3, 1, 1)
    );
}

// ---------------------------------------------------------------------------
// Item 16: push validates every argument before its first write
// ---------------------------------------------------------------------------

/// The push script as a producer in another language loads it.
const PUSH_LUA: &str = include_str!("../../scripts/push.lua");

/// EVALs the push script the way another producer would.
async fn eval_push(
    conn: &ConnectionManager,
    name: &str,
    argv: &[&str],
) -> redis::RedisResult<redis::Value> {
    redis::cmd("EVAL")
        .arg(PUSH_LUA)
        .arg(3)
        .arg(key(name, "data"))
        .arg(key(name, "schedule"))
        .arg(key(name, "bell"))
        .arg(argv)
        .query_async(&mut conn.clone())
        .await
}

#[tokio::test]
async fn push_rejects_bad_arguments_before_any_write() {
    let server = server();
    let conn = manager(&server).await;
    let bad: [&[&str]; 15] = [
        &["a", "5s", "1"],
        &["a", "@", "1"],
        &["a", "@5s", "1"],
        &["a", "", "1"],
        &["", "0", "1"],
        &["a", "0"],
        &["a", "nan", "1"],
        // Forms tonumber would take, but no whole number of ms: a fraction
        // would be a score between milliseconds, 1e300 a message never due.
        &["a", "1.5", "1"],
        &["a", " 5", "1"],
        &["a", "0x10", "1"],
        &["a", "1e3", "1"],
        &["a", "@1e300", "1"],
        &["a", "@1234567890123456", "1"],
        // An absolute time before 1970 would read as "not scheduled" (-1).
        &["a", "@-1", "1"],
        // A good message first: nothing at all is written either.
        &["good", "0", "1", "b", "5s", "2"],
    ];
    for argv in bad {
        let err = eval_push(&conn, "bad", argv)
            .await
            .expect_err(&format!("{argv:?} was accepted"));
        let text = err.to_string();
        assert!(
            text.contains("lockgate push"),
            "{argv:?}: unclear error {text}"
        );
        for part in ["data", "schedule", "bell"] {
            let n: i64 = raw(&conn, &["EXISTS", &key("bad", part)]).await;
            assert_eq!(n, 0, "{argv:?} left `{part}` behind");
        }
    }
    // The same script takes good arguments.
    let ok = eval_push(
        &conn,
        "bad",
        &["a", "0", "1", "b", "@0", "2", "c", "-5", "3"],
    )
    .await
    .unwrap();
    assert!(
        matches!(ok, redis::Value::Array(ref v) if v.len() == 6),
        "{ok:?}"
    );
    // A fresh record is in the three-counter form lockgate 0.1 reads, so
    // old and new workers can share a queue during an upgrade.
    let record: String = raw(&conn, &["HGET", &key("bad", "data"), "a"]).await;
    let header: Vec<&str> = record.splitn(4, ':').collect();
    assert_eq!(&header[1..], ["0", "0", "1"], "{record}");
    let q = queue(conn, "bad");
    assert_eq!(stats(&q).await.due, 3);
}

/// Found by the producer script's model (`tests/model/push.rs`), each
/// shrunk to one call: an id that is not UTF-8 was stored (then `peek`
/// failed for the whole queue, and a claim skipped the message and left it
/// leased); a delay reaching back before 1970 was answered with a negative
/// due time, which reads as "not scheduled" (-1 exactly is that marker); a
/// due time from the year 2286 on was stored, beyond what a priority's
/// score holds; a payload starting with digits and a colon (not JSON) was
/// read back as a stall count and the rest.
#[tokio::test]
async fn push_refuses_what_its_readers_would_misread() {
    let server = server();
    let conn = manager(&server).await;
    let not_utf8 = redis::cmd("EVAL")
        .arg(PUSH_LUA)
        .arg(3)
        .arg(key("odd", "data"))
        .arg(key("odd", "schedule"))
        .arg(key("odd", "bell"))
        .arg(&[128u8][..])
        .arg("0")
        .arg("1")
        .query_async::<redis::Value>(&mut conn.clone())
        .await;
    let err = not_utf8.expect_err("an id that is not UTF-8 was accepted");
    assert!(err.to_string().contains("lockgate push"), "{err}");
    for when in ["10000000000000", "@10000000000000", "9999999999999"] {
        let err = eval_push(&conn, "odd", &["m0", when, "1"]).await;
        let err = err.expect_err(&format!("due time {when} was accepted"));
        assert!(err.to_string().contains("lockgate push"), "{when}: {err}");
    }
    // Not JSON, and read as a stall count then an empty payload.
    let err = eval_push(&conn, "odd", &["m0", "0", "0:"]).await;
    let err = err.expect_err("the payload `0:` was accepted");
    assert!(err.to_string().contains("lockgate push"), "{err}");
    let n: i64 = raw(&conn, &["EXISTS", &key("odd", "data")]).await;
    assert_eq!(n, 0, "a refused push wrote");
    // Before 1970 is due at 0, the earliest time there is.
    let reply = eval_push(&conn, "early", &["m0", "-2000000000000", "1"]).await;
    assert_eq!(
        reply.unwrap(),
        redis::Value::Array(vec![redis::Value::Int(1), redis::Value::Int(0)])
    );
    let q: Queue<u32> = Queue::new(conn.clone(), "early").unwrap();
    let peek = q.peek(10).await.unwrap();
    assert_eq!(peek.waiting[0].at, std::time::UNIX_EPOCH);
    assert_eq!(stats(&q).await.due, 1);
}

// ---------------------------------------------------------------------------
// Item 17: bounded work
// ---------------------------------------------------------------------------

/// `requeue_all_dead` re-drives the letters that were dead when it started:
/// it ends even while every re-driven letter is buried again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requeue_all_dead_ends_while_letters_are_reburied() {
    const LETTERS: u64 = 3_000;
    let server = server();
    let q = queue(manager(&server).await, "poison-loop");
    q.push_many(0..LETTERS).await.unwrap();
    loop {
        let jobs = q.claim(1000, LONG).await.unwrap().jobs;
        if jobs.is_empty() {
            break;
        }
        for job in &jobs {
            assert!(q.bury(job, "poison").await.unwrap());
        }
    }
    assert_eq!(stats(&q).await.dead, LETTERS);

    // Workers that bury every message as soon as it is due, as a poison
    // message makes them do (one script: claim and bury at once).
    let stop = Arc::new(AtomicBool::new(false));
    let reburied = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reburier = {
        let conn = manager(&server).await;
        let (stop, reburied) = (stop.clone(), reburied.clone());
        tokio::spawn(async move {
            let script = redis::Script::new(
                "local t = redis.call('TIME')
                 local now = t[1] * 1000 + math.floor(t[2] / 1000)
                 local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 1000)
                 for _, id in ipairs(due) do
                   redis.call('ZREM', KEYS[1], id)
                   redis.call('ZADD', KEYS[2], now, id)
                 end
                 return #due",
            );
            while !stop.load(Ordering::Relaxed) {
                let n: u64 = script
                    .key(key("poison-loop", "schedule"))
                    .key(key("poison-loop", "dead"))
                    .invoke_async(&mut conn.clone())
                    .await
                    .unwrap();
                reburied.fetch_add(n, Ordering::Relaxed);
                if n == 0 {
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    let requeued = timeout(BOUNDED, q.requeue_all_dead()).await;
    // The re-burier takes part (whatever was re-driven last is due): wait
    // for it before stopping it, so the check below cannot race it.
    let deadline = tokio::time::Instant::now() + BOUNDED;
    while reburied.load(Ordering::Relaxed) == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    reburier.await.unwrap();
    let requeued = requeued
        .expect("requeue_all_dead did not end while letters were re-buried")
        .unwrap();
    assert!(requeued >= LETTERS as usize, "{requeued}");
    assert!(
        reburied.load(Ordering::Relaxed) > 0,
        "the re-burier never ran"
    );
}

/// Dead letters are listed a page at a time, at most `MAX_BATCH` per call.
#[tokio::test]
async fn dead_letters_are_paged() {
    let server = server();
    let q = queue(manager(&server).await, "pages");
    let max = lockgate::queue::MAX_BATCH;
    q.push_many(0..(max as u64 + 5)).await.unwrap();
    loop {
        let jobs = q.claim(max, LONG).await.unwrap().jobs;
        if jobs.is_empty() {
            break;
        }
        for job in &jobs {
            assert!(q.bury(job, "x").await.unwrap());
        }
    }
    let page = q.dead_letters(None, max).await.unwrap();
    let first = page.letters;
    assert_eq!(first.len(), max);
    let page = q.dead_letters(page.next.as_ref(), max).await.unwrap();
    assert_eq!(page.next, None, "the last page");
    let second = page.letters;
    assert_eq!(second.len(), 5);
    let mut all: Vec<u64> = first
        .iter()
        .chain(&second)
        .map(|d| d.decode::<u64>().unwrap())
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..(max as u64 + 5)).collect::<Vec<_>>());
    assert!(q.dead_letters(None, 0).await.unwrap().letters.is_empty());
    assert!(
        q.dead_letters(None, max + 1).await.is_err(),
        "more than MAX_BATCH"
    );
}

/// `extend` renews any number of leases, at most `MAX_BATCH` per script call.
#[tokio::test]
async fn extend_is_chunked() {
    let server = server();
    let q = queue(manager(&server).await, "extend-many");
    let max = lockgate::queue::MAX_BATCH;
    q.push_many(0..(2 * max as u64 + 1)).await.unwrap();
    let mut jobs = Vec::new();
    loop {
        let batch = q.claim(max, LONG).await.unwrap().jobs;
        if batch.is_empty() {
            break;
        }
        jobs.extend(batch);
    }
    assert_eq!(jobs.len(), 2 * max + 1);
    // Loads the script first, so that the count below is of calls alone.
    assert_eq!(q.extend(&jobs[..1], LONG).await.unwrap(), [true]);
    let before = calls(q.connection(), "evalsha").await + calls(q.connection(), "eval").await;
    let held = q.extend(&jobs, LONG).await.unwrap();
    let after = calls(q.connection(), "evalsha").await + calls(q.connection(), "eval").await;
    assert_eq!(held.len(), jobs.len());
    assert!(held.iter().all(|h| *h));
    assert_eq!(after - before, 3, "one script call per MAX_BATCH leases");
}

/// `purge` frees memory in the background (`UNLINK`), never with a `DEL`
/// that blocks the server on a large queue.
#[tokio::test]
async fn purge_unlinks() {
    let server = server();
    let q = queue(manager(&server).await, "purge-unlink");
    q.push_many(0..10u64).await.unwrap();
    let del = calls(q.connection(), "del").await;
    q.purge().await.unwrap();
    assert_eq!(calls(q.connection(), "del").await, del);
    assert!(calls(q.connection(), "unlink").await >= 1);
    assert_eq!(stats(&q).await.due, 0);
}

/// Retention: burying trims the dead letters to a count and an age, and the
/// trimmed letters' records and errors go with them.
#[tokio::test]
async fn dead_letter_retention_trims_by_count_and_age() {
    let server = server();
    let conn = manager(&server).await;
    let q = queue(conn.clone(), "retain").dead_retention(Some(3), None);
    q.push_many(0..5u64).await.unwrap();
    for job in q.claim(10, LONG).await.unwrap().jobs {
        assert!(q.bury(&job, "x").await.unwrap());
    }
    let dead = q.dead_letters(None, 10).await.unwrap().letters;
    let kept: Vec<u64> = dead.iter().map(|d| d.decode().unwrap()).collect();
    assert_eq!(kept, [2, 3, 4], "the newest three are kept");
    let records: i64 = raw(&conn, &["HLEN", &key("retain", "data")]).await;
    let errors: i64 = raw(&conn, &["HLEN", &key("retain", "errors")]).await;
    assert_eq!(
        (records, errors),
        (3, 3),
        "trimmed letters left data behind"
    );

    // By age, through recover's burials too.
    let q = queue(conn.clone(), "retain-age").dead_retention(None, Some(ms(100)));
    q.push_many(0..3u64).await.unwrap();
    for job in q.claim(10, LONG).await.unwrap().jobs {
        assert!(q.bury(&job, "x").await.unwrap());
    }
    sleep(ms(150)).await;
    q.push(9).await.unwrap();
    claim_one(&q, ms(10)).await;
    sleep(ms(40)).await;
    assert_eq!(q.recover(1).await.unwrap().buried, 1);
    let dead = q.dead_letters(None, 10).await.unwrap().letters;
    let kept: Vec<u64> = dead.iter().map(|d| d.decode().unwrap()).collect();
    assert_eq!(kept, [9], "letters older than the retention age are gone");
    let records: i64 = raw(&conn, &["HLEN", &key("retain-age", "data")]).await;
    assert_eq!(records, 1);
}

/// The worker passes its `max_stalls` to `recover`: a message whose holders
/// all died (simulated: claimed under a short lease and never settled) is
/// buried by a live worker after `max_stalls` expiries, never handled, and
/// never charged a failed attempt.
#[tokio::test]
async fn the_worker_buries_after_max_stalls() {
    use tower::service_fn;
    let server = server();
    let q = queue(manager(&server).await, "worker-stalls");
    q.push(3).await.unwrap();
    // Two workers died holding it.
    for _ in 0..2 {
        claim_one(&q, ms(20)).await;
        sleep(ms(40)).await;
        assert_eq!(q.recover(10).await.unwrap().requeued, 1);
    }
    // The third dies too; a live worker with max_stalls(3) recovers it.
    claim_one(&q, ms(20)).await;
    let handled = Arc::new(AtomicBool::new(false));
    let flag = handled.clone();
    let service = service_fn(move |_job: lockgate::Job<u64>| {
        flag.store(true, Ordering::SeqCst);
        async { Ok::<_, std::convert::Infallible>(()) }
    });
    assert!(
        lockgate::Worker::new(server.client(), q.clone(), service.clone())
            .max_stalls(0)
            .is_err()
    );
    let worker = lockgate::Worker::new(server.client(), q.clone(), service)
        .lease(ms(150))
        .unwrap()
        .max_stalls(3)
        .unwrap();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    support::eventually("the worker buries the message", BOUNDED, async || {
        let s = stats(&q).await;
        support::done_if(s.dead == 1, s)
    })
    .await;
    let _ = stop_tx.send(());
    run.await.unwrap().unwrap();
    assert!(!handled.load(Ordering::SeqCst), "a dead letter was handled");
    let letter = q.dead_letters(None, 1).await.unwrap().letters.remove(0);
    assert_eq!((letter.failures, letter.stalls), (0, 3));
    assert!(
        letter
            .error
            .as_deref()
            .unwrap()
            .starts_with("lease expired 3 times (limit 3)"),
        "{letter:?}"
    );
}
