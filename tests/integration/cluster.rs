//! lockgate on a Redis Cluster: locks, queues, the waiter and the worker,
//! with `redis::cluster_async::ClusterConnection` as the connection type,
//! against throwaway three-node clusters (`lockgate::testing::RedisCluster`).
//!
//! Keys are chosen to land on different nodes, and include braces, so that a
//! script touching keys of two slots would fail with `CROSSSLOT` and a
//! command routed to the wrong node with `MOVED`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support;

use lockgate::queue::Wake;
use lockgate::testing::RedisCluster;
use lockgate::{Acquisition, Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use redis::cluster_async::ClusterConnection;
use serde::{Deserialize, Serialize};
use support::Holds;
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Msg {
    n: u32,
    key: String,
}

fn msg(n: u32, key: &str) -> Msg {
    Msg {
        n,
        key: key.to_owned(),
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn cluster() -> RedisCluster {
    RedisCluster::start().expect("a three-node test cluster starts")
}

async fn connect(cluster: &RedisCluster) -> ClusterConnection {
    cluster
        .connection()
        .await
        .expect("connecting to the test cluster")
}

/// The index of the node that serves `key`, asked of the cluster.
async fn node_of(cluster: &RedisCluster, conn: &ClusterConnection, key: &str) -> usize {
    let slot: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut conn.clone())
        .await
        .expect("CLUSTER KEYSLOT");
    cluster.node_of_slot(slot)
}

/// Whether `key` exists, asked of node `node` alone (a node that does not
/// serve the key answers `MOVED`, which fails the test).
async fn exists_on(cluster: &RedisCluster, node: usize, key: &str) -> bool {
    let mut conn = cluster.nodes()[node]
        .multiplexed()
        .await
        .expect("connecting to one node");
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<i64>(&mut conn)
        .await
        .unwrap_or_else(|e| panic!("EXISTS {key:?} on node {node}: {e}"))
        == 1
}

/// Every key on every node, by node.
async fn keys_by_node(cluster: &RedisCluster) -> Vec<BTreeSet<String>> {
    let mut out = Vec::new();
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.expect("connecting to one node");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut conn)
            .await
            .expect("KEYS *");
        out.push(keys.into_iter().collect());
    }
    out
}

/// The hash tag lockgate gives a user's key or queue name (documented in
/// `src/keys.rs`: `\` becomes `\\` and `}` becomes `\)`).
fn tag(name: &str) -> String {
    name.replace('\\', "\\\\").replace('}', "\\)")
}

/// `INFO <section>` of each node, in order.
async fn info_by_node(cluster: &RedisCluster, section: &str) -> Vec<String> {
    let mut out = Vec::new();
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.expect("connecting to one node");
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("INFO {section}: {e}"));
        out.push(info);
    }
    out
}

/// Blocked clients per node (`INFO clients`).
async fn blocked_clients(cluster: &RedisCluster) -> Vec<u64> {
    let info = info_by_node(cluster, "clients").await;
    (info.iter())
        .map(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("blocked_clients:"))
                .and_then(|n| n.trim().parse().ok())
                .expect("INFO clients reports blocked_clients")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_cluster_serves_every_slot_from_its_own_nodes() {
    assert!(
        RedisCluster::builder().nodes(0).start().is_err(),
        "a cluster without nodes must not start"
    );
    let cluster = cluster();
    assert_eq!(cluster.nodes().len(), 3);
    assert_eq!(cluster.urls().len(), 3);
    let ports: BTreeSet<u16> = cluster.nodes().iter().map(|n| n.port()).collect();
    assert_eq!(ports.len(), 3);
    assert!(!ports.contains(&6379));
    for (i, url) in cluster.urls().iter().enumerate() {
        assert_eq!(*url, cluster.nodes()[i].url());
    }
    assert_eq!(cluster.node_of_slot(0), 0);
    assert_eq!(cluster.node_of_slot(16383), 2);

    // Every node agrees the cluster is healthy and knows the others.
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.unwrap();
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(info.contains("cluster_state:ok"), "{info}");
        assert!(info.contains("cluster_known_nodes:3"), "{info}");
        assert!(info.contains("cluster_slots_assigned:16384"), "{info}");
    }

    // Through the cluster client, plain keys spread over all nodes, and each
    // lives where `node_of_slot` says.
    let conn = connect(&cluster).await;
    let mut used = BTreeSet::new();
    for i in 0..30 {
        let key = format!("spread-{i}");
        redis::cmd("SET")
            .arg(&key)
            .arg(i)
            .exec_async(&mut conn.clone())
            .await
            .unwrap();
        let node = node_of(&cluster, &conn, &key).await;
        assert!(exists_on(&cluster, node, &key).await);
        used.insert(node);
    }
    assert_eq!(used.len(), 3, "30 keys should reach all three nodes");
}

/// Keys for the lock tests: braces and backslashes in every position, and
/// enough plain keys to reach every node.
fn lock_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "a}b",
        "{x}",
        "}",
        "{",
        "{}",
        "}{",
        "a{b}c",
        "\\",
        "\\)",
        "}x{",
        "ключ",
        "with space",
    ]
    .iter()
    .map(|k| k.to_string())
    .collect();
    let mut i = 0;
    while keys.len() < 50 {
        keys.push(format!("account-{i}"));
        i += 1;
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_acquire_extend_release_and_fence_on_every_node() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let ttl = Duration::from_secs(10);
    let locker = Locker::new(conn.clone()).ttl(ttl).unwrap();
    // A second holder, on a connection of its own.
    let rival = Locker::new(connect(&cluster).await).ttl(ttl).unwrap();
    let mut nodes_used = BTreeSet::new();

    for key in lock_keys() {
        let lease = locker
            .acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("acquiring {key:?}: {e}"))
            .lease()
            .unwrap_or_else(|| panic!("{key:?} was free"));
        assert_eq!(lease.key(), key);
        // The fence (and its record) are made on the lock's node.
        let fence = locker.fence(&lease).await.unwrap();

        // The lock sits where the cluster says.
        let node = node_of(&cluster, &conn, &locker.lock_key(&key)).await;
        assert!(exists_on(&cluster, node, &locker.lock_key(&key)).await);
        nodes_used.insert(node);

        match rival.acquire(&key).await.unwrap() {
            Acquisition::Contended(busy) => {
                assert_eq!(busy.key(), key);
                assert!(busy.retry_after() > Duration::ZERO && busy.retry_after() <= ttl);
            }
            Acquisition::Acquired(_) => panic!("{key:?} was acquired twice"),
        }

        let mut lease = lease;
        assert!(locker.extend(&mut lease, ms(30_000)).await.unwrap());
        let left = locker.remaining(&key).await.unwrap().expect("held");
        assert!(left > ttl, "extend did not reach the lock of {key:?}");

        assert!(locker.release(&lease).await.unwrap());
        // The released lock is gone; its fence stays on record, on the
        // lock's node.
        assert!(!exists_on(&cluster, node, &locker.lock_key(&key)).await);
        let record = locker.fence_key(&key);
        assert_eq!(node_of(&cluster, &conn, &record).await, node);
        assert!(exists_on(&cluster, node, &record).await);
        assert_eq!(locker.remaining(&key).await.unwrap(), None);
        // A second release (a resend) is idempotent: reported released.
        assert!(locker.release(&lease).await.unwrap(), "a resent release");
        assert!(!locker.extend(&mut lease, ttl).await.unwrap());
        assert_eq!(locker.remaining(&key).await.unwrap(), None);

        // The next holder's fence is higher.
        let next = rival
            .acquire(&key)
            .await
            .unwrap()
            .lease()
            .unwrap_or_else(|| panic!("{key:?} was released"));
        let next_fence = rival.fence(&next).await.unwrap();
        assert!(
            next_fence > fence,
            "fence of {key:?} went from {fence} to {next_fence}"
        );
        // The old lease can neither release nor extend the new holder's lock.
        assert!(!locker.release(&lease).await.unwrap());
        assert!(!locker.extend(&mut lease, ttl).await.unwrap());
        assert!(locker.remaining(&key).await.unwrap().is_some());
        assert!(rival.release(&next).await.unwrap());
    }
    assert_eq!(nodes_used.len(), 3, "the lock keys should reach every node");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_lockers_exclude_each_other_per_key() {
    let cluster = cluster();
    let hot = ["a}b", "{x}", "plain", "k{y}z"];
    let holders: Arc<HashMap<&str, AtomicUsize>> =
        Arc::new(hot.iter().map(|k| (*k, AtomicUsize::new(0))).collect());
    let fences: Arc<Mutex<HashMap<String, Vec<u64>>>> = Default::default();
    let rounds = 30;
    let tasks = 4;
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        // Each task on its own connection, as separate processes would be.
        let locker = Locker::new(connect(&cluster).await)
            .ttl(Duration::from_secs(10))
            .unwrap();
        let (holders, fences) = (holders.clone(), fences.clone());
        set.spawn(async move {
            for round in 0..rounds {
                let key = hot[(t + round) % hot.len()];
                let lease = loop {
                    match locker.acquire(key).await.unwrap() {
                        Acquisition::Acquired(lease) => break lease,
                        Acquisition::Contended(_) => tokio::time::sleep(ms(1)).await,
                    }
                };
                let fence = locker.fence(&lease).await.unwrap();
                let inside = holders[key].fetch_add(1, Ordering::SeqCst);
                assert_eq!(inside, 0, "two holders of {key:?} at once");
                fences
                    .lock()
                    .unwrap()
                    .entry(key.to_owned())
                    .or_default()
                    .push(fence);
                tokio::time::sleep(ms(2)).await;
                holders[key].fetch_sub(1, Ordering::SeqCst);
                assert!(locker.release(&lease).await.unwrap());
            }
        });
    }
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(joined) = set.join_next().await {
            joined.expect("a locking task failed");
        }
    })
    .await
    .expect("the lockers finished in time");

    let fences = fences.lock().unwrap();
    assert_eq!(
        fences.values().map(Vec::len).sum::<usize>(),
        tasks * rounds,
        "every round held its lock once"
    );
    for (key, list) in fences.iter() {
        // Recorded inside the critical section, so in acquisition order.
        assert!(
            list.windows(2).all(|w| w[0] < w[1]),
            "fences of {key:?} did not increase: {list:?}"
        );
    }
}

