//! Locks across the ways Redis loses recent writes: a restart from an older
//! snapshot, the promotion of a replica that lagged, keys deleted by hand.
//! Fences must strictly increase per key through all of them; with
//! `require_replicas`, a lock that did not reach the replicas is refused.

use crate::support;

use lockgate::testing::{RedisServer, ReplicaPair};
use lockgate::{Acquisition, Error, Locker};
use redis::aio::ConnectionManager;
use support::{acquired, exists, locker, manager, ms, raw, secs};

/// Acquires and releases `key` `n` times; returns the highest fence seen,
/// checking that each is above `last`.
async fn cycles(locker: &Locker<ConnectionManager>, key: &str, n: usize, mut last: u64) -> u64 {
    for _ in 0..n {
        let lease = acquired(locker, key).await;
        let fence = locker.fence(&lease).await.unwrap();
        assert!(fence > last, "fence of {key:?} went from {last} to {fence}");
        last = fence;
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
    let ttl = secs(60);
    let conn = manager(&server).await;
    let before = locker(conn.clone(), ttl);
    let mut last = cycles(&before, "k", 5, 0).await;
    // A lock held at the snapshot, released after it: the restart brings it
    // back, held, until its TTL.
    let held = acquired(&before, "held").await;
    let mut last_held = before.fence(&held).await.unwrap();
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
    let ttl = secs(60);
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
    let lost = short.fence(&lost).await.unwrap();
    assert!(lost > last_expired);
    last_expired = lost;
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
    let record = "lockgate:fence:{k}";
    assert!(exists(&conn, record).await);
    for _ in 0..5 {
        // The last fence's record deleted.
        raw::<i64>(&conn, &["DEL", record]).await;
        last = cycles(&locker, "k", 1, last).await;
        // A held lock deleted by hand: it carries the fence.
        let lease = acquired(&locker, "k").await;
        let fence = locker.fence(&lease).await.unwrap();
        assert!(fence > last);
        last = fence;
        raw::<i64>(&conn, &["DEL", &locker.lock_key("k"), record]).await;
        // Gone before its TTL: the release cannot tell a deletion by hand
        // from its own earlier copy, and reports it released.
        assert!(locker.release(&lease).await.unwrap());
    }
    cycles(&locker, "k", 3, last).await;
}

// ---------------------------------------------------------------------------
// Item 5: opt-in durability with WAIT
// ---------------------------------------------------------------------------

/// `WAIT` times out after this long in these tests: long enough for a
/// replica on a loaded 2-core machine to confirm, and below the response
/// timeout of the durable connection (`durable_manager`).
const WAIT: std::time::Duration = ms(1000);

/// A connection of its own for a durable locker, whose response timeout
/// outlasts `WAIT` (redis-rs' default, 500 ms, would not).
async fn durable_manager(server: &RedisServer) -> ConnectionManager {
    let config = redis::aio::ConnectionManagerConfig::new().set_response_timeout(Some(secs(5)));
    server
        .client()
        .get_connection_manager_with_config(config)
        .await
        .expect("connection manager")
}

fn not_replicated(error: &Error) -> (u32, u32, bool) {
    match error {
        Error::NotReplicated {
            wanted,
            acked,
            released,
            timeout,
            ..
        } => {
            assert_eq!(*timeout, WAIT);
            assert!(error.is_retryable(), "{error}");
            (*wanted, *acked, *released)
        }
        other => panic!("expected NotReplicated, got {other:?}"),
    }
}

#[tokio::test]
async fn durable_locks_reach_the_replica_or_are_released_and_refused() {
    let pair = pair();
    // A connection of its own for the durable locker: WAIT holds it.
    let conn = durable_manager(pair.primary()).await;
    let durable = locker(conn.clone(), secs(10))
        .require_replicas(1, WAIT)
        .await
        .unwrap();
    assert_eq!(durable.required_replicas(), Some((1, WAIT)));
    let plain = locker(durable_manager(pair.primary()).await, secs(10));
    let on_replica = durable_manager(pair.replica()).await;

    // Replica up: acquire returns once the replica has the lock.
    let mut lease = acquired(&durable, "k").await;
    let value = lease.token().to_owned();
    let replicated: Option<String> = raw(&on_replica, &["GET", &durable.lock_key("k")]).await;
    assert_eq!(replicated.as_deref(), Some(value.as_str()));
    assert!(durable.extend(&mut lease, secs(20)).await.unwrap());
    let pttl: i64 = raw(&on_replica, &["PTTL", &durable.lock_key("k")]).await;
    assert!(
        pttl > 10_000,
        "the extension did not reach the replica: {pttl}"
    );
    // A lease taken before the replica stops, to extend after.
    let mut before = acquired(&durable, "extended-later").await;
    assert!(durable.release(&lease).await.unwrap());

    let mut pair = pair;
    pair.pause_replica().unwrap();

    // Replica gone: the acquire is refused, typed, and nothing stays held.
    let error = durable.acquire("k").await.unwrap_err();
    assert_eq!(not_replicated(&error), (1, 0, true), "{error}");
    assert!(error.to_string().contains("acquiring lock `k`"), "{error}");
    assert_eq!(durable.remaining("k").await.unwrap(), None);
    let taken = acquired(&plain, "k").await;
    // A contended attempt writes nothing: reported as contended, not as an error.
    assert!(matches!(
        durable.acquire("k").await.unwrap(),
        Acquisition::Contended(_)
    ));
    assert!(plain.release(&taken).await.unwrap());

    // An extend that did not reach the replica releases the lock too.
    let error = durable.extend(&mut before, secs(20)).await.unwrap_err();
    assert_eq!(not_replicated(&error), (1, 0, true), "{error}");
    assert_eq!(durable.remaining("extended-later").await.unwrap(), None);

    // Back in sync: durable acquisitions work again.
    pair.resume_replica().unwrap();
    pair.wait_for_sync().unwrap();
    let lease = acquired(&durable, "k").await;
    assert!(durable.release(&lease).await.unwrap());
}

#[tokio::test]
async fn require_replicas_refuses_missing_replicas_and_servers_without_wait_at_once() {
    // No replica at all: a typed error after the WAIT timeout, not a hang.
    let server = RedisServer::start().unwrap();
    let conn = durable_manager(&server).await;
    let started = std::time::Instant::now();
    let error = locker(conn.clone(), secs(10))
        .require_replicas(1, WAIT)
        .await
        .unwrap_err();
    assert_eq!(not_replicated(&error), (1, 0, false), "{error}");
    assert!(started.elapsed() < secs(5));

    // Bad arguments are configuration errors.
    for (n, timeout) in [(0, WAIT), (1, std::time::Duration::ZERO), (1, secs(3600))] {
        let error = locker(conn.clone(), secs(10))
            .require_replicas(n, timeout)
            .await
            .unwrap_err();
        assert!(matches!(error, Error::Config(_)), "{error:?}");
    }

    // One replica where two are wanted.
    let pair = pair();
    let error = locker(durable_manager(pair.primary()).await, secs(10))
        .require_replicas(2, WAIT)
        .await
        .unwrap_err();
    assert_eq!(not_replicated(&error), (2, 1, false), "{error}");
    // A replica (read-only) does not accept WAIT.
    let error = locker(durable_manager(pair.replica()).await, secs(10))
        .require_replicas(1, WAIT)
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::DurabilityUnsupported { .. }),
        "{error:?}"
    );
    assert!(!error.is_retryable());

    // A server that rejects WAIT (as some managed services do).
    let no_wait = RedisServer::builder()
        .args(["--rename-command", "WAIT", ""])
        .start()
        .unwrap();
    let error = locker(durable_manager(&no_wait).await, secs(10))
        .require_replicas(1, WAIT)
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::DurabilityUnsupported { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("WAIT"), "{error}");
}

