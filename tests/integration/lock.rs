//! Integration tests for `lockgate::Locker` against real, private
//! `redis-server` processes (one per test, started through
//! `lockgate::testing::RedisServer`). The tests check behaviour and
//! invariants (mutual exclusion, token-checked release, fencing order, error
//! kinds), never timings, and keep TTLs short so that the suite is quick.

use crate::support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use lockgate::{Acquisition, Error, Locker};
use redis::aio::{ConnectionLike, ConnectionManager};
use support::{
    BOUNDED, acquired, done_if, eventually, hash_tag, held, impatient_manager, locker, manager, ms,
    raw, secs, server,
};
use tokio::time::{Instant, sleep, timeout};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

async fn assert_contended<C>(locker: &Locker<C>, key: &str, ttl: Duration)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match locker.acquire(key).await.expect("acquire") {
        Acquisition::Acquired(lease) => panic!("{key:?} acquired twice: {lease:?}"),
        Acquisition::Contended(c) => {
            assert_eq!(c.key(), key);
            assert!(c.retry_after() <= ttl, "{c}");
        }
    }
}

/// What a held lock's key stores: `<token>`, and `:<fence>` once issued.
fn value(lease: &lockgate::Lease) -> String {
    match lease.issued_fence() {
        Some(fence) => format!("{}:{fence}", lease.token()),
        None => lease.token().to_owned(),
    }
}

async fn get(conn: &ConnectionManager, key: &str) -> Option<String> {
    raw(conn, &["GET", key]).await
}

// ---------------------------------------------------------------------------
// Mutual exclusion
// ---------------------------------------------------------------------------

/// One successful hold: (fence, start, end) as seen by the holder.
type Hold = (u64, Instant, Instant);