/// Walks one queue through every operation, asserting as it goes. Its keys
/// must all live on `node`.
async fn exercise_queue(cluster: &RedisCluster, queue: Queue<Msg, ClusterConnection>, node: usize) {
    let name = queue.name().to_owned();
    let k = |n: u32| msg(n, &name);
    let lease = Duration::from_secs(30);

    // Push, de-duplicate, push many, push later.
    let first = queue.push(k(0)).await.unwrap();
    assert!(first.created && first.due.is_some());
    let fixed = queue
        .push_with(k(1), lockgate::PushOptions::new().id("fixed"))
        .await
        .unwrap();
    assert!(fixed.created);
    assert_eq!(fixed.id, "fixed");
    let again = queue
        .push_with(k(99), lockgate::PushOptions::new().id("fixed"))
        .await
        .unwrap();
    assert!(!again.created, "an existing id must not be pushed twice");
    let many = queue.push_many((2..7).map(k)).await.unwrap();
    assert_eq!(many.len(), 5);
    assert!(many.iter().all(|p| p.created));
    let later = queue
        .push_after(k(7), Duration::from_secs(600))
        .await
        .unwrap();
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (7, 1, 0, 0)
    );

    // Every key of the queue is on its node, and only there.
    let expected_prefix = format!("lockgate:{{{}}}:", tag(&name));
    for (i, keys) in keys_by_node(cluster).await.iter().enumerate() {
        let ours = keys
            .iter()
            .filter(|key| key.starts_with(&expected_prefix))
            .count();
        if i == node {
            assert!(
                ours >= 2,
                "queue {name:?} has no keys on node {i}: {keys:?}"
            );
        } else {
            assert_eq!(ours, 0, "queue {name:?} has keys on node {i}: {keys:?}");
        }
    }

    // Claim everything due, in order.
    let claimed = queue.claim(100, lease).await.unwrap();
    assert_eq!(claimed.buried, 0);
    let next_due = claimed.next_due.expect("the later message is scheduled");
    assert!(next_due > Duration::from_secs(500));
    let mut jobs = claimed.jobs;
    assert!(
        jobs.windows(2).all(|w| w[0].due_at() <= w[1].due_at()),
        "claimed out of due order"
    );
    jobs.sort_by_key(|j| j.n);
    let ns: Vec<u32> = jobs.iter().map(|j| j.n).collect();
    assert_eq!(ns, (0..7).collect::<Vec<_>>());
    assert!(jobs.iter().all(|j| j.key == name && j.attempt() == 1));
    assert_eq!(jobs[1].id(), "fixed");
    assert_eq!(queue.stats().await.unwrap().active, 7);

    // Ack, once.
    assert!(queue.ack(&jobs[0]).await.unwrap());
    assert!(!queue.ack(&jobs[0]).await.unwrap(), "acked twice");
    assert_eq!(
        queue.ack_many([&jobs[1], &jobs[2]]).await.unwrap(),
        [true, true]
    );
    // Retry, defer, bury, extend.
    assert!(
        queue
            .retry(&jobs[3], ms(0), "boom")
            .await
            .unwrap()
            .is_some()
    );
    assert!(queue.defer(&jobs[4], ms(0)).await.unwrap().is_some());
    assert!(queue.bury(&jobs[5], "fatal").await.unwrap());
    assert!(
        !queue.bury(&jobs[5], "fatal").await.unwrap(),
        "buried twice"
    );
    assert_eq!(queue.extend([&jobs[6]], lease).await.unwrap(), [true]);
    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (2, 1, 1, 1)
    );

    // The retried message counts a failed attempt, the deferred one a deferral.
    let back = queue.claim(10, lease).await.unwrap().jobs;
    let by_n: BTreeMap<u32, &Job<Msg>> = back.iter().map(|j| (j.n, j)).collect();
    assert_eq!(by_n.keys().copied().collect::<Vec<_>>(), [3, 4]);
    assert_eq!((by_n[&3].attempt(), by_n[&3].deferrals()), (2, 0));
    assert_eq!((by_n[&4].attempt(), by_n[&4].deferrals()), (1, 1));
    assert!(queue.ack(by_n[&4]).await.unwrap());

    // A lease that runs out is recovered: back on the schedule, one more
    // failed attempt.
    assert!(
        queue
            .retry(by_n[&3], ms(0), "boom")
            .await
            .unwrap()
            .is_some()
    );
    let short = queue.claim(10, ms(50)).await.unwrap().jobs;
    assert_eq!(short.len(), 1);
    assert_eq!(short[0].attempt(), 3);
    tokio::time::sleep(ms(150)).await;
    let recovered = queue.recover(10).await.unwrap();
    assert_eq!((recovered.requeued, recovered.buried), (1, 0));
    assert!(
        !queue.ack(&short[0]).await.unwrap(),
        "an expired claim acked"
    );

    // Dead letters: listed with their error, re-driven one by one or all.
    let dead = queue.dead_letters(None, 100).await.unwrap().letters;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, jobs[5].id());
    assert_eq!(dead[0].error.as_deref(), Some("fatal"));
    assert_eq!((dead[0].failures, dead[0].deferrals), (1, 0));
    assert_eq!(dead[0].decode::<Msg>().unwrap(), k(5));
    assert!(queue.requeue_dead(jobs[5].id()).await.unwrap());
    assert!(!queue.requeue_dead(jobs[5].id()).await.unwrap());
    assert_eq!(queue.stats().await.unwrap().dead, 0);
    let both = queue.claim(10, lease).await.unwrap().jobs;
    let mut ns: Vec<u32> = both.iter().map(|j| j.n).collect();
    ns.sort();
    assert_eq!(ns, [3, 5]);
    for job in &both {
        assert!(queue.bury(job, "again").await.unwrap());
    }
    assert_eq!(
        queue.dead_letters(None, 100).await.unwrap().letters.len(),
        2
    );
    assert_eq!(queue.requeue_all_dead().await.unwrap(), 2);

    // Remove a scheduled message; a claimed one is left to its worker.
    let three = both.iter().find(|j| j.n == 3).unwrap().id().to_owned();
    assert!(queue.remove(&three).await.unwrap());
    assert!(
        !queue.remove(jobs[6].id()).await.unwrap(),
        "removed a claimed message"
    );
    let last = queue.claim(10, lease).await.unwrap().jobs;
    assert_eq!(last.iter().map(|j| j.n).collect::<Vec<_>>(), [5]);
    assert_eq!(last[0].attempt(), 1, "re-driving resets the attempts");
    assert!(queue.ack(&last[0]).await.unwrap());
    assert!(queue.ack(&jobs[6]).await.unwrap());

    let stats = queue.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (0, 1, 0, 0)
    );
    assert!(queue.remove(&later.id).await.unwrap());
    queue.push(k(8)).await.unwrap();
    queue.purge().await.unwrap();
    assert_eq!(queue.stats().await.unwrap(), Default::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_queue_operation_stays_in_one_slot() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let data_key = |name: &str| format!("lockgate:{{{}}}:data", tag(name));

    // Two names with braces, served by different nodes.
    let a = "orders{eu}";
    let node_a = node_of(&cluster, &conn, &data_key(a)).await;
    let mut b = None;
    for candidate in ["}jobs{", "{", "}", "a}b{c", "{mail}", "x}y", "{}{}", "q{1}"] {
        let node = node_of(&cluster, &conn, &data_key(candidate)).await;
        if node != node_a {
            b = Some((candidate, node));
            break;
        }
    }
    let (b, node_b) = b.expect("a candidate name on another node");

    // With events and completed retention on, so that every script's
    // optional keys are exercised in the queue's slot too.
    let queue_a: Queue<Msg, _> = Queue::new(conn.clone(), a)
        .unwrap()
        .record_events(1000)
        .unwrap()
        .keep_completed(Some(10), None)
        .unwrap();
    let queue_b: Queue<Msg, _> = Queue::new(connect(&cluster).await, b).unwrap();
    // Both at once, so that their commands interleave on the cluster.
    tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(
            exercise_queue(&cluster, queue_a, node_a),
            exercise_queue(&cluster, queue_b, node_b),
        )
    })
    .await
    .expect("the queue walk-through finished in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priorities_and_events_work_on_the_cluster() {
    use futures_util::StreamExt;
    use lockgate::PushOptions;
    use lockgate::queue::{EventKind, EventsFrom};

    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<Msg, _> = Queue::new(conn, "prio{eu}")
        .unwrap()
        .record_events(1000)
        .unwrap();
    let mut events = Box::pin(
        queue
            .events(cluster.client(), EventsFrom::Beginning)
            .await
            .unwrap(),
    );
    let priorities = [0u8, 4, 9, 0, 4, 9, 1];
    for (n, p) in priorities.iter().enumerate() {
        queue
            .push_with(msg(n as u32, "prio"), PushOptions::new().priority(*p))
            .await
            .unwrap();
    }
    queue
        .push_with(
            msg(99, "prio"),
            PushOptions::new().priority(9).after(ms(100)),
        )
        .await
        .unwrap();
    let first = queue.claim(100, Duration::from_secs(30)).await.unwrap();
    let order: Vec<(u8, u32)> = first.jobs.iter().map(|j| (j.priority(), j.n)).collect();
    assert_eq!(
        order,
        [(9, 2), (9, 5), (4, 1), (4, 4), (1, 6), (0, 0), (0, 3)]
    );
    tokio::time::sleep(ms(150)).await;
    let later = queue.claim(100, Duration::from_secs(30)).await.unwrap();
    assert_eq!(later.jobs.len(), 1);
    assert_eq!((later.jobs[0].priority(), later.jobs[0].n), (9, 99));
    queue
        .ack_many(first.jobs.iter().chain(&later.jobs))
        .await
        .unwrap();

    let mut kinds: HashMap<EventKind, usize> = HashMap::new();
    while kinds.values().sum::<usize>() < 24 {
        let event = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .expect("an event in time")
            .unwrap()
            .unwrap();
        *kinds.entry(event.kind).or_default() += 1;
    }
    assert_eq!(kinds[&EventKind::Pushed], 8);
    assert_eq!(kinds[&EventKind::Claimed], 8);
    assert_eq!(kinds[&EventKind::Done], 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_waiter_wakes_on_a_push() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<Msg, _> = Queue::new(conn, "wake{up}").unwrap();
    let mut waiter = queue.waiter(cluster.client());

    // Nothing pushed: the deadline ends the wait.
    let started = Instant::now();
    let woke = waiter.wait(Some(started + ms(100))).await.unwrap();
    assert_eq!(woke, Wake::Deadline);
    assert!(started.elapsed() >= ms(100) && started.elapsed() < ms(1000));

    for round in 0..3 {
        let pusher = queue.clone();
        let push = tokio::spawn(async move {
            tokio::time::sleep(ms(200)).await;
            pusher.push(msg(round, "wake")).await.unwrap();
        });
        let started = Instant::now();
        let woke = waiter
            .wait(Some(started + Duration::from_secs(10)))
            .await
            .unwrap();
        let waited = started.elapsed();
        push.await.unwrap();
        assert_eq!(woke, Wake::Rung, "round {round}");
        // Well before the server-side block (2 s) would have ended on its own.
        assert!(
            waited >= ms(150) && waited < ms(1500),
            "round {round}: woke after {waited:?}"
        );
        let claimed = queue.claim(10, Duration::from_secs(5)).await.unwrap().jobs;
        assert_eq!(claimed.len(), 1);
        assert!(queue.ack(&claimed[0]).await.unwrap());
    }
}

/// After `wait` returned on its deadline, its `BLPOP` must not stay blocked
/// on the bell's node (it would take a ring meant for an idle waiter).
/// Regression: the unblock once used `CLIENT ID`/`CLIENT UNBLOCK`, which
/// carry no key and reached random nodes; the waiter now pokes a list of its
/// own in the bell's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cluster_waiter_unblocks_its_blpop_after_a_deadline() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<Msg, _> = Queue::new(conn, "wake{up}").unwrap();
    let mut waiter = queue.waiter(cluster.client());
    let mut stuck = 0;
    for _ in 0..20 {
        let woke = waiter.wait(Some(Instant::now() + ms(50))).await.unwrap();
        assert_eq!(woke, Wake::Deadline);
        // The poke lands within a millisecond or two.
        tokio::time::sleep(ms(100)).await;
        if blocked_clients(&cluster).await.iter().sum::<u64>() > 0 {
            stuck += 1;
        }
    }
    assert_eq!(
        stuck, 0,
        "{stuck} of 20 BLPOPs stayed blocked after `wait` returned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_on_the_cluster_handle_every_message_once_with_per_key_exclusion() {
    let cluster = cluster();
    let name = "orders{eu}";
    let hot = ["a}b", "{x}", "plain", "k{y}z", "}"];
    let total: u32 = 300;
    let producer: Queue<Msg, _> = Queue::new(connect(&cluster).await, name).unwrap();
    let msgs: Vec<Msg> = (0..total)
        .map(|n| msg(n, hot[n as usize % hot.len()]))
        .collect();
    producer.push_many(&msgs).await.unwrap();

    let holds = Holds::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    let mut metrics = Vec::new();
    for _ in 0..2 {
        // Each worker on its own connection, as in two processes.
        let conn = connect(&cluster).await;
        let queue: Queue<Msg, _> = Queue::new(conn.clone(), name).unwrap();
        let locker = Locker::new(conn).ttl(Duration::from_secs(5)).unwrap();
        let backoff = Backoff::exponential(ms(1), ms(5)).unwrap().max_attempts(3);
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
                    tokio::time::sleep(ms(2)).await;
                    holds.record(&job.key, job.n, start, Instant::now());
                    Ok::<_, BoxError>(())
                }
            });
        let worker = Worker::new(cluster.client(), queue, service)
            .concurrency(8)
            .unwrap()
            .lease(Duration::from_secs(10))
            .unwrap();
        metrics.push(worker.metrics());
        let mut stop = stop_rx.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    while holds.handled() < total as usize {
        assert!(
            Instant::now() < deadline,
            "only {} of {total} messages were handled in time",
            holds.handled()
        );
        tokio::time::sleep(ms(20)).await;
    }
    stop_tx.send(true).unwrap();
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(30), worker)
            .await
            .expect("the worker shut down in time")
            .unwrap()
            .unwrap();
    }

    holds.assert_each_once(total as usize);
    holds.assert_exclusive();
    let stats = producer.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (0, 0, 0, 0)
    );
    let snapshots: Vec<_> = metrics.iter().map(|m| m.snapshot()).collect();
    let done: u64 = snapshots.iter().map(|s| s.done).sum();
    assert_eq!(done, u64::from(total), "{snapshots:?}");
    // Five hot keys under sixteen handlers: the deferral path (reschedule in
    // place, on the cluster) is taken, typically for about half the claims.
    let deferred: u64 = snapshots.iter().map(|s| s.deferred).sum();
    assert!(deferred > 0, "{snapshots:?}");
    assert!(
        snapshots.iter().all(|s| s.dead == 0 && s.lost_leases == 0),
        "{snapshots:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_in_key_lines_on_the_cluster_are_each_handled_once_one_at_a_time_per_key() {
    lines_on_the_cluster(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_in_key_lines_on_the_cluster_are_each_handled_once_two_at_a_time_per_key() {
    lines_on_the_cluster(Some(2)).await;
}

/// 300 messages on 5 hot keys, two workers, deferred into the key's line
/// until the key (or, with `permits`, one of its permits) frees: the lines
/// live on the nodes of the keys' locks, the queue on its own.
async fn lines_on_the_cluster(permits: Option<u32>) {
    let cluster = cluster();
    let name = "lines{eu}";
    let hot = ["a}b", "{x}", "plain", "k{y}z", "}"];
    let total: u32 = 300;
    let producer: Queue<Msg, _> = Queue::new(connect(&cluster).await, name).unwrap();
    let msgs: Vec<Msg> = (0..total)
        .map(|n| msg(n, hot[n as usize % hot.len()]))
        .collect();
    producer.push_many(&msgs).await.unwrap();

    let holds = Holds::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    let mut metrics = Vec::new();
    for _ in 0..2 {
        // Each worker on its own connection, as in two processes.
        let conn = connect(&cluster).await;
        let queue: Queue<Msg, _> = Queue::new(conn.clone(), name).unwrap();
        let locker = Locker::new(conn).ttl(Duration::from_secs(5)).unwrap();
        let backoff = Backoff::exponential(ms(1), ms(5)).unwrap().max_attempts(3);
        let listener = lockgate::ReleaseListener::connect_cluster(
            redis::cluster::ClusterClientBuilder::new(cluster.urls()),
        )
        .await
        .unwrap();
        let holds = holds.clone();
        let mut layer = LockLayer::new(locker, |job: &Job<Msg>| job.key.clone());
        if let Some(n) = permits {
            layer = layer.permits(n).unwrap();
        }
        let service =
            ServiceBuilder::new()
                .layer(
                    layer
                        .on_conflict(OnConflict::retry(backoff).then_defer(
                            queue.clone(),
                            lockgate::layer::DeferDelay::until_released(),
                        ))
                        .wake_on_release(listener),
                )
                .service_fn(move |job: Job<Msg>| {
                    let holds = holds.clone();
                    async move {
                        let start = Instant::now();
                        tokio::time::sleep(ms(2)).await;
                        holds.record(&job.key, job.n, start, Instant::now());
                        Ok::<_, BoxError>(())
                    }
                });
        let worker = Worker::new(cluster.client(), queue, service)
            .concurrency(8)
            .unwrap()
            .lease(Duration::from_secs(10))
            .unwrap();
        metrics.push(worker.metrics());
        let mut stop = stop_rx.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stop.wait_for(|s| *s).await;
        })));
    }

    let deadline = Instant::now() + Duration::from_secs(60);
    while holds.handled() < total as usize {
        assert!(
            Instant::now() < deadline,
            "only {} of {total} messages were handled in time",
            holds.handled()
        );
        tokio::time::sleep(ms(20)).await;
    }
    stop_tx.send(true).unwrap();
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(30), worker)
            .await
            .expect("the worker shut down in time")
            .unwrap()
            .unwrap();
    }

    holds.assert_each_once(total as usize);
    match permits {
        None => holds.assert_exclusive(),
        Some(n) => {
            let most = holds.most_at_once();
            assert!(
                most.values().all(|&m| m <= n as usize),
                "more than {n} at once: {most:?}"
            );
            assert!(
                most.values().any(|&m| m == n as usize),
                "never {n} at once: {most:?}"
            );
        }
    }
    let stats = producer.stats().await.unwrap();
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (0, 0, 0, 0)
    );
    let snapshots: Vec<_> = metrics.iter().map(|m| m.snapshot()).collect();
    let done: u64 = snapshots.iter().map(|s| s.done).sum();
    assert_eq!(done, u64::from(total), "{snapshots:?}");
    // A message joins its key's line once at most, however long it waits:
    // one deferral per message at most.
    let deferred: u64 = snapshots.iter().map(|s| s.deferred).sum();
    assert!(deferred <= u64::from(total), "{snapshots:?}");
    assert!(
        snapshots.iter().all(|s| s.dead == 0 && s.lost_leases == 0),
        "{snapshots:?}"
    );
}