#[tokio::test]
async fn on_a_cluster_require_replicas_is_typed_and_wait_follows_the_key() {
    let cluster = lockgate::testing::RedisCluster::start().unwrap();
    let conn = cluster.connection().await.unwrap();
    let error = Locker::new(conn.clone())
        .require_replicas(1, WAIT)
        .await
        .unwrap_err();
    assert_eq!(not_replicated(&error), (1, 0, false), "{error}");

    // What durable locks rely on there: redis-rs sends a pipeline of a keyed
    // script and a keyless WAIT to the key's node, both on one connection.
    let locker = Locker::new(conn.clone());
    let reset = async || {
        for node in cluster.nodes() {
            redis::cmd("CONFIG")
                .arg("RESETSTAT")
                .exec_async(&mut node.multiplexed().await.unwrap())
                .await
                .unwrap();
        }
    };
    reset().await; // forget require_replicas' WAIT, which went to every primary
    for key in ["a", "b", "c", "d", "e", "f"] {
        let mut pipe = redis::pipe();
        pipe.cmd("EVAL")
            .arg("return redis.call('SET', KEYS[1], '1')")
            .arg(1)
            .arg(locker.lock_key(key))
            .cmd("WAIT")
            .arg(0)
            .arg(10);
        let _: (String, i64) = pipe.query_async(&mut conn.clone()).await.unwrap();
        for node in cluster.nodes() {
            let mut node_conn = node.multiplexed().await.unwrap();
            let has_key: bool = redis::cmd("EXISTS")
                .arg(locker.lock_key(key))
                .query_async(&mut node_conn)
                .await
                .unwrap_or(false);
            let stats: String = redis::cmd("INFO")
                .arg("commandstats")
                .query_async(&mut node_conn)
                .await
                .unwrap();
            let waits = stats.contains("cmdstat_wait:");
            assert_eq!(
                waits,
                has_key,
                "WAIT went to port {} (the node of {key:?}: {has_key})",
                node.port()
            );
        }
        reset().await;
    }
}

// ---------------------------------------------------------------------------
// Item 4: the harness itself
// ---------------------------------------------------------------------------

#[tokio::test]
async fn replica_pair_syncs_cuts_off_promotes_and_kills_frozen_servers_on_drop() {
    let mut pair = pair();
    let primary = durable_manager(pair.primary()).await;
    raw::<()>(&primary, &["SET", "before", "1"]).await;
    pair.wait_for_sync().unwrap();
    let replica = durable_manager(pair.replica()).await;
    assert!(exists(&replica, "before").await);

    // Cut off: the replica misses writes, also after it runs again, and it
    // is not counted by WAIT.
    pair.pause_replica().unwrap();
    raw::<()>(&primary, &["SET", "after", "1"]).await;
    let acked: i64 = raw(&primary, &["WAIT", "1", "100"]).await;
    assert_eq!(acked, 0);
    pair.kill_primary();
    pair.resume_replica().unwrap();
    pair.promote_replica().unwrap();
    let promoted = durable_manager(pair.replica()).await;
    assert!(exists(&promoted, "before").await);
    assert!(!exists(&promoted, "after").await);
    raw::<()>(&promoted, &["SET", "new", "1"]).await; // takes writes now

    // A frozen server is killed on drop, too.
    pair.replica().pause().unwrap();
    let pid = pair.replica().pid().unwrap();
    drop(pair);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "redis-server {pid} outlived its ReplicaPair"
    );
}