async fn contend<C>(
    locker: Locker<C>,
    task: usize,
    keys: &'static [&'static str],
    iterations: usize,
    holds: Arc<Mutex<HashMap<&'static str, Vec<Hold>>>>,
) where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    for i in 0..iterations {
        let key = keys[(task + i) % keys.len()];
        match locker.acquire(key).await.expect("acquire") {
            Acquisition::Acquired(lease) => {
                let start = Instant::now();
                let fence = locker.fence(&lease).await.expect("fence");
                sleep(ms(1 + (i % 2) as u64)).await;
                let end = Instant::now();
                assert!(
                    locker.release(&lease).await.expect("release"),
                    "lease on {key:?} expired while held; the TTL is too short for this test"
                );
                holds
                    .lock()
                    .unwrap()
                    .entry(key)
                    .or_default()
                    .push((fence, start, end));
            }
            Acquisition::Contended(c) => {
                assert_eq!(c.key(), key);
                // Back off briefly, so that attempts spread over the holds.
                sleep(ms(1)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn holds_of_one_key_never_overlap() {
    static KEYS: &[&str] = &["alpha", "beta", "gamma"];
    const TASKS: usize = 16;
    const ITERATIONS: usize = 40;
    let server = server();
    // Two lockers on two separate connections of two kinds.
    let ttl = secs(2);
    let by_manager = locker(manager(&server).await, ttl);
    let by_multiplexed = locker(server.multiplexed().await.unwrap(), ttl);
    let holds = Arc::new(Mutex::new(HashMap::new()));

    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let holds = holds.clone();
        tasks.push(if task % 2 == 0 {
            tokio::spawn(contend(by_manager.clone(), task, KEYS, ITERATIONS, holds))
        } else {
            tokio::spawn(contend(
                by_multiplexed.clone(),
                task,
                KEYS,
                ITERATIONS,
                holds,
            ))
        });
    }
    for task in tasks {
        task.await.expect("contending task panicked");
    }

    let holds = holds.lock().unwrap();
    for key in KEYS {
        let mut intervals = holds.get(key).cloned().unwrap_or_default();
        assert!(!intervals.is_empty(), "no task ever acquired {key:?}");
        intervals.sort_by_key(|&(_, start, _)| start);
        for pair in intervals.windows(2) {
            let (fence_a, start_a, end_a) = pair[0];
            let (fence_b, start_b, _) = pair[1];
            assert!(
                end_a < start_b,
                "two holds of {key:?} overlap: {start_a:?}..{end_a:?} and from {start_b:?}"
            );
            assert!(
                fence_a < fence_b,
                "fences of {key:?} do not follow the order of the holds: {fence_a} then {fence_b}"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// Expiry and stale holders
// ---------------------------------------------------------------------------

#[tokio::test]
async fn expired_lock_passes_to_next_holder_and_stale_holder_cannot_touch_it() {
    let server = server();
    let ttl = ms(100);
    let conn = manager(&server).await;
    let first = locker(conn.clone(), ttl);
    let second = locker(server.multiplexed().await.unwrap(), secs(5));
    let key = "expiring";

    let mut stale = acquired(&first, key).await;
    let stale_fence = first.fence(&stale).await.unwrap();
    // While it lives, nobody else gets it.
    assert_contended(&second, key, ttl).await;

    // Not extended: after its TTL the next holder gets it.
    let deadline = Instant::now() + BOUNDED;
    let fresh = loop {
        match second.acquire(key).await.expect("acquire") {
            Acquisition::Acquired(lease) => break lease,
            Acquisition::Contended(c) => {
                assert!(Instant::now() < deadline, "lock never expired");
                sleep(c.retry_after().max(ms(1))).await;
            }
        }
    };
    assert!(stale.is_expired());
    assert!(second.fence(&fresh).await.unwrap() > stale_fence);
    // A fence issued once stays the lease's (no round trip).
    assert_eq!(first.fence(&stale).await.unwrap(), stale_fence);
    assert_ne!(fresh.token(), stale.token());

    // The stale holder can neither release nor extend the new holder's lock.
    assert!(!first.release(&stale).await.unwrap());
    let stale_expiry = stale.expires_at();
    assert!(!first.extend(&mut stale, secs(60)).await.unwrap());
    assert_eq!(
        stale.expires_at(),
        stale_expiry,
        "a failed extend changed the lease"
    );
    assert_eq!(
        get(&conn, &first.lock_key(key)).await.as_deref(),
        Some(value(&fresh).as_str())
    );
    let pttl: i64 = raw(&conn, &["PTTL", &first.lock_key(key)]).await;
    assert!(
        pttl > 0 && pttl <= 5_000,
        "the stale extend changed the TTL: {pttl}"
    );
    assert_contended(&first, key, secs(5)).await;

    // The new holder still owns it.
    assert!(second.release(&fresh).await.unwrap());
    assert!(!held(&conn, &first.lock_key(key)).await);
    // Releasing twice changes nothing and reports released (a resent
    // release must not look like a lost lock).
    assert!(second.release(&fresh).await.unwrap());
    assert!(!held(&conn, &first.lock_key(key)).await);
}

#[tokio::test]
async fn released_lock_is_free_at_once_and_release_is_token_checked() {
    let server = server();
    let conn = manager(&server).await;
    let locker = locker(conn.clone(), ms(300));
    let lease = acquired(&locker, "k").await;

    // Once released the lock is free at once; the old lease (same key, old
    // token) can then not release the new holder's lock.
    assert!(locker.release(&lease).await.unwrap());
    let other = acquired(&locker, "k").await;
    assert!(!locker.release(&lease).await.unwrap());
    assert_eq!(
        get(&conn, &locker.lock_key("k")).await.as_deref(),
        Some(value(&other).as_str())
    );
    assert!(locker.release(&other).await.unwrap());
}

// ---------------------------------------------------------------------------
// Contention
// ---------------------------------------------------------------------------

#[tokio::test]
async fn contention_reports_key_and_a_positive_retry_after_within_the_ttl() {
    let server = server();
    let ttl = ms(300);
    let a = locker(manager(&server).await, ttl);
    let b = locker(manager(&server).await, secs(10));
    let lease = acquired(&a, "busy").await;

    for contender in [&a, &b] {
        match contender.acquire("busy").await.unwrap() {
            Acquisition::Acquired(lease) => panic!("acquired a held lock: {lease:?}"),
            Acquisition::Contended(c) => {
                assert_eq!(c.key(), "busy");
                assert!(c.retry_after() > Duration::ZERO, "{c}");
                // Bounded by the holder's TTL, not the contender's.
                assert!(c.retry_after() <= ttl, "{c}");
                assert!(c.to_string().contains("busy"), "{c}");
            }
        }
    }
    // Contention on one key does not affect another.
    let other = acquired(&b, "idle").await;
    assert!(b.release(&other).await.unwrap());
    assert!(a.release(&lease).await.unwrap());
    // Free again once released.
    let again = acquired(&b, "busy").await;
    assert!(b.release(&again).await.unwrap());
}

// ---------------------------------------------------------------------------
// Fencing tokens
// ---------------------------------------------------------------------------

#[tokio::test]
async fn fences_strictly_increase_across_holders_lockers_and_counter_loss() {
    let server = server();
    let conn = manager(&server).await;
    let ttl = ms(200);
    // Two lockers on two separate connections.
    let a = locker(conn.clone(), ttl);
    let b = locker(manager(&server).await, ttl);
    let key = "fenced";

    let mut last = 0;
    let mut check = |fence: u64, what: &str| {
        assert!(fence > last, "fence went from {last} to {fence} ({what})");
        last = fence;
    };
    for i in 0..50 {
        let locker = if i % 3 == 0 { &a } else { &b };
        let lease = acquired(locker, key).await;
        check(locker.fence(&lease).await.unwrap(), "sequential holders");
        assert!(locker.release(&lease).await.unwrap());
        // Holders that never ask for a fence in between change nothing.
        let quiet = acquired(locker, key).await;
        assert!(locker.release(&quiet).await.unwrap());
    }

    // The fence record is lost (deleted by hand, evicted, expired): fences
    // must still go up, also when it is lost again right away.
    let record = format!("lockgate:fence:{{{key}}}");
    for round in 0..5 {
        let locker = if round % 2 == 0 { &a } else { &b };
        let lease = acquired(locker, key).await;
        assert!(held(&conn, &record).await, "no fence record");
        raw::<i64>(&conn, &["DEL", &record]).await;
        check(
            locker.fence(&lease).await.unwrap(),
            "after DEL of the record",
        );
        // The record lives as long as the lock, plus the grace period.
        let pttl: i64 = raw(&conn, &["PTTL", &record]).await;
        let most = (ttl + lockgate::lock::FENCE_GRACE).as_millis() as i64;
        assert!(pttl > 0 && pttl <= most, "record lives {pttl} ms");
        assert!(locker.release(&lease).await.unwrap());
    }

    // A holder whose lock expired does not stop the next fence from growing.
    let expired = acquired(&a, key).await;
    check(a.fence(&expired).await.unwrap(), "before expiry");
    sleep(ttl + ms(50)).await;
    let next = acquired(&b, key).await;
    check(b.fence(&next).await.unwrap(), "after expiry");
    assert!(b.release(&next).await.unwrap());

    // Keys have independent records, but also strictly increasing fences.
    let mut last_other = 0;
    for _ in 0..10 {
        let lease = acquired(&b, "other").await;
        let fence = b.fence(&lease).await.unwrap();
        assert!(fence > last_other);
        last_other = fence;
        assert!(b.release(&lease).await.unwrap());
    }
}

/// A fence is issued only while the lease holds the lock: a holder that
/// paused past its TTL and asks for its first fence after the next holder
/// took the key must not get one (it would outrank the next holder's).
#[tokio::test]
async fn no_fence_is_issued_to_a_lease_that_lost_its_lock() {
    let server = server();
    let conn = manager(&server).await;
    let ttl = ms(100);
    let (a, b) = (locker(conn.clone(), ttl), locker(conn.clone(), secs(10)));
    let stale = acquired(&a, "k").await;
    sleep(ttl + ms(50)).await;
    let next = acquired(&b, "k").await;
    let err = a.fence(&stale).await.expect_err("a fence for a lost lock");
    assert!(
        matches!(err, lockgate::Error::NotHeld { ref key } if key == "k"),
        "{err}"
    );
    assert!(!err.is_retryable());
    // The holder's fence is unaffected, and issued once: same value again,
    // and the lock's value carries it.
    let fence = b.fence(&next).await.unwrap();
    assert_eq!(b.fence(&next).await.unwrap(), fence);
    assert_eq!(next.issued_fence(), Some(fence));
    assert_eq!(
        get(&conn, &b.lock_key("k")).await.as_deref(),
        Some(value(&next).as_str())
    );
    let holder = b.inspect("k").await.unwrap().expect("held");
    assert_eq!(
        (holder.token.as_str(), holder.fence),
        (next.token(), Some(fence))
    );
    // Gone with the lock: no fence for a released lease either.
    assert!(b.release(&next).await.unwrap());
    let fresh = acquired(&b, "k").await;
    assert!(b.fence(&fresh).await.unwrap() > fence);
    assert!(b.release(&fresh).await.unwrap());
}

// ---------------------------------------------------------------------------
// Extend
// ---------------------------------------------------------------------------

#[tokio::test]
async fn extend_keeps_a_lock_past_its_original_ttl() {
    let server = server();
    let conn = manager(&server).await;
    let ttl = ms(150);
    let holder = locker(conn.clone(), ttl);
    let rival = locker(server.multiplexed().await.unwrap(), ttl);
    let key = "long-job";

    let mut lease = acquired(&holder, key).await;
    let original_expiry = lease.expires_at();
    let mut expiry = original_expiry;
    for _ in 0..4 {
        sleep(ttl / 3).await;
        assert!(holder.extend(&mut lease, ttl).await.unwrap());
        assert!(
            lease.expires_at() > expiry,
            "extend did not move expires_at"
        );
        assert!(lease.expires_at() <= Instant::now() + ttl);
        expiry = lease.expires_at();
    }
    // Past the original TTL, but still held.
    sleep_until_past(original_expiry).await;
    assert!(!lease.is_expired());
    assert_contended(&rival, key, ttl).await;
    assert_eq!(
        get(&conn, &holder.lock_key(key)).await.as_deref(),
        Some(value(&lease).as_str())
    );

    // A longer extension is honoured by the server too.
    assert!(holder.extend(&mut lease, secs(5)).await.unwrap());
    let pttl: i64 = raw(&conn, &["PTTL", &holder.lock_key(key)]).await;
    assert!(
        pttl > ttl.as_millis() as i64 && pttl <= 5_000,
        "pttl {pttl}"
    );
    assert!(holder.release(&lease).await.unwrap());

    // Extending a released lease fails and changes nothing.
    let before = lease.expires_at();
    assert!(!holder.extend(&mut lease, ttl).await.unwrap());
    assert_eq!(lease.expires_at(), before);
    assert!(!held(&conn, &holder.lock_key(key)).await);
}

async fn sleep_until_past(instant: Instant) {
    tokio::time::sleep_until(instant + ms(20)).await;
}

// ---------------------------------------------------------------------------
// Keys
// ---------------------------------------------------------------------------

#[tokio::test]
async fn unusual_keys_are_independent_locks_in_one_slot() {
    let server = server();
    let conn = manager(&server).await;
    let ttl = ms(500);
    let locker = locker(conn.clone(), ttl);
    let long = "k".repeat(10_000);
    let long_braced = format!("{{{}}}", "}".repeat(5_000));
    let keys: Vec<&str> = vec![
        "}",
        "}}",
        "a}b",
        "a\\)b",
        "\\)",
        "{x}",
        "{",
        "{}",
        "x",
        "a{b",
        "\\",
        "\\\\",
        "ü日本",
        " spaces ",
        "spaces",
        &long,
        &long_braced,
    ];

    for key in &keys {
        let lock_key = locker.lock_key(key);
        let lock_tag = hash_tag(&lock_key);
        assert_ne!(lock_tag, lock_key, "no hash tag in {lock_key:?}");
    }
    // Distinct user keys map to distinct Redis keys.
    let mut lock_keys: Vec<String> = keys.iter().map(|k| locker.lock_key(k)).collect();
    lock_keys.sort();
    lock_keys.dedup();
    assert_eq!(lock_keys.len(), keys.len(), "two keys share a lock key");

    // All can be held at once: none is mistaken for another.
    let mut leases = Vec::new();
    for key in &keys {
        let lease = acquired(&locker, key).await;
        assert_eq!(lease.key(), *key);
        leases.push(lease);
    }
    for lease in &leases {
        assert_contended(&locker, lease.key(), ttl).await;
        assert_eq!(
            get(&conn, &locker.lock_key(lease.key())).await.as_deref(),
            Some(value(lease).as_str()),
            "lock of {:?} holds the wrong token",
            lease.key()
        );
    }
    // Releasing one leaves the others held.
    for (i, lease) in leases.iter().enumerate() {
        assert!(locker.release(lease).await.unwrap(), "{:?}", lease.key());
        assert!(!held(&conn, &locker.lock_key(lease.key())).await);
        for later in &leases[i + 1..] {
            assert!(held(&conn, &locker.lock_key(later.key())).await);
        }
    }
}

#[tokio::test]
async fn empty_key_is_rejected() {
    let server = server();
    let locker = Locker::new(manager(&server).await);
    assert!(matches!(
        locker.acquire("").await,
        Err(Error::InvalidKey(_))
    ));
    let err = locker.acquire("").await.unwrap_err();
    assert!(!err.is_retryable());
}

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

#[tokio::test]
async fn bad_configuration_is_rejected_when_set() {
    let server = server();
    let conn = manager(&server).await;
    for ttl in [
        Duration::ZERO,
        Duration::from_micros(500),
        Duration::from_nanos(999_999),
    ] {
        let result = Locker::new(conn.clone()).ttl(ttl);
        assert!(
            matches!(result, Err(Error::Config(_))),
            "TTL {ttl:?} accepted: {result:?}"
        );
    }
    assert_eq!(
        Locker::new(conn.clone()).ttl(ms(1)).unwrap().lease_ttl(),
        ms(1)
    );
    for prefix in ["", "a{b", "a}b", "{", "}"] {
        let result = Locker::new(conn.clone()).prefix(prefix);
        assert!(
            matches!(result, Err(Error::Config(_))),
            "prefix {prefix:?} accepted: {result:?}"
        );
    }
    let err = Locker::new(conn.clone()).prefix("").unwrap_err();
    assert!(!err.is_retryable());

    // extend checks its TTL like the builder, and changes nothing on error.
    let locker = locker(conn.clone(), ms(300));
    let mut lease = acquired(&locker, "k").await;
    let before = lease.clone();
    for ttl in [Duration::ZERO, Duration::from_micros(500)] {
        assert!(matches!(
            locker.extend(&mut lease, ttl).await,
            Err(Error::Config(_))
        ));
    }
    assert_eq!(lease, before);
    assert!(held(&conn, &locker.lock_key("k")).await);
    assert!(locker.release(&lease).await.unwrap());
}

#[tokio::test]
async fn custom_prefix_is_used_and_separates_lock_spaces() {
    let server = server();
    let conn = manager(&server).await;
    let default = Locker::new(conn.clone());
    let custom = Locker::new(conn.clone()).prefix("app:locks").unwrap();
    assert!(default.lock_key("k").starts_with("lockgate:"));
    assert!(custom.lock_key("k").starts_with("app:locks:"));
    assert_eq!(hash_tag(&custom.lock_key("k")), "k");

    // Builder order does not matter and neither call resets the other.
    let both = Locker::new(conn.clone())
        .prefix("app:locks")
        .unwrap()
        .ttl(ms(400))
        .unwrap();
    assert_eq!(both.lease_ttl(), ms(400));
    assert_eq!(both.lock_key("k"), custom.lock_key("k"));
    let both = Locker::new(conn.clone())
        .ttl(ms(400))
        .unwrap()
        .prefix("app:locks")
        .unwrap();
    assert_eq!(both.lease_ttl(), ms(400));
    assert_eq!(both.lock_key("k"), custom.lock_key("k"));

    let lease = acquired(&both, "k").await;
    assert!(held(&conn, &custom.lock_key("k")).await);
    assert!(!held(&conn, &default.lock_key("k")).await);
    // Another prefix is another lock space.
    let other = acquired(&default, "k").await;
    assert_contended(&custom, "k", ms(400)).await;
    assert!(default.release(&other).await.unwrap());
    assert!(both.release(&lease).await.unwrap());
}

// ---------------------------------------------------------------------------
// Server down
// ---------------------------------------------------------------------------

fn assert_retryable_redis_error(err: &Error) {
    assert!(
        matches!(err, Error::Redis { .. }),
        "expected a Redis error, got {err:?}"
    );
    assert!(err.is_retryable(), "not retryable: {err:?}");
    assert!(err.redis_error().is_some());
}

#[tokio::test]
async fn stopped_server_gives_a_retryable_error() {
    let mut server = server();
    let multiplexed = locker(server.multiplexed().await.unwrap(), ms(200));
    let managed = locker(impatient_manager(&server).await, ms(200));
    // Connections are up and working before the server goes away.
    let lease = acquired(&multiplexed, "a").await;
    assert!(multiplexed.release(&lease).await.unwrap());
    let lease = acquired(&managed, "a").await;
    assert!(managed.release(&lease).await.unwrap());

    server.stop();

    // Several attempts: the first notices the dropped connection, later ones
    // find it dropped (or fail to reconnect).
    for _ in 0..3 {
        let result = timeout(BOUNDED, multiplexed.acquire("a"))
            .await
            .expect("acquire on a dead server hung (multiplexed)");
        let err = result.expect_err("acquire succeeded on a dead server");
        assert_retryable_redis_error(&err);
        assert!(err.to_string().contains("acquiring lock `a`"), "{err}");

        let result = timeout(BOUNDED, managed.acquire("a"))
            .await
            .expect("acquire on a dead server hung (connection manager)");
        assert_retryable_redis_error(&result.expect_err("acquire succeeded on a dead server"));
    }
}

/// With its default configuration a `ConnectionManager` retries reconnecting
/// six times with jittered exponential backoff from 100 ms, so an operation
/// on a dead server takes roughly 6 to 13 s to fail. Bounded, but too slow
/// for the default suite: run with `cargo test -- --ignored`.
#[tokio::test]
#[ignore = "takes 6-13 s: the default ConnectionManager backs off before failing"]
async fn stopped_server_with_default_connection_manager_errors_within_bounds() {
    let mut server = server();
    let managed = locker(manager(&server).await, ms(200));
    let lease = acquired(&managed, "a").await;
    server.stop();
    let bound = secs(30);
    let started = std::time::Instant::now();
    let result = timeout(bound, managed.release(&lease))
        .await
        .expect("release on a dead server hung");
    assert_retryable_redis_error(&result.expect_err("release succeeded on a dead server"));
    let result = timeout(bound, managed.acquire("a"))
        .await
        .expect("acquire on a dead server hung");
    assert_retryable_redis_error(&result.expect_err("acquire succeeded on a dead server"));
    eprintln!(
        "default ConnectionManager reported the dead server after {:?}",
        started.elapsed()
    );
}

async fn hammer<C>(locker: Locker<C>, key: String, successes: Arc<Mutex<usize>>) -> Error
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    loop {
        match locker.acquire(&key).await {
            Ok(Acquisition::Acquired(lease)) => {
                *successes.lock().unwrap() += 1;
                if let Err(e) = locker.release(&lease).await {
                    return e;
                }
            }
            Ok(Acquisition::Contended(_)) => tokio::task::yield_now().await,
            Err(e) => return e,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_killed_mid_run_ends_every_task_with_an_error() {
    let mut server = server();
    let ttl = ms(200);
    let multiplexed = locker(server.multiplexed().await.unwrap(), ttl);
    let managed = locker(impatient_manager(&server).await, ttl);
    let successes = Arc::new(Mutex::new(0));

    let mut tasks = Vec::new();
    for task in 0..8 {
        let key = format!("k{}", task % 3);
        let successes = successes.clone();
        tasks.push(if task % 2 == 0 {
            tokio::spawn(hammer(multiplexed.clone(), key, successes))
        } else {
            tokio::spawn(hammer(managed.clone(), key, successes))
        });
    }
    // Let them work, then pull the plug.
    eventually("the tasks make progress", BOUNDED, async || {
        let n = *successes.lock().unwrap();
        done_if(n >= 50, format_args!("{n} successes"))
    })
    .await;
    server.stop();

    let ended = timeout(BOUNDED, join_all(tasks))
        .await
        .expect("tasks did not end after the server was killed");
    for result in ended {
        let err = result.expect("task panicked");
        assert!(
            matches!(err, Error::Redis { .. }),
            "expected a Redis error, got {err:?}"
        );
        assert!(err.is_retryable(), "not retryable: {err:?}");
    }
}

#[tokio::test]
async fn restarted_server_is_usable_again_through_a_connection_manager() {
    let mut server = server();
    let managed = locker(impatient_manager(&server).await, ms(200));
    let before = acquired(&managed, "k").await;
    let before_fence = managed.fence(&before).await.unwrap();
    assert!(managed.release(&before).await.unwrap());
    server.stop();
    let err = timeout(BOUNDED, managed.acquire("k"))
        .await
        .expect("hung")
        .expect_err("acquire succeeded on a dead server");
    assert_retryable_redis_error(&err);

    server.restart().expect("restart");
    // The manager reconnects in the background; retry within bounds.
    let deadline = Instant::now() + BOUNDED;
    let after = loop {
        match managed.acquire("k").await {
            Ok(acq) => break acq.lease().expect("fresh server: the lock is free"),
            Err(e) => {
                assert_retryable_redis_error(&e);
                assert!(Instant::now() < deadline, "never reconnected: {e}");
                sleep(ms(20)).await;
            }
        }
    };
    // The server lost all data (no persistence): the fence restarts from the
    // server clock and still exceeds the pre-crash fence.
    assert!(managed.fence(&after).await.unwrap() > before_fence);
    assert!(managed.release(&after).await.unwrap());
}

// ---------------------------------------------------------------------------
// Resends (item 6): a request whose first copy ran is sent again, as
// redis-rs' cluster connections do when a connection drops mid-request. The
// scripts are run twice, exactly as such a resend runs them.
// ---------------------------------------------------------------------------

/// A lock script as the library loads it: after `holds.lua`, the token check
/// the scripts share (and, for a release, `line.lua`).
fn lock_lua(parts: &[&str]) -> redis::Script {
    let holds = include_str!("../../src/lock/holds.lua");
    redis::Script::new(&format!("{holds}\n{}", parts.join("\n")))
}

static CONTEND_LUA: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| lock_lua(&[include_str!("../../src/lock/contend.lua")]));
static RELEASE_LUA: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    lock_lua(&[
        include_str!("../../src/lock/line.lua"),
        include_str!("../../src/lock/release.lua"),
    ])
});
static EXTEND_LUA: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| lock_lua(&[include_str!("../../src/lock/extend.lua")]));
static FENCE_LUA: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| lock_lua(&[include_str!("../../src/lock/fence.lua")]));

/// Sends the acquire command for `token` as `Locker::acquire` sends it.
async fn set_nx(locker: &Locker<ConnectionManager>, key: &str, token: &str) -> Option<String> {
    raw(
        locker.connection(),
        &[
            "SET",
            &locker.lock_key(key),
            token,
            "NX",
            "PX",
            "10000",
            "GET",
        ],
    )
    .await
}

/// Runs contend.lua for `token` as `Locker::acquire` sends it when busy.
async fn contend_lua(locker: &Locker<ConnectionManager>, key: &str, token: &str) -> Vec<i64> {
    CONTEND_LUA
        .key(locker.lock_key(key))
        .key(format!("{}:waiters", locker.lock_key(key)))
        .arg(token)
        .arg(10_000)
        .arg(0)
        .invoke_async(&mut locker.connection().clone())
        .await
        .expect("contend.lua")
}

/// Runs release.lua for `token` as `Locker::release` sends it.
async fn release_lua(locker: &Locker<ConnectionManager>, key: &str, token: &str) -> i64 {
    RELEASE_LUA
        .key(locker.lock_key(key))
        .key(format!("{}:waiters", locker.lock_key(key)))
        .arg(token)
        .arg("PUBLISH")
        .arg(250)
        .invoke_async(&mut locker.connection().clone())
        .await
        .expect("release.lua")
}

/// Runs fence.lua for `token` as `Locker::fence` sends it.
async fn fence_lua(locker: &Locker<ConnectionManager>, key: &str, token: &str) -> i64 {
    FENCE_LUA
        .key(locker.lock_key(key))
        .key(format!("lockgate:fence:{{{key}}}"))
        .arg(token)
        .arg(lockgate::lock::FENCE_GRACE.as_millis() as u64)
        .invoke_async(&mut locker.connection().clone())
        .await
        .expect("fence.lua")
}

#[tokio::test]
async fn resent_acquire_release_extend_and_fence_are_idempotent() {
    let server = server();
    let conn = manager(&server).await;
    let locker = locker(conn.clone(), secs(10));
    let token = "0123456789abcdef0123456789abcdef";
    let other = "ffffffffffffffffffffffffffffffff";

    assert_eq!(
        set_nx(&locker, "k", token).await,
        None,
        "the first copy acquires"
    );
    // The resend finds the lock holding its own token, which `Locker` takes
    // as acquired; the contend script says so too, with the TTL left.
    assert_eq!(set_nx(&locker, "k", token).await.as_deref(), Some(token));
    let resent = contend_lua(&locker, "k", token).await;
    assert_eq!(resent[0], 1, "{resent:?}");
    assert!(resent[1] > 9_000 && resent[1] <= 10_000, "{resent:?}");
    // Another token is still refused, by both.
    assert_eq!(set_nx(&locker, "k", other).await.as_deref(), Some(token));
    assert_eq!(contend_lua(&locker, "k", other).await[0], 0);

    // A fence asked twice is the same fence; other tokens get none.
    let fence = fence_lua(&locker, "k", token).await;
    assert!(fence > 0);
    assert_eq!(fence_lua(&locker, "k", token).await, fence);
    assert_eq!(fence_lua(&locker, "k", other).await, -1);
    // With its fence in the value, the lock is still the token's.
    assert_eq!(contend_lua(&locker, "k", token).await[0], 1);

    // Extend twice: both confirm.
    for _ in 0..2 {
        let extended: i64 = EXTEND_LUA
            .key(locker.lock_key("k"))
            .arg(token)
            .arg(20_000)
            .invoke_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(extended, 1);
    }

    // A token that never held it releases nothing.
    assert_eq!(release_lua(&locker, "k", other).await, -1);
    // Release twice: the resend finds the lock gone (0), which `Locker`
    // reports as released while the lease has not run out.
    assert_eq!(release_lua(&locker, "k", token).await, 1);
    assert_eq!(release_lua(&locker, "k", token).await, 0);

    // The next holder gets a higher fence, and the stale resends touch nothing.
    let next = acquired(&locker, "k").await;
    assert!(locker.fence(&next).await.unwrap() > fence as u64);
    assert_eq!(release_lua(&locker, "k", token).await, -1);
    assert_eq!(contend_lua(&locker, "k", token).await[0], 0);
    assert_eq!(fence_lua(&locker, "k", token).await, -1);
    assert!(locker.release(&next).await.unwrap());
    // Released twice through the Locker: both report released.
    let again = acquired(&locker, "k").await;
    assert!(locker.release(&again).await.unwrap());
    assert!(locker.release(&again).await.unwrap());
}

// ---------------------------------------------------------------------------
// What stays in Redis (item 3)
// ---------------------------------------------------------------------------

async fn keys(conn: &ConnectionManager) -> Vec<String> {
    let mut keys: Vec<String> = raw(conn, &["KEYS", "*"]).await;
    keys.sort();
    keys
}

#[tokio::test]
async fn released_or_expired_locks_leave_nothing_but_short_lived_fence_records() {
    let server = server();
    let conn = manager(&server).await;
    let grace = lockgate::lock::FENCE_GRACE;
    let ttl = secs(10);
    let n = 200;

    // Held: one key per lock, nothing else.
    let locker = locker(conn.clone(), ttl);
    let mut leases = Vec::new();
    for i in 0..n {
        leases.push(acquired(&locker, &format!("order-{i}")).await);
    }
    let held = keys(&conn).await;
    assert_eq!(held.len(), n, "{:?}", &held[..3]);
    assert!(held.iter().all(|k| k.starts_with("lockgate:lock:")));

    // Released without a fence: nothing left.
    for lease in &leases {
        assert!(locker.release(lease).await.unwrap());
    }
    let left = keys(&conn).await;
    assert!(
        left.is_empty(),
        "{} keys left: {:?}",
        left.len(),
        &left[..3.min(left.len())]
    );

    // With a fence: its record, living at most the lock's TTL plus the grace.
    for i in 0..n {
        let lease = acquired(&locker, &format!("order-{i}")).await;
        locker.fence(&lease).await.unwrap();
        assert!(locker.release(&lease).await.unwrap());
    }
    let left = keys(&conn).await;
    assert_eq!(left.len(), n);
    for key in &left {
        assert!(key.starts_with("lockgate:fence:"), "{key}");
        let pttl: i64 = raw(&conn, &["PTTL", key]).await;
        assert!(
            pttl > 0 && pttl <= (ttl + grace).as_millis() as i64,
            "{key} lives {pttl} ms, longer than TTL + grace"
        );
    }
    raw::<()>(&conn, &["FLUSHALL"]).await;

    // Expired: nothing at all.
    let short = locker_with_ttl(&conn, ms(50));
    for i in 0..n {
        let _ = acquired(&short, &format!("order-{i}")).await;
    }
    sleep(ms(120)).await;
    let left = keys(&conn).await;
    assert!(
        left.is_empty(),
        "{} keys left after expiry: {:?}",
        left.len(),
        &left[..3.min(left.len())]
    );
}

fn locker_with_ttl(conn: &ConnectionManager, ttl: Duration) -> Locker<ConnectionManager> {
    locker(conn.clone(), ttl)
}

// ---------------------------------------------------------------------------
// Eviction (item 19)
// ---------------------------------------------------------------------------

/// Counts the warnings about `maxmemory-policy` logged on this thread.
struct EvictionWarnings(Arc<std::sync::atomic::AtomicUsize>);

impl tracing::Subscriber for EvictionWarnings {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        let meta = event.metadata();
        if *meta.level() == tracing::Level::WARN && meta.fields().field("policy").is_some() {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[tokio::test]
async fn eviction_policies_that_may_evict_locks_are_reported_and_warned_once() {
    let warnings = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let _guard = tracing::subscriber::set_default(EvictionWarnings(warnings.clone()));
    let count = || warnings.load(std::sync::atomic::Ordering::SeqCst);

    let safe = server();
    let locker = locker(manager(&safe).await, secs(10));
    let policy = locker.check_eviction().await.unwrap();
    assert_eq!(policy.name(), "noeviction");
    assert!(!policy.may_evict_locks());
    for i in 0..5 {
        let _ = acquired(&locker, &format!("k{i}")).await;
    }

    for name in ["volatile-ttl", "volatile-lru", "allkeys-lru"] {
        let evicting = lockgate::testing::RedisServer::builder()
            .args(["--maxmemory-policy", name, "--maxmemory", "1gb"])
            .start()
            .unwrap();
        let policy = locker_on(&evicting).await.check_eviction().await.unwrap();
        assert_eq!(policy.name(), name);
        assert!(policy.may_evict_locks(), "{name}");
    }
    // Without a memory limit nothing is evicted, whatever the policy.
    let unlimited = lockgate::testing::RedisServer::builder()
        .args(["--maxmemory-policy", "volatile-ttl"])
        .start()
        .unwrap();
    let policy = locker_on(&unlimited).await.check_eviction().await.unwrap();
    assert!(!policy.may_evict_locks());
    assert_eq!(count(), 0, "no warning for noeviction");

    // Warned once per locker configuration, on first use, not per call.
    let evicting = lockgate::testing::RedisServer::builder()
        .args(["--maxmemory-policy", "volatile-ttl", "--maxmemory", "1gb"])
        .start()
        .unwrap();
    let locker = locker_on(&evicting).await;
    let clone = locker.clone();
    for i in 0..10 {
        let _ = acquired(if i % 2 == 0 { &locker } else { &clone }, &format!("k{i}")).await;
    }
    eventually("the eviction warning is logged", BOUNDED, async || {
        done_if(count() == 1, count())
    })
    .await;
    let other_config = locker.clone().ttl(secs(20)).unwrap();
    for i in 10..20 {
        let _ = acquired(&locker, &format!("k{i}")).await;
        let _ = acquired(&other_config, &format!("o{i}")).await;
    }
    eventually("the second configuration warns too", BOUNDED, async || {
        done_if(count() == 2, count())
    })
    .await;
    sleep(ms(100)).await;
    assert_eq!(count(), 2, "warned more than once per configuration");
}

async fn locker_on(server: &lockgate::testing::RedisServer) -> Locker<ConnectionManager> {
    locker(manager(server).await, secs(10))
}

/// `fence = max(now, last + 1)`: a fence record ahead of the server's clock
/// (a clock that stepped back since, or a burst of holders within one
/// microsecond) is continued, not undercut.
#[tokio::test]
async fn a_fence_record_ahead_of_the_clock_is_continued() {
    let server = server();
    let conn = manager(&server).await;
    let locker = locker(conn.clone(), secs(10));
    let ahead: u64 = 4_000_000_000_000_000; // 2096, in microseconds
    raw::<()>(
        &conn,
        &[
            "SET",
            "lockgate:fence:{k}",
            &ahead.to_string(),
            "PX",
            "5000",
        ],
    )
    .await;
    let lease = acquired(&locker, "k").await;
    assert_eq!(locker.fence(&lease).await.unwrap(), ahead + 1);
    assert!(locker.release(&lease).await.unwrap());
    let next = acquired(&locker, "k").await;
    assert_eq!(locker.fence(&next).await.unwrap(), ahead + 2);
    assert!(locker.release(&next).await.unwrap());
}