/// Script and function calls (`EVALSHA`/`EVAL`/`FCALL`) all nodes have run
/// so far.
async fn script_calls_on(cluster: &RedisCluster) -> u64 {
    let mut calls = 0;
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.unwrap();
        let on_node = lockgate::testing::command_calls(&mut conn).await.unwrap();
        calls += ["evalsha", "eval", "fcall"]
            .iter()
            .filter_map(|c| on_node.get(*c))
            .sum::<u64>();
    }
    calls
}

/// Wake on release on a cluster: the release script's `SPUBLISH` reaches
/// the listener's `SSUBSCRIBE` on the node of each key, so waiters on keys
/// of every node sleep without polling and run once their key is released.
/// The listener is the one `Locker::connect_cluster` opens by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_every_node_are_woken_by_the_release() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let ttl = Duration::from_secs(30);
    let holder = Locker::new(connect(&cluster).await).ttl(ttl).unwrap();
    let keys: Vec<String> = lock_keys().into_iter().take(15).collect();
    let mut nodes = BTreeSet::new();
    let mut leases = Vec::new();
    for key in &keys {
        nodes.insert(node_of(&cluster, &conn, &holder.lock_key(key)).await);
        leases.push(holder.acquire(key).await.unwrap().lease().expect("free"));
    }
    assert_eq!(nodes.len(), 3, "the keys reach every node");

    let urls = cluster.urls();
    let locker =
        Locker::connect_cluster(move || redis::cluster::ClusterClientBuilder::new(urls.clone()))
            .await
            .unwrap()
            .ttl(ttl)
            .unwrap();
    // A backoff that would poll every millisecond, were the waiters not woken.
    let backoff = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(Duration::from_secs(20));
    let svc = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker, |k: &String| k.clone()).on_conflict(OnConflict::retry(backoff)),
        )
        .service_fn(|k: String| async move { Ok::<_, BoxError>(k) });
    let calls: Vec<_> = keys
        .iter()
        .map(|key| tokio::spawn(tower::ServiceExt::oneshot(svc.clone(), key.clone())))
        .collect();
    // Every waiter has marked its lock.
    support::eventually("all waiters wait", support::BOUNDED, async || {
        let mut marked = 0;
        for key in &keys {
            let value: Option<String> = redis::cmd("GET")
                .arg(holder.lock_key(key))
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            marked += usize::from(value.is_some_and(|v| v.ends_with('!')));
        }
        support::done_if(marked == keys.len(), marked)
    })
    .await;
    // No polling: a waiter that polled would try every millisecond. (A
    // waiter may still make one try of its own, the one after its
    // subscription is ready, when a loaded machine delays that: CI saw one
    // such call in this window once.)
    let before = script_calls_on(&cluster).await;
    tokio::time::sleep(ms(300)).await;
    let tries = script_calls_on(&cluster).await - before;
    assert!(
        tries <= keys.len() as u64,
        "waiters polled while the holder was alive: {tries} script calls"
    );
    assert!(calls.iter().all(|c| !c.is_finished()));
    for lease in &leases {
        assert!(holder.release(lease).await.unwrap());
    }
    for (call, key) in calls.into_iter().zip(&keys) {
        let outcome = tokio::time::timeout(support::BOUNDED, call)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(outcome.done().as_ref(), Some(key));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_on_every_node_limit_fence_and_wake() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let ttl = Duration::from_secs(30);
    let holder = Locker::new(connect(&cluster).await).ttl(ttl).unwrap();
    let keys: Vec<String> = lock_keys().into_iter().take(15).collect();
    let mut nodes = BTreeSet::new();
    let mut leases = Vec::new();
    for key in &keys {
        let node = node_of(&cluster, &conn, &holder.permits_key(key)).await;
        nodes.insert(node);
        // Both permits of the key; a third caller is refused.
        for _ in 0..2 {
            let lease = holder.acquire_permit(key, 2).await.unwrap().lease();
            let lease = lease.unwrap_or_else(|| panic!("{key:?} had a free permit"));
            // The fence (and the record of fences) live on the set's node.
            holder.fence(&lease).await.unwrap();
            leases.push(lease);
        }
        assert!(exists_on(&cluster, node, &holder.permits_key(key)).await);
        assert!(
            exists_on(
                &cluster,
                node,
                &format!("{}:fences", holder.permits_key(key))
            )
            .await
        );
        match holder.acquire_permit(key, 2).await.unwrap() {
            Acquisition::Contended(busy) => assert!(busy.retry_after() <= ttl),
            Acquisition::Acquired(_) => panic!("a third permit of {key:?}"),
        }
        assert_eq!(holder.permit_holders(key).await.unwrap().len(), 2);
    }
    assert_eq!(nodes.len(), 3, "the keys reach every node");

    let listener = lockgate::ReleaseListener::connect_cluster(
        redis::cluster::ClusterClientBuilder::new(cluster.urls()),
    )
    .await
    .unwrap();
    let backoff = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(Duration::from_secs(20));
    let svc = ServiceBuilder::new()
        .layer(
            LockLayer::new(Locker::new(conn.clone()).ttl(ttl).unwrap(), |k: &String| {
                k.clone()
            })
            .permits(2)
            .unwrap()
            .on_conflict(OnConflict::retry(backoff))
            .wake_on_release(listener),
        )
        .service_fn(|k: String| async move { Ok::<_, BoxError>(k) });
    let calls: Vec<_> = keys
        .iter()
        .map(|key| tokio::spawn(tower::ServiceExt::oneshot(svc.clone(), key.clone())))
        .collect();
    // Every waiter stands in its key's line.
    support::eventually("all waiters wait", support::BOUNDED, async || {
        let mut marked = 0;
        for key in &keys {
            let mark: bool = redis::cmd("EXISTS")
                .arg(format!("{}:waiters", holder.permits_key(key)))
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            marked += usize::from(mark);
        }
        support::done_if(marked == keys.len(), marked)
    })
    .await;
    let before = script_calls_on(&cluster).await;
    tokio::time::sleep(ms(300)).await;
    assert_eq!(
        script_calls_on(&cluster).await - before,
        0,
        "waiters polled while the holders were alive"
    );
    // One permit of each key back: its waiter gets it.
    for lease in leases.iter().step_by(2) {
        assert!(holder.release(lease).await.unwrap());
    }
    for (call, key) in calls.into_iter().zip(&keys) {
        let outcome = tokio::time::timeout(support::BOUNDED, call)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(outcome.done().as_ref(), Some(key));
    }
    for lease in leases.iter().skip(1).step_by(2) {
        assert!(holder.release(lease).await.unwrap());
    }
    for key in &keys {
        assert!(holder.permit_holders(key).await.unwrap().is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_on_every_node_admit_refuse_and_reserve() {
    use lockgate::lock::rate::{Admission, Rate};
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let locker = Locker::new(conn.clone());
    let rate = Rate::new(2, Duration::from_secs(10)).unwrap();
    let mut nodes = BTreeSet::new();
    for key in lock_keys().into_iter().take(15) {
        let node = node_of(&cluster, &conn, &locker.rate_key(&key)).await;
        nodes.insert(node);
        for _ in 0..2 {
            let admission = locker.admit(&key, &rate).await.unwrap();
            assert!(
                matches!(admission, Admission::Admitted(_)),
                "{key:?}: {admission:?}"
            );
        }
        // The log sits on the key's node.
        assert!(exists_on(&cluster, node, &locker.rate_key(&key)).await);
        match locker.admit(&key, &rate).await.unwrap() {
            Admission::Limited(busy) => {
                assert!(busy.retry_after() <= Duration::from_secs(10), "{busy:?}")
            }
            Admission::Admitted(_) => panic!("a third admission of {key:?} within the period"),
        }
    }
    assert_eq!(nodes.len(), 3, "the keys reach every node");
}

/// A release script on a cluster node sees whether a waiter's process still
/// listens: the presence channel (`<lock key>#<tag>`) has the lock key's
/// hash tag, so `SSUBSCRIBE` puts it on the key's node, where the script's
/// `PUBSUB SHARDNUMSUB` counts it. A waiter's line entry names its process
/// by its token's first 8 characters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_script_sees_a_waiting_process_s_presence_on_the_key_s_node() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let holder = Locker::new(connect(&cluster).await)
        .ttl(Duration::from_secs(30))
        .unwrap();
    for key in lock_keys().into_iter().take(6) {
        let lease = holder.acquire(&key).await.unwrap().lease().expect("free");
        let urls = cluster.urls();
        let locker = Locker::connect_cluster(move || {
            redis::cluster::ClusterClientBuilder::new(urls.clone())
        })
        .await
        .unwrap();
        let backoff = Backoff::exponential(ms(1), ms(1))
            .unwrap()
            .unlimited_attempts()
            .max_elapsed(Duration::from_secs(20));
        let svc = ServiceBuilder::new()
            .layer(
                LockLayer::new(locker, |k: &String| k.clone())
                    .on_conflict(OnConflict::retry(backoff)),
            )
            .service_fn(|k: String| async move { Ok::<_, BoxError>(k) });
        let call = tokio::spawn(tower::ServiceExt::oneshot(svc, key.clone()));
        let line = format!("{}:waiters", holder.lock_key(&key));
        let mut member = String::new();
        support::eventually("the waiter stands in line", support::BOUNDED, async || {
            let first: Vec<String> = redis::cmd("ZRANGE")
                .arg(&line)
                .arg(0)
                .arg(0)
                .query_async(&mut conn.clone())
                .await
                .unwrap();
            member = first.first().cloned().unwrap_or_default();
            support::done_if(!member.is_empty(), &first)
        })
        .await;
        let listening: Vec<redis::Value> = redis::Script::new(
            "return redis.call('PUBSUB', 'SHARDNUMSUB', KEYS[1] .. '#' .. string.sub(ARGV[1], 1, 8))",
        )
        .key(holder.lock_key(&key))
        .arg(&member)
        .invoke_async(&mut conn.clone())
        .await
        .unwrap();
        assert_eq!(
            listening.get(1),
            Some(&redis::Value::Int(1)),
            "{key}: {listening:?}"
        );
        assert!(holder.release(&lease).await.unwrap());
        assert_eq!(call.await.unwrap().unwrap(), lockgate::Outcome::Done(key));
    }
}

#[tokio::test]
async fn delete_prefix_with_each_master_deletes_keys_of_many_slots() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let locker = Locker::new(conn.clone()).prefix("throwaway").unwrap();
    let mut held = Vec::new();
    for n in 0..30 {
        held.push(
            locker
                .acquire(&format!("key{n}"))
                .await
                .unwrap()
                .lease()
                .unwrap(),
        );
    }
    std::mem::forget(held);
    let mut deleted = 0;
    for node in cluster.nodes() {
        let master = node.connection_manager().await.unwrap();
        deleted += lockgate::delete_prefix(&master, "throwaway").await.unwrap();
    }
    assert_eq!(deleted, 30);
    assert!(keys_by_node(&cluster).await.iter().all(BTreeSet::is_empty));
}

/// Issue 37, item 1, on a cluster: keyed messages whose partitions the
/// queue's index does not name (a producer stopped between its push and
/// its index step; here the index is deleted after the pushes) are found
/// by the workers' sweep within its period, each handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_partitions_missing_from_the_index_are_found_on_a_cluster() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "unindexed").unwrap();
    for n in 0..12u64 {
        let options = lockgate::PushOptions::new().key(format!("k{}", n % 6));
        queue.push_with(n, options).await.unwrap();
    }
    let _: () = redis::cmd("DEL")
        .arg("lockgate:{unindexed}:partitions")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let handled = Arc::new(Mutex::new(Vec::new()));
    let seen = handled.clone();
    let service = tower::service_fn(move |job: Job<u64>| {
        seen.lock().unwrap().push(*job);
        async { Ok::<_, BoxError>(()) }
    });
    let worker = Worker::new(cluster.client(), queue, service)
        .lease(Duration::from_millis(300))
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(async move { drop(stopped.await) }));
    // The sweep runs at most every 5 s: within that and its own time.
    support::eventually("every message handled", support::secs(10), async || {
        let n = handled.lock().unwrap().len();
        support::done_if(n == 12, n)
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let mut all = handled.lock().unwrap().clone();
    all.sort_unstable();
    assert_eq!(all, (0..12).collect::<Vec<u64>>(), "each once");
}

/// Issue 35, item 8, on a cluster: each partition's scripts keep its own
/// counts (a script reaches one slot), the handle copies them into the
/// queue's slot, and `stats` reads them there: every keyed message counted
/// in the state it is in, then none after a purge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_counts_are_kept_per_partition_on_a_cluster() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "counted").unwrap();
    let now = (0..40u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(now).await.unwrap();
    let later = (40..50u64).map(|n| {
        let options = lockgate::PushOptions::new().key(format!("k{n}"));
        (n, options.after(Duration::from_secs(600)))
    });
    queue.push_many_with(later).await.unwrap();
    let mut jobs = Vec::new();
    while jobs.len() < 20 {
        let room = 20 - jobs.len();
        jobs.extend(
            queue
                .claim(room, Duration::from_secs(60))
                .await
                .unwrap()
                .jobs,
        );
    }
    for job in &jobs[..5] {
        assert!(queue.ack(job).await.unwrap());
    }
    for job in &jobs[5..8] {
        assert!(queue.bury(job, "no").await.unwrap());
    }
    let stats = queue.stats().await.unwrap();
    let counts = (stats.due, stats.later, stats.active, stats.dead);
    assert_eq!(counts, (20, 10, 12, 3));
    assert!(stats.oldest_due_age.is_some());
    queue.purge().await.unwrap();
    assert_eq!(queue.stats().await.unwrap(), Default::default());
}

/// A claim visits at most 32 partitions: with more of them holding work (on
/// a cluster, a partition per slot of the keys' locks), it says more is due
/// now, so that the worker claims again at once rather than waiting for a
/// ring that comes from nowhere, or for the partitions' 30 s recheck.
#[tokio::test]
async fn a_claim_that_left_partitions_with_work_unvisited_says_more_is_due_now() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "unvisited").unwrap();
    // One message for each of 100 keys, whose locks lie in 100 slots.
    let batch = (0..100u64).map(|n| (n, lockgate::PushOptions::new().key(format!("key{n}"))));
    queue.push_many_with(batch).await.unwrap();
    let claimed = queue.claim(1000, Duration::from_secs(10)).await.unwrap();
    let mut total = claimed.jobs.len();
    assert!(total > 0 && total < 100, "{total} claimed");
    assert_eq!(claimed.next_due, Some(Duration::ZERO), "{total} claimed");
    while total < 100 {
        let claimed = queue.claim(1000, Duration::from_secs(10)).await.unwrap();
        assert!(!claimed.jobs.is_empty(), "{total} claimed, then none");
        total += claimed.jobs.len();
    }
}

