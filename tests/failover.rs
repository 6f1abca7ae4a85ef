//! Locks across the ways Redis loses recent writes: a restart from an older
//! snapshot, the promotion of a replica that lagged, keys deleted by hand.
//! Fences must strictly increase per key through all of them; with
//! `require_replicas`, a lock that did not reach the replicas is refused.

mod support;

use lockgate::testing::{RedisServer, ReplicaPair};
use lockgate::{Acquisition, Locker};
use redis::aio::ConnectionManager;
use support::{acquired, exists, locker, manager, ms, raw, secs};

/// Acquires and releases `key` `n` times; returns the highest fence seen,
/// checking that each is above `last`.
async fn cycles(locker: &Locker<ConnectionManager>, key: &str, n: usize, mut last: u64) -> u64 {
    for _ in 0..n {
        let lease = acquired(locker, key).await;
        assert!(
            lease.fence() > last,
            "fence of {key:?} went from {last} to {}",
            lease.fence()
        );
        last = lease.fence();
        assert!(locker.release(&lease).await.unwrap());
    }
    last
}

fn pair() -> ReplicaPair {
    ReplicaPair::start().unwrap_or_else(|e| panic!("could not start a replica pair: {e}"))
}

// ---------------------------------------------------------------------------
// Item 1 (a): restart from a snapshot taken before the last acquisitions
// ---------------------------------------------------------------------------

#[tokio::test]
async fn fences_increase_across_a_restart_from_an_older_snapshot() {
    let mut server = RedisServer::start().unwrap();
    let ttl = secs(10);
    let conn = manager(&server).await;
    let before = locker(conn.clone(), ttl);
    let mut last = cycles(&before, "k", 5, 0).await;
    // A lock held at the snapshot, released after it: the restart brings it
    // back, held, until its TTL.
    let held = acquired(&before, "held").await;
    let mut last_held = held.fence();
    server.snapshot().unwrap();

    // Acquisitions the snapshot does not have.
    last = cycles(&before, "k", 20, last).await;
    assert!(before.release(&held).await.unwrap());
    last_held = cycles(&before, "held", 3, last_held).await;
    drop((before, conn));

    server.restart().unwrap(); // SIGKILL, then start from the snapshot
    let conn = manager(&server).await;
    let after = locker(conn.clone(), ttl);
    cycles(&after, "k", 3, last).await;
    // The resurrected lock of "held" (the snapshot's holder) still blocks.
    assert!(matches!(
        after.acquire("held").await.unwrap(),
        Acquisition::Contended(_)
    ));
    raw::<i64>(&conn, &["DEL", &after.lock_key("held")]).await;
    cycles(&after, "held", 3, last_held).await;
}

// ---------------------------------------------------------------------------
// Item 1 (b): promotion of a replica that missed the last acquisitions
// ---------------------------------------------------------------------------

#[tokio::test]
async fn fences_increase_across_the_promotion_of_a_lagging_replica() {
    let mut pair = pair();
    let ttl = secs(10);
    let conn = manager(pair.primary()).await;
    let old = locker(conn.clone(), ttl);
    let mut last = cycles(&old, "k", 5, 0).await;
    let mut last_expired = cycles(&old, "expired", 2, 0).await;
    pair.wait_for_sync().unwrap();
    pair.pause_replica().unwrap();

    // Acquisitions the replica never sees.
    last = cycles(&old, "k", 20, last).await;
    last_expired = cycles(&old, "expired", 3, last_expired).await;
    let short = locker(conn.clone(), ms(50));
    let lost = acquired(&short, "expired").await; // expires, never released
    assert!(lost.fence() > last_expired);
    last_expired = lost.fence();
    drop((old, short, conn));

    pair.kill_primary();
    pair.resume_replica().unwrap();
    pair.promote_replica().unwrap();
    let conn = manager(pair.replica()).await;
    let new = locker(conn.clone(), ttl);
    cycles(&new, "k", 3, last).await;
    cycles(&new, "expired", 3, last_expired).await;
}

// ---------------------------------------------------------------------------
// Item 1 (c): the fence record deleted (by hand, or evicted)
// ---------------------------------------------------------------------------

#[tokio::test]
async fn fences_increase_when_the_fence_record_or_the_lock_is_deleted() {
    let server = RedisServer::start().unwrap();
    let conn = manager(&server).await;
    let locker = locker(conn.clone(), secs(10));
    let mut last = cycles(&locker, "k", 3, 0).await;
    for _ in 0..5 {
        // The released lock's fence record (tombstone) deleted.
        raw::<i64>(&conn, &["DEL", &locker.fence_key("k")]).await;
        assert!(!exists(&conn, &locker.fence_key("k")).await);
        last = cycles(&locker, "k", 1, last).await;
        // A held lock deleted by hand: it carries the fence.
        let lease = acquired(&locker, "k").await;
        assert!(lease.fence() > last);
        last = lease.fence();
        raw::<i64>(&conn, &["DEL", &locker.lock_key("k")]).await;
        assert!(!locker.release(&lease).await.unwrap());
    }
    cycles(&locker, "k", 3, last).await;
}
