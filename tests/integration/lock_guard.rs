//! `Locker::lock` and `Locker::with_lock` (issue 39): a lock other code can
//! await, held by a guard that renews it, gives its fence, tells when it
//! is lost and releases it when dropped.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::{Error, HeldLock, Locker};
use support::{acquired, manager, ms, secs, server};
use tokio::time::Instant;

/// A locker that hears releases, with a short TTL.
async fn listening(
    server: &lockgate::testing::RedisServer,
    ttl: Duration,
) -> Locker<redis::aio::ConnectionManager> {
    Locker::connect(server.client())
        .await
        .unwrap()
        .ttl(ttl)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_waits_in_line_and_is_woken_by_the_release() {
    let server = server();
    let holder = support::locker(manager(&server).await, secs(30));
    let lease = acquired(&holder, "account").await;
    let locker = listening(&server, secs(30)).await;
    let waiting = tokio::spawn(async move {
        let guard = locker.lock("account", secs(10)).await.unwrap();
        (Instant::now(), guard.release().await.unwrap())
    });
    tokio::time::sleep(ms(300)).await;
    let released = Instant::now();
    assert!(holder.release(&lease).await.unwrap());
    let (got, held) = waiting.await.unwrap();
    assert!(got >= released, "the lock was granted while held");
    assert!(
        got - released < ms(200),
        "woken {:?} after the release",
        got - released
    );
    assert!(held);
}

#[tokio::test]
async fn lock_gives_up_after_its_wait_with_when_to_retry() {
    let server = server();
    let holder = support::locker(manager(&server).await, secs(30));
    let _lease = acquired(&holder, "account").await;
    let locker = support::locker(manager(&server).await, secs(30));
    let started = Instant::now();
    let busy = locker.lock("account", ms(200)).await.unwrap_err();
    let Error::Contended(busy) = &busy else {
        panic!("expected Contended, got {busy}");
    };
    assert!(busy.retry_after() > secs(20), "{busy}");
    assert!(started.elapsed() < secs(2));
    assert!(matches!(
        locker.lock("", secs(1)).await,
        Err(Error::InvalidKey(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_renews_its_lock_and_releases_it_when_dropped() {
    let server = server();
    let locker = listening(&server, ms(300)).await;
    let other = support::locker(manager(&server).await, ms(300));
    let guard = locker.lock("k", secs(1)).await.unwrap();
    // Three TTLs later the lock is still the guard's.
    tokio::time::sleep(ms(900)).await;
    assert!(other.acquire("k").await.unwrap().lease().is_none());
    assert!(!guard.is_lost());
    drop(guard);
    support::eventually("the dropped guard's release", secs(2), async || {
        let free = other.acquire("k").await.unwrap().lease().is_some();
        support::done_if(free, free)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_whose_lock_is_taken_says_it_is_lost() {
    let server = server();
    let conn = manager(&server).await;
    let locker = listening(&server, ms(300)).await;
    let guard = locker.lock("k", secs(1)).await.unwrap();
    let first = guard.fence().await.unwrap();
    let _: () = support::raw(&conn, &["SET", "lockgate:lock:{k}", "someone-else"]).await;
    tokio::time::timeout(secs(2), guard.lost())
        .await
        .expect("lost() fired");
    assert!(
        matches!(guard.fence().await, Ok(f) if f == first),
        "its fence stays its own"
    );
    assert!(
        !guard.release().await.unwrap(),
        "released after it was lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guards_exclude_each_other_and_fences_increase() {
    let server = server();
    let intervals = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..5 {
        let locker = listening(&server, secs(5)).await;
        let intervals = intervals.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..10 {
                let guard = locker.lock("hot", secs(20)).await.unwrap();
                let start = Instant::now();
                let fence = guard.fence().await.unwrap();
                tokio::time::sleep(ms(2)).await;
                intervals
                    .lock()
                    .unwrap()
                    .push((start, Instant::now(), fence));
                assert!(guard.release().await.unwrap());
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut intervals = intervals.lock().unwrap().clone();
    assert_eq!(intervals.len(), 50);
    intervals.sort_by_key(|(start, ..)| *start);
    for pair in intervals.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "two guards of one key at once");
        assert!(
            pair[0].2 < pair[1].2,
            "fences increase: {:?}",
            (pair[0].2, pair[1].2)
        );
    }
}

#[tokio::test]
async fn with_lock_runs_its_work_holding_the_lock() {
    let server = server();
    let locker = listening(&server, secs(5)).await;
    let other = support::locker(manager(&server).await, secs(5));
    let seen = locker
        .with_lock("k", secs(1), async {
            let held = HeldLock::current().expect("the lock, inside");
            let busy = other.acquire("k").await.unwrap().lease().is_none();
            (held.key().to_owned(), held.fence().await.is_ok(), busy)
        })
        .await
        .unwrap();
    assert_eq!(seen, ("k".to_owned(), true, true));
    assert!(
        other.acquire("k").await.unwrap().lease().is_some(),
        "released after"
    );
}