/// `queue_names` on a cluster: queues whose keys live on different nodes,
/// each asked in its own slot (a pipeline over several slots is refused).
#[tokio::test]
async fn queue_names_lists_queues_on_every_node() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let names: Vec<String> = (0..6).map(|n| format!("listed-{n}")).collect();
    let mut nodes = BTreeSet::new();
    for name in &names {
        let queue: Queue<u64, _> = Queue::new(conn.clone(), name).unwrap();
        queue.push(1).await.unwrap();
        nodes.insert(node_of(&cluster, &conn, &format!("lockgate:{{{}}}:data", tag(name))).await);
    }
    assert!(nodes.len() > 1, "the queues span several nodes: {nodes:?}");
    let listed = lockgate::queue::queue_names(&conn, "lockgate")
        .await
        .unwrap();
    assert_eq!(listed, names);
}

/// On a cluster every primary loads lockgate's libraries (redis-rs sends
/// `FUNCTION LOAD` to each): `delete_stale_functions` deletes an older
/// version's from every one of them, this version's stay, and the keyed
/// queue goes on.
#[tokio::test]
async fn stale_function_libraries_are_deleted_from_every_primary() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let old = "lockgate_keyed_claim_0123456789abcdef0123456789abcdef01234567";
    let source =
        format!("#!lua name={old}\nredis.register_function('{old}', function() return 1 end)");
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(&source)
        .query_async(&mut conn.clone())
        .await
        .expect("FUNCTION LOAD on every primary");
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "functions").unwrap();
    let keyed = (0..6u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    let on_each = || async {
        let mut out = Vec::new();
        for node in cluster.nodes() {
            let mut one = node.multiplexed().await.expect("connecting to one node");
            let list: Vec<redis::Value> = redis::cmd("FUNCTION")
                .arg("LIST")
                .arg("LIBRARYNAME")
                .arg(old)
                .query_async(&mut one)
                .await
                .expect("FUNCTION LIST");
            out.push(list.len());
        }
        out
    };
    assert_eq!(on_each().await, [1, 1, 1]);
    let deleted = lockgate::delete_stale_functions(&conn).await.unwrap();
    assert_eq!(deleted, [old]);
    assert_eq!(on_each().await, [0, 0, 0]);
    let mut claimed = 0;
    while claimed < 6 {
        let jobs = queue.claim(6, Duration::from_secs(30)).await.unwrap().jobs;
        for job in &jobs {
            assert!(queue.ack(job).await.unwrap());
        }
        claimed += jobs.len();
    }
    let current = lockgate::function_libraries(&conn).await.unwrap();
    assert!(current.iter().all(|library| library.current), "{current:?}");
}

/// `EVALSHA` calls so far, over every node (`INFO commandstats`).
async fn script_calls(cluster: &RedisCluster) -> u64 {
    let info = info_by_node(cluster, "commandstats").await;
    let calls = info.iter().map(|info| {
        (info.lines())
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .map_or(0, |n| n.parse::<u64>().expect("a count"))
    });
    calls.sum()
}

/// Issue 35, item 7, on a cluster: a recovery sweep visits only the
/// partitions whose entry in the queue's leases index is due, as on one
/// server, not every partition of the queue (a script call each, every
/// third of a lease). The claims keep the index (its scripts, in other
/// slots, cannot): an expired lease is found by the next sweep, and the
/// entries of partitions left without leases go.
#[tokio::test]
async fn keyed_recovery_sweeps_on_a_cluster_visit_only_partitions_with_leases_due() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "swept").unwrap();
    let keyed = (0..60u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    // The first sweep of five minutes visits every partition.
    let before = script_calls(&cluster).await;
    assert_eq!(queue.recover(3).await.unwrap().requeued, 0);
    let full = script_calls(&cluster).await - before;
    assert!(full > 30, "a full sweep: {full} script calls");
    let quiet = || async {
        let before = script_calls(&cluster).await;
        assert_eq!(queue.recover(3).await.unwrap().requeued, 0);
        script_calls(&cluster).await - before
    };
    // (The unkeyed messages' recovery and the index's read: a few calls,
    // whatever the partitions.)
    let calls = quiet().await;
    assert!(
        calls <= 4,
        "nothing leased: the index alone is read, not {calls} calls"
    );
    let mut claimed = 0;
    while claimed < 10 {
        let room = 10 - claimed;
        claimed += queue.claim(room, ms(300)).await.unwrap().jobs.len();
    }
    assert!(quiet().await <= 4, "nothing due yet");
    tokio::time::sleep(ms(400)).await;
    assert_eq!(queue.recover(3).await.unwrap().requeued, 10);
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.due, stats.active), (60, 0));
    let index: u64 = redis::cmd("ZCARD")
        .arg("lockgate:{swept}:keyed:leases")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(index, 0, "no partition with a lease left");
    assert!(quiet().await <= 4);
}

/// A recovery sweep that fails part way (here its visit of a partition
/// times out; a worker killed in the middle of its sweep is the same)
/// hides the partitions it took from the leases index no longer than a
/// sweep may take: a lease there that runs out later is found by the next
/// sweeps. (The entries it raised stayed a thousand years ahead, so only
/// the next full sweep, five minutes later, ended such a lease.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_sweep_that_fails_part_way_on_a_cluster_hides_no_lease_for_long() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "hidden").unwrap();
    // Two keys of one partition, on another node than the queue's slot.
    let home = node_of(&cluster, &conn, "{hidden}").await;
    let slot = |key: &str| crc16::State::<crc16::XMODEM>::calculate(key.as_bytes()) % 16_384;
    let first = (0..)
        .map(|n| format!("k{n}"))
        .find(|key| cluster.node_of_slot(slot(key)) != home)
        .unwrap();
    let second = (0..)
        .map(|n| format!("j{n}"))
        .find(|key| slot(key) == slot(&first))
        .unwrap();
    let node = cluster.node_of_slot(slot(&first));
    // A sweeper whose requests time out soon, without retries.
    let sweeper = (cluster.client_builder())
        .response_timeout(ms(500))
        .retries(0)
        .build()
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let sweeper: Queue<u64, _> = Queue::new(sweeper, "hidden").unwrap();
    for (n, key) in [&first, &second].into_iter().enumerate() {
        let options = lockgate::PushOptions::new().key(key.clone());
        queue.push_with(n as u64, options).await.unwrap();
    }
    // The first sweep of five minutes visits every partition.
    assert_eq!(queue.recover(3).await.unwrap().requeued, 0);
    // One lease runs out at once, the other after the failed visit.
    assert_eq!(queue.claim(1, ms(100)).await.unwrap().jobs.len(), 1);
    assert_eq!(queue.claim(1, ms(4000)).await.unwrap().jobs.len(), 1);
    tokio::time::sleep(ms(200)).await;
    // The sweep's visit waits on the partition's node past its timeout
    // (and may run after, its reply lost).
    let _: () = (cluster.nodes()[node])
        .query(redis::cmd("CLIENT").arg("PAUSE").arg(2000).arg("WRITE"))
        .unwrap();
    let failed = sweeper.recover(3).await;
    let failed = failed.expect_err("the sweep's visit timed out");
    assert!(
        failed
            .to_string()
            .contains("while recovering keyed messages"),
        "{failed}"
    );
    // The second lease is found once it runs out (the first may have gone
    // back by the failed visit, after its timeout).
    let started = Instant::now();
    loop {
        let swept = queue.recover(3).await;
        if swept.is_ok_and(|swept| swept.requeued > 0) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the second lease was still hidden after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(ms(250)).await;
    }
    let stats = queue.stats().await.unwrap();
    assert_eq!((stats.due, stats.active), (2, 0));
}

/// An entry of the leases index that an older version's sweep left raised
/// out of reach (to 10^15 ms: its process died before it settled) is due
/// at once.
#[tokio::test]
async fn a_keyed_lease_entry_an_older_sweep_left_raised_is_due_at_once() {
    let cluster = cluster();
    let conn = connect(&cluster).await;
    let queue: Queue<u64, _> = Queue::new(conn.clone(), "raised").unwrap();
    let options = lockgate::PushOptions::new().key("k0");
    queue.push_with(0, options).await.unwrap();
    // The first sweep of five minutes visits every partition.
    assert_eq!(queue.recover(3).await.unwrap().requeued, 0);
    assert_eq!(queue.claim(1, ms(100)).await.unwrap().jobs.len(), 1);
    tokio::time::sleep(ms(200)).await;
    let index = "lockgate:{raised}:keyed:leases";
    let entries: Vec<String> = redis::cmd("ZRANGE")
        .arg(index)
        .arg(0)
        .arg(-1)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let _: () = redis::cmd("ZADD")
        .arg(index)
        .arg("XX")
        .arg(1_000_000_000_000_000_i64)
        .arg(&entries[0])
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(queue.recover(3).await.unwrap().requeued, 1);
}

/// Commands every node ran so far (`INFO commandstats`), but the `INFO`s
/// that read them and the `CLIENT` commands a client names itself with
/// (redis-rs, as it makes each link to a node).
async fn commands(cluster: &RedisCluster) -> u64 {
    let info = info_by_node(cluster, "commandstats").await;
    let calls = info.iter().flat_map(|info| {
        info.lines().filter_map(|line| {
            if line.starts_with("cmdstat_info:") || line.starts_with("cmdstat_client|") {
                return None;
            }
            let (_, rest) = line.split_once("calls=")?;
            rest.split(',').next()?.parse::<u64>().ok()
        })
    });
    calls.sum()
}

/// `recent_stats`, which the workers' sampling reads through: the queue's
/// handles read the stats once per period between them (a sharded queue's
/// are a script per shard): another handle gets the kept reading for a
/// GET, its ages moved on, until it is older than asked.
#[tokio::test]
async fn recent_stats_are_read_once_per_period_between_a_queue_s_handles() {
    let cluster = cluster();
    let (one, other) = (connect(&cluster).await, connect(&cluster).await);
    let queue: Queue<u64, _> = Queue::new(one.clone(), "sampled").unwrap();
    let keyed = (0..40u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    queue.push_many(40..45u64).await.unwrap();
    let exact = queue.stats().await.unwrap();
    assert_eq!((exact.due, exact.later), (45, 0));
    assert_eq!(
        queue
            .recent_stats(Duration::from_secs(10))
            .await
            .unwrap()
            .due,
        45
    );
    let handle: Queue<u64, _> = Queue::new(other.clone(), "sampled").unwrap();
    queue.push(45).await.unwrap();
    // The other connection's links to every node made first (redis-rs
    // names itself on each, `CLIENT SETINFO`, as it makes it).
    let _: () = redis::cmd("PING")
        .query_async(&mut other.clone())
        .await
        .unwrap();
    let before = commands(&cluster).await;
    let kept = handle.recent_stats(Duration::from_secs(10)).await.unwrap();
    let kept_cost = commands(&cluster).await - before;
    assert_eq!(
        (kept.due, kept.later, kept.active),
        (45, 0, 0),
        "the kept reading"
    );
    assert!(kept.oldest_due_age >= exact.oldest_due_age);
    assert!(kept_cost <= 2, "a kept reading costs {kept_cost} commands");
    tokio::time::sleep(ms(20)).await;
    assert_eq!(
        handle.recent_stats(ms(10)).await.unwrap().due,
        46,
        "older than asked"
    );
    assert!(handle.recent_stats(Duration::ZERO).await.is_err());
}

/// Issue 35, item 8, on a cluster: a dashboard's look at a keyed queue
/// reads a bounded number of partitions, whatever the keys. `peek` reads
/// the first 128 partitions of the queue's index and of its leases index
/// (before, every partition), and `key_stats` counts the keys from the
/// counts the handles copy into the queue's slot (before, every
/// partition's counts on each call). Its busy keys come from the
/// leases index's first partitions (before, from the queue's index alone,
/// where partitions at work come last: with more than 128 partitions due,
/// it showed no busy key). With up to 128 partitions holding something,
/// the look is exact. Dead letters are read from the partitions whose
/// copied counts hold some (before, from every partition, one round trip
/// after another).
#[tokio::test]
async fn a_look_at_a_keyed_queue_on_a_cluster_reads_a_bounded_number_of_partitions() {
    let cluster = cluster();
    let (one, other) = (connect(&cluster).await, connect(&cluster).await);
    let queue: Queue<u64, _> = Queue::new(one.clone(), "looked").unwrap();
    let keyed = (0..600u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    let mut claimed = Vec::new();
    while claimed.len() < 20 {
        let room = 20 - claimed.len();
        claimed.extend(
            queue
                .claim(room, Duration::from_secs(60))
                .await
                .unwrap()
                .jobs,
        );
    }
    let handle: Queue<u64, _> = Queue::new(other.clone(), "looked").unwrap();
    // Links to every node made first: counted, they would be the client's
    // (after the first handle's copies, which `stats` writes).
    assert_eq!(queue.stats().await.unwrap().keys, 600);
    assert_eq!(handle.stats().await.unwrap().keys, 600);
    let before = script_calls(&cluster).await;
    let peek = handle.peek(10).await.unwrap();
    let calls = script_calls(&cluster).await - before;
    assert!(
        calls <= 256,
        "a look reads at most 2 × 128 partitions, not {calls}"
    );
    assert_eq!((peek.waiting.len(), peek.active.len()), (10, 10));
    let ids: BTreeSet<String> = claimed.iter().map(|job| job.id().to_owned()).collect();
    assert!(peek.active.iter().all(|seen| ids.contains(&seen.id)));
    assert!(peek.waiting.iter().all(|seen| !ids.contains(&seen.id)));

    let first = handle.key_stats(5).await.unwrap();
    assert_eq!(
        (first.keys, first.busy.len(), first.backlogs.len()),
        (600, 5, 5)
    );
    let before = (script_calls(&cluster).await, commands(&cluster).await);
    let again = queue.key_stats(5).await.unwrap();
    let (calls, all) = (
        script_calls(&cluster).await - before.0,
        commands(&cluster).await - before.1,
    );
    assert_eq!(again.keys, 600, "the copied count");
    assert!(
        calls <= 256,
        "the keys of the first 128 partitions of each index, not {calls} calls"
    );
    assert!(
        all <= 256 * 8,
        "no partition's counts read again: {all} commands"
    );

    // Dead letters of many partitions (each read at once with the others)
    // come in the order they were buried, a page at a time.
    let mut buried = Vec::new();
    for job in &claimed[..5] {
        assert!(queue.bury(job, "fatal").await.unwrap());
        buried.push(job.id().to_owned());
        tokio::time::sleep(ms(2)).await;
    }
    // Another handle lists them once the burying handle's copies land
    // (`stats` and the like write their own first).
    queue.flush_counts().await.unwrap();
    // (The listing script loaded on every node first: a call that finds
    // it unknown counts too.)
    handle.dead_letters(None, 3).await.unwrap();
    let before = script_calls(&cluster).await;
    let first = handle.dead_letters(None, 3).await.unwrap();
    let calls = script_calls(&cluster).await - before;
    assert!(
        calls <= 6,
        "the dead sets of the queue and of the 5 partitions with dead letters, not {calls}"
    );
    let rest = (handle.dead_letters(first.next.as_ref(), 3).await).unwrap();
    let listed: Vec<String> = (first.letters.iter().chain(&rest.letters))
        .map(|letter| letter.id.clone())
        .collect();
    assert_eq!((listed, rest.next), (buried, None));
}

/// Issue 35, item 8, on a cluster: a keyed queue's `stats` read the counts
/// the queue's handles copy into the queue's slot (`lua/keyed_mirror.lua`),
/// a few commands whatever the partitions: before, every partition's
/// counts, two commands each (1,200 here). Another handle reads the same
/// once the copies have landed. A change that no handle copied (a process
/// killed before its copy, a producer in another language: here the
/// partition's counts moved by hand, as a script would) shows after the
/// sweep over every partition, which copies them all; so does a partition
/// whose change number went back (a failover that lost its last writes).
#[tokio::test]
async fn a_keyed_queue_s_stats_on_a_cluster_read_the_counts_copied_into_its_slot() {
    let cluster = cluster();
    let (one, other) = (connect(&cluster).await, connect(&cluster).await);
    let queue: Queue<u64, _> = Queue::new(one.clone(), "copied").unwrap();
    let keyed = (0..600u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    queue.push_many(600..605u64).await.unwrap();
    let counts = |s: &lockgate::queue::Stats| (s.due, s.later, s.active, s.dead, s.keys);
    // The first look copies every partition once (and marks it done).
    assert_eq!(counts(&queue.stats().await.unwrap()), (605, 0, 0, 0, 600));
    let mut claimed = Vec::new();
    while claimed.len() < 20 {
        let room = 20 - claimed.len();
        let jobs = queue.claim(room, Duration::from_secs(60)).await.unwrap();
        claimed.extend(jobs.jobs);
    }
    // Five keyed messages done (the five unkeyed ones, claimed first, stay
    // at work).
    for job in claimed.iter().filter(|job| job.key().is_some()).take(5) {
        assert!(queue.ack(job).await.unwrap());
    }
    let expected = (585, 0, 15, 0, 595);
    // Another handle reads them once the first handle's task copied them.
    let handle: Queue<u64, _> = Queue::new(other.clone(), "copied").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while counts(&handle.stats().await.unwrap()) != expected {
        assert!(Instant::now() < deadline, "another handle reads the copies");
        tokio::time::sleep(ms(20)).await;
    }
    assert_eq!(counts(&queue.stats().await.unwrap()), expected);
    let before = commands(&cluster).await;
    let again = queue.stats().await.unwrap();
    let cost = commands(&cluster).await - before;
    assert_eq!(counts(&again), expected);
    assert!(
        cost <= 20,
        "a reading of the copies, not of 600 partitions: {cost} commands"
    );

    // A partition's counts moved by hand, as a script of a process that
    // copies nothing would move them: one more in line, its number on.
    let (node, counts_key) = (keys_by_node(&cluster).await.into_iter().enumerate())
        .find_map(|(node, keys)| {
            let key = keys.into_iter().find(|key| {
                key.ends_with("}:copied:counts") && !key.starts_with("lockgate:{copied}")
            });
            key.map(|key| (node, key))
        })
        .expect("a partition's counts");
    let mut node_conn = cluster.nodes()[node].multiplexed().await.unwrap();
    let (): () = redis::pipe()
        .cmd("HINCRBY")
        .arg(&counts_key)
        .arg("lines")
        .arg(1)
        .ignore()
        .cmd("HINCRBY")
        .arg(&counts_key)
        .arg("v")
        .arg(1)
        .ignore()
        .query_async(&mut node_conn)
        .await
        .unwrap();
    assert_eq!(
        counts(&queue.stats().await.unwrap()),
        expected,
        "not copied"
    );
    let mut full = redis::cmd("DEL");
    full.arg("lockgate:{copied}:recovering:full");
    let _: () = full.query_async(&mut one.clone()).await.unwrap();
    handle.recover(5).await.unwrap();
    let (due, ..) = counts(&handle.stats().await.unwrap());
    assert_eq!(due, 586, "copied by the sweep over every partition");

    // A failover that lost the partition's last writes: its number back.
    let (): () = redis::pipe()
        .cmd("HINCRBY")
        .arg(&counts_key)
        .arg("lines")
        .arg(-1)
        .ignore()
        .cmd("HINCRBY")
        .arg(&counts_key)
        .arg("v")
        .arg(-5)
        .ignore()
        .query_async(&mut node_conn)
        .await
        .unwrap();
    let _: () = full.query_async(&mut one.clone()).await.unwrap();
    handle.recover(5).await.unwrap();
    assert_eq!(
        counts(&handle.stats().await.unwrap()),
        expected,
        "copied over a newer number"
    );

    // A producer that pushes and writes its copies before it exits: the
    // other handles count its messages at once.
    let producer: Queue<u64, _> = Queue::new(other.clone(), "copied").unwrap();
    let more = (700..703u64).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    producer.push_many_with(more).await.unwrap();
    producer.flush_counts().await.unwrap();
    let (due, _, _, _, keys) = counts(&queue.stats().await.unwrap());
    assert_eq!((due, keys), (588, 598), "a producer's flushed pushes");

    // Copies gone, as before a version that made them: the first `stats`
    // copies every partition, though a handle's own copy (a push here)
    // made the copies anew meanwhile.
    let mut gone = redis::cmd("DEL");
    for name in ["copies", "counts", "oldest", "copied"] {
        gone.arg(format!("lockgate:{{copied}}:keyed:{name}"));
    }
    let _: () = gone.query_async(&mut one.clone()).await.unwrap();
    let one_more = lockgate::PushOptions::new().key("k703");
    handle.push_with(703, one_more).await.unwrap();
    let copies = "lockgate:{copied}:keyed:copies";
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let exists: bool = redis::cmd("EXISTS")
            .arg(copies)
            .query_async(&mut one.clone())
            .await
            .unwrap();
        if exists {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the handle's task copies its push"
        );
        tokio::time::sleep(ms(20)).await;
    }
    let (due, _, active, _, keys) = counts(&handle.stats().await.unwrap());
    assert_eq!(
        (due, active, keys),
        (589, 15, 599),
        "copied at a first look"
    );
}
