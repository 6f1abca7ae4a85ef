//! A queue spread over shards (`Queue::shards`): messages without a key
//! spread by id over hash slots evenly apart, claimed, settled and counted
//! across all of them, with one bell; on one server and on a three-master
//! cluster (`lockgate::testing`), where the shards land on every master.

use crate::support;

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lockgate::queue::{EventKind, EventsFrom, Wake};
use lockgate::testing::RedisCluster;
use lockgate::{BoxError, Error, Job, PushOptions, Queue, Worker};
use redis::aio::ConnectionLike;
use support::{BOUNDED, counts, done_if, eventually, manager, ms, secs, server, stats};

const LONG: Duration = secs(60);

fn sharded<C>(conn: C, name: &str, n: usize) -> Queue<u32, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    (Queue::new(conn, name).and_then(|q| q.shards(n))).expect("a valid shard count")
}

/// A handler that records each message it is given in `handled`.
fn recorder(
    handled: &Arc<Mutex<Vec<u32>>>,
) -> tower::util::ServiceFn<
    impl FnMut(Job<u32>) -> std::future::Ready<Result<(), BoxError>> + Clone + use<>,
> {
    let handled = handled.clone();
    tower::service_fn(move |job: Job<u32>| {
        handled.lock().unwrap().push(*job);
        std::future::ready(Ok(()))
    })
}

/// Every key of the server, through `conn`.
async fn all_keys(conn: &redis::aio::ConnectionManager) -> BTreeSet<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn.clone())
        .await
        .expect("KEYS");
    keys.into_iter().collect()
}

/// The shard stems (`lockgate:{<t>}#<i>:<queue>`) that hold a key.
fn shard_stems(keys: &BTreeSet<String>) -> BTreeSet<String> {
    keys.iter()
        .filter(|k| k.contains("}#"))
        .filter_map(|k| k.rsplit_once(':').map(|(stem, _)| stem.to_owned()))
        .collect()
}

#[tokio::test]
async fn shard_counts_outside_the_range_are_refused() {
    let server = server();
    let conn = manager(&server).await;
    for n in [0, lockgate::queue::MAX_SHARDS + 1] {
        let refused = Queue::<u32>::new(conn.clone(), "q").and_then(|q| q.shards(n));
        assert!(matches!(refused, Err(Error::Config(_))), "{n}: {refused:?}");
    }
}

#[tokio::test]
async fn one_shard_is_the_plain_queue_key_for_key() {
    let server = server();
    let conn = manager(&server).await;
    let plain: Queue<u32> = Queue::new(conn.clone(), "a").unwrap();
    let one = sharded(conn.clone(), "b", 1);
    for q in [&plain, &one] {
        q.push(1).await.unwrap();
        q.push_after(2, LONG).await.unwrap();
        let job = q.claim(1, LONG).await.unwrap().jobs.remove(0);
        q.retry(&job, LONG, "no").await.unwrap();
    }
    let keys = all_keys(&conn).await;
    let of = |name: &str| -> BTreeSet<String> {
        let stem = format!("lockgate:{{{name}}}:");
        // (The claims' records have names of their own.)
        keys.iter()
            .filter_map(|k| k.strip_prefix(&stem).map(str::to_owned))
            .filter(|k| !k.starts_with("claims:"))
            .collect()
    };
    assert_eq!(of("a"), of("b"), "all keys: {keys:?}");
    assert!(!keys.iter().any(|k| k.ends_with(":shards")), "{keys:?}");
}

#[tokio::test]
async fn a_handle_with_another_shard_count_is_refused() {
    let server = server();
    let conn = manager(&server).await;
    let four = sharded(conn.clone(), "q", 4);
    four.push(1).await.unwrap();
    for n in [1, 2, 8] {
        let other = sharded(conn.clone(), "q", n);
        let pushed = other.push(2).await;
        assert!(
            matches!(&pushed, Err(Error::Config(why)) if why.contains("created with 4 shards")),
            "{n} shards: {pushed:?}"
        );
        assert!(matches!(other.claim(10, LONG).await, Err(Error::Config(_))));
    }
    // The count the queue was made with works on a fresh handle.
    let again = sharded(conn.clone(), "q", 4);
    assert_eq!(again.claim(10, LONG).await.unwrap().jobs.len(), 1);
}

#[tokio::test]
async fn messages_spread_over_the_shards_and_each_is_claimed_once() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "orders", 4);
    let ids: Vec<String> = (0..400).map(|n| format!("m{n}")).collect();
    let pushed = (queue.push_many_with(
        ids.iter()
            .enumerate()
            .map(|(n, id)| (n as u32, PushOptions::new().id(id))),
    ))
    .await
    .unwrap();
    assert!(pushed.iter().all(|p| p.created));
    let keys = all_keys(&conn).await;
    assert_eq!(
        shard_stems(&keys).len(),
        3,
        "shards 1..3 hold messages: {keys:?}"
    );
    assert_eq!(stats(&queue).await.due, 400);
    let (total, each) = queue.stats_by_shard().await.unwrap();
    assert_eq!(total.due, 400, "the queue's counts beside its shards'");
    let each: Vec<u64> = each.iter().map(|s| s.due).collect();
    assert_eq!((each.len(), each.iter().sum::<u64>()), (4, 400), "{each:?}");
    assert!(
        each.iter().all(|n| (60..=140).contains(n)),
        "spread by id: {each:?}"
    );

    // A given id meets itself: pushing it again adds nothing.
    let again = queue
        .push_with(7, PushOptions::new().id("m7"))
        .await
        .unwrap();
    assert!(!again.created);

    // Four claimers at once: each message once, every shard drained.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let claimers = (0..4).map(|_| {
        let (queue, seen) = (queue.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let claimed = queue.claim(25, LONG).await.unwrap();
                if claimed.jobs.is_empty() {
                    return;
                }
                let acked = queue.ack_many(&claimed.jobs).await.unwrap();
                assert!(acked.iter().all(|a| *a));
                seen.lock()
                    .unwrap()
                    .extend(claimed.jobs.iter().map(|j| j.id().to_owned()));
            }
        })
    });
    for claimer in claimers {
        claimer.await.unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let unique: HashSet<&String> = seen.iter().collect();
    assert_eq!(
        seen.len(),
        400,
        "claimed twice: {}",
        seen.len() - unique.len()
    );
    assert_eq!(unique.len(), 400);
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
}

#[tokio::test]
async fn under_a_backlog_each_claim_is_one_shards_batch_and_the_shards_take_turns() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "q", 4);
    queue.push_many(0..400u32).await.unwrap();
    let mut turns = Vec::new();
    for _ in 0..8 {
        let claimed = queue.claim(20, LONG).await.unwrap();
        assert_eq!(claimed.jobs.len(), 20);
        let shards: BTreeSet<u64> = claimed.jobs.iter().map(|j| crc16(j.id()) % 4).collect();
        assert_eq!(shards.len(), 1, "one batch, one shard: {shards:?}");
        turns.extend(shards);
    }
    // Every shard in every four claims.
    for window in turns.chunks(4) {
        let distinct: BTreeSet<&u64> = window.iter().collect();
        assert_eq!(distinct.len(), 4, "{turns:?}");
    }
}

/// CRC16-XMODEM, the hash slot function (the recipe in docs/cluster.md).
fn crc16(text: &str) -> u64 {
    let mut crc: u16 = 0;
    for byte in text.bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    u64::from(crc % 16384)
}

#[tokio::test]
async fn retries_dead_letters_and_recovery_work_in_every_shard() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "q", 3).dead_retention(None, None);
    let ids: Vec<String> = (0..30).map(|n| format!("r{n}")).collect();
    let batch = ids.iter().map(|id| (0u32, PushOptions::new().id(id)));
    queue.push_many_with(batch).await.unwrap();
    let shards: BTreeSet<u64> = ids.iter().map(|id| crc16(id) % 3).collect();
    assert_eq!(shards.len(), 3);

    // Retried: back, due later, with an attempt counted.
    let jobs = queue.claim(30, LONG).await.unwrap().jobs;
    assert_eq!(jobs.len(), 30);
    for job in &jobs {
        assert!(queue.retry(job, ms(50), "once").await.unwrap().is_some());
    }
    assert_eq!(counts(&stats(&queue).await), (0, 30, 0, 0));
    let jobs = claim_all(&queue, 30).await;
    assert!(jobs.iter().all(|j| j.attempt() == 2));

    // Buried, listed, re-driven.
    for job in &jobs {
        assert!(queue.bury(job, "poison").await.unwrap());
    }
    assert_eq!(
        queue.dead_letters(None, 100).await.unwrap().letters.len(),
        30
    );
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 30));
    assert!(queue.requeue_dead("r3").await.unwrap());
    assert_eq!(queue.requeue_all_dead().await.unwrap(), 29);
    assert_eq!(stats(&queue).await.due, 30);

    // Leases that run out come back, from every shard.
    let jobs = queue.claim(30, ms(30)).await.unwrap().jobs;
    assert_eq!(jobs.len(), 30);
    tokio::time::sleep(ms(60)).await;
    assert_eq!(queue.recover(5).await.unwrap().requeued, 30);
    for job in &jobs {
        assert!(
            !queue.ack(job).await.unwrap(),
            "an expired claim acks nothing"
        );
    }
    let jobs = claim_all(&queue, 30).await;
    assert_eq!(queue.extend(&jobs, LONG).await.unwrap(), vec![true; 30]);
    assert_eq!(queue.peek(100).await.unwrap().active.len(), 30);
    assert!(queue.ack_many(&jobs).await.unwrap().iter().all(|a| *a));
    queue
        .push_with(1, PushOptions::new().id("r4").after(LONG))
        .await
        .unwrap();
    assert!(queue.exists().await.unwrap());
    assert!(queue.remove("r4").await.unwrap());
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
    queue.purge().await.unwrap();
    assert!(!queue.exists().await.unwrap());
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("*}#*")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    // The claim counters stay, as the queue's own does (and the claims'
    // records, until they expire within 2 s).
    let kept = |k: &String| k.ends_with(":claims") || k.contains(":claims:");
    assert!(left.iter().all(kept), "{left:?}");
}

/// Claims until `n` are claimed (some may be due a little later).
async fn claim_all<C>(queue: &Queue<u32, C>, n: usize) -> Vec<Job<u32>>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let mut jobs = Vec::new();
    let deadline = tokio::time::Instant::now() + BOUNDED;
    while jobs.len() < n && tokio::time::Instant::now() < deadline {
        jobs.extend(queue.claim(100, LONG).await.unwrap().jobs);
        tokio::time::sleep(ms(10)).await;
    }
    assert_eq!(jobs.len(), n);
    jobs
}

#[tokio::test]
async fn an_idle_waiter_wakes_for_a_push_to_any_shard() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "q", 4);
    let mut waiter = queue.waiter(server.client());
    // A push to every shard, one at a time, each woken for.
    for id in ["a", "b", "c", "d", "e", "f"] {
        assert!(queue.claim(10, LONG).await.unwrap().jobs.is_empty());
        let wait = waiter.wait(Some(tokio::time::Instant::now() + secs(5)));
        let push = async {
            tokio::time::sleep(ms(50)).await;
            queue.push_with(1, PushOptions::new().id(id)).await.unwrap()
        };
        let (woke, _) = tokio::join!(wait, push);
        assert_eq!(woke.unwrap(), Wake::Rung, "{id} (shard {})", crc16(id) % 4);
        let claimed = queue.claim(10, LONG).await.unwrap();
        assert_eq!(claimed.jobs.len(), 1, "{id}");
        queue.ack(&claimed.jobs[0]).await.unwrap();
    }
}

#[tokio::test]
async fn events_and_completed_messages_of_every_shard_are_read_as_one() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "q", 3)
        .record_events(1000)
        .and_then(|q| q.keep_completed(Some(100), None))
        .unwrap();
    let mut follower = queue
        .events(server.client(), EventsFrom::Beginning)
        .await
        .unwrap();
    let ids: Vec<String> = (0..12).map(|n| format!("e{n}")).collect();
    let batch = ids.iter().map(|id| (0u32, PushOptions::new().id(id)));
    queue.push_many_with(batch).await.unwrap();
    let jobs = claim_all(&queue, 12).await;
    queue.ack_many(&jobs).await.unwrap();

    let events = queue.events_after("0-0", 1000).await.unwrap();
    let done: BTreeSet<&str> = (events.iter())
        .filter(|e| e.kind == EventKind::Done)
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(done.len(), 12, "{events:?}");
    assert_eq!(queue.completed(100).await.unwrap().len(), 12);
    let mut followed = BTreeSet::new();
    while followed.len() < 12 {
        let event = tokio::time::timeout(BOUNDED, follower.next()).await;
        let event = event.expect("followed in time").expect("open").unwrap();
        if event.kind == EventKind::Done {
            followed.insert(event.id);
        }
    }
}

#[tokio::test]
async fn a_worker_handles_each_message_of_every_shard_once() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "work", 4);
    let handled = Arc::new(Mutex::new(Vec::new()));
    let service = recorder(&handled);
    let worker = Worker::new(server.client(), queue.clone(), service)
        .concurrency(8)
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));
    // Pushed after the worker went idle: only the bell wakes it.
    tokio::time::sleep(ms(100)).await;
    for chunk in (0..300u32).collect::<Vec<_>>().chunks(50) {
        queue.push_many(chunk).await.unwrap();
    }
    eventually("every message is handled", secs(30), async || {
        let n = handled.lock().unwrap().len();
        done_if(n >= 300, format_args!("{n} handled"))
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
    let handled = handled.lock().unwrap().clone();
    let unique: BTreeSet<u32> = handled.iter().copied().collect();
    assert_eq!((handled.len(), unique.len()), (300, 300));
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
}

#[tokio::test]
async fn on_a_cluster_the_shards_spread_over_every_master() {
    let cluster = RedisCluster::start().expect("a three-node test cluster starts");
    let conn = cluster.connection().await.unwrap();
    let queue = sharded(conn.clone(), "spread", 3);
    queue.push_many(0..300u32).await.unwrap();
    // Each master holds one shard's messages.
    let mut per_node = Vec::new();
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*:data")
            .query_async(&mut conn)
            .await
            .unwrap();
        let mut messages = 0;
        for key in keys {
            let n: usize = redis::cmd("HLEN")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap();
            messages += n;
        }
        per_node.push(messages);
    }
    assert!(
        per_node.iter().all(|n| (60..=140).contains(n)),
        "{per_node:?}"
    );
    assert_eq!(per_node.iter().sum::<usize>(), 300);

    // Workers drain them all, each once, waking on the one bell.
    let workers = Recording::start(&cluster, &queue, 2);
    tokio::time::sleep(ms(200)).await;
    queue.push_many(300..400u32).await.unwrap();
    workers.finish(400).await;
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
}

/// Workers on a cluster's queue that record each message they handle.
struct Recording {
    handled: Arc<Mutex<Vec<u32>>>,
    stop: tokio::sync::watch::Sender<bool>,
    runs: Vec<tokio::task::JoinHandle<lockgate::Result<()>>>,
}

impl Recording {
    fn start<C>(cluster: &RedisCluster, queue: &Queue<u32, C>, workers: usize) -> Self
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let handled = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut runs = Vec::new();
        for _ in 0..workers {
            let service = recorder(&handled);
            let worker = Worker::new(cluster.client(), queue.clone(), service);
            let mut stopped = stopped.clone();
            runs.push(tokio::spawn(worker.run_until(async move {
                let _ = stopped.wait_for(|s| *s).await;
            })));
        }
        Self {
            handled,
            stop,
            runs,
        }
    }

    fn count(&self) -> usize {
        self.handled.lock().unwrap().len()
    }

    /// Waits until `total` are handled, stops the workers and checks that
    /// each of `0..total` was handled once.
    async fn finish(self, total: u32) {
        eventually("every message is handled", secs(60), async || {
            let n = self.count();
            done_if(n >= total as usize, format_args!("{n} handled"))
        })
        .await;
        let _ = self.stop.send(true);
        for run in self.runs {
            run.await.unwrap().unwrap();
        }
        let mut handled = self.handled.lock().unwrap().clone();
        handled.sort_unstable();
        assert_eq!(handled, (0..total).collect::<Vec<_>>(), "each message once");
    }
}

#[tokio::test]
async fn a_shard_moved_to_another_master_mid_run_loses_nothing_and_runs_nothing_twice() {
    let cluster = Arc::new(RedisCluster::start().expect("a three-node test cluster starts"));
    let conn = cluster.connection().await.unwrap();
    let queue = sharded(conn.clone(), "orders", 3);
    let workers = Recording::start(&cluster, &queue, 2);
    // Shard 1's slot, and a master that does not serve it.
    let slot = u16::try_from((crc16("orders") + 16384 / 3) % 16384).unwrap();
    let (from, to) = (
        cluster.node_of_slot(slot),
        (cluster.node_of_slot(slot) + 1) % 3,
    );
    let total = 1500u32;
    let producer = {
        let queue = queue.clone();
        tokio::spawn(async move {
            for batch in (0..total).collect::<Vec<_>>().chunks(10) {
                queue.push_many(batch).await.unwrap();
                tokio::time::sleep(ms(4)).await;
            }
        })
    };
    eventually("a third is handled", secs(30), async || {
        let n = workers.count();
        done_if(n >= total as usize / 3, format_args!("{n} handled"))
    })
    .await;
    // Key by key, with pauses in which clients meet ASK and TRYAGAIN.
    let moving = cluster.clone();
    tokio::task::spawn_blocking(move || moving.move_slot(slot, to, (1, ms(20))))
        .await
        .unwrap()
        .expect("the slot moves");
    producer.await.unwrap();
    workers.finish(total).await;
    assert_eq!(counts(&stats(&queue).await), (0, 0, 0, 0));
    // The shard lives on its new master now (its claim counter stays).
    let on = |node: usize| {
        let client = cluster.nodes()[node].client();
        async move {
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let n: u64 = redis::cmd("CLUSTER")
                .arg("COUNTKEYSINSLOT")
                .arg(slot)
                .query_async(&mut conn)
                .await
                .unwrap();
            n
        }
    };
    assert_eq!(on(from).await, 0);
    assert!(on(to).await > 0);
}

#[tokio::test]
async fn a_shards_master_failed_over_loses_nothing_replicated_and_never_repeats_a_claim() {
    let cluster = RedisCluster::builder().with_replicas().start();
    let mut cluster = cluster.expect("a three-node test cluster with replicas starts");
    let conn = cluster.connection().await.unwrap();
    let queue = sharded(conn.clone(), "failover", 3);
    // Each delivery: message, shard, claim number, whether after the kill.
    let deliveries = Arc::new(Mutex::new(Vec::<(u32, u64, u64, bool)>::new()));
    let killed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for _ in 0..2 {
        let (deliveries, killed) = (deliveries.clone(), killed.clone());
        let service = tower::service_fn(move |job: Job<u32>| {
            let (deliveries, killed) = (deliveries.clone(), killed.clone());
            async move {
                let after = killed.load(std::sync::atomic::Ordering::SeqCst);
                let shard = crc16(job.id()) % 3;
                deliveries
                    .lock()
                    .unwrap()
                    .push((*job, shard, job.claim(), after));
                tokio::time::sleep(ms(2)).await;
                Ok::<_, BoxError>(())
            }
        });
        let worker = Worker::new(cluster.client(), queue.clone(), service)
            .lease(secs(1))
            .unwrap();
        let mut stopped = stopped.clone();
        runs.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    queue.push_many(0..600u32).await.unwrap();
    let slot = u16::try_from((crc16("failover") + 16384 / 3) % 16384).unwrap();
    let victim = cluster.node_of_slot(slot);
    // What was pushed has reached the victim's replica ("acknowledged").
    let mut direct = cluster.nodes()[victim].multiplexed().await.unwrap();
    let synced: u64 = redis::cmd("WAIT")
        .arg(1)
        .arg(5000)
        .query_async(&mut direct)
        .await
        .unwrap();
    assert_eq!(synced, 1);
    eventually("some are handled", secs(30), async || {
        let n = deliveries.lock().unwrap().len();
        done_if(n >= 100, format_args!("{n} handled"))
    })
    .await;
    killed.store(true, std::sync::atomic::Ordering::SeqCst);
    let cluster = tokio::task::spawn_blocking(move || cluster.fail_over(victim).map(|()| cluster))
        .await
        .unwrap()
        .expect("the replica takes over");
    queue.push_many(600..900u32).await.unwrap();
    eventually("every message is handled", secs(90), async || {
        let seen: BTreeSet<u32> = deliveries.lock().unwrap().iter().map(|d| d.0).collect();
        done_if(seen.len() >= 900, format_args!("{} handled", seen.len()))
    })
    .await;
    let _ = stop.send(true);
    for run in runs {
        run.await.unwrap().unwrap();
    }
    let deliveries = deliveries.lock().unwrap().clone();
    let seen: BTreeSet<u32> = deliveries.iter().map(|d| d.0).collect();
    assert_eq!(seen, (0..900).collect());
    // Claim numbers never repeat: no message is delivered twice under one
    // claim number (a message whose claim the replica had not received is
    // claimed again there, under a number of its own).
    let mut by_claim = std::collections::HashMap::<(u64, u64), BTreeSet<u32>>::new();
    for (n, shard, claim, _) in &deliveries {
        let fresh = by_claim.entry((*shard, *claim)).or_default().insert(*n);
        assert!(fresh, "message {n} delivered twice under claim {claim}");
    }
    assert!(
        deliveries.iter().any(|d| d.1 == 1 && d.3),
        "shard 1 claimed after the failover"
    );
    drop(cluster);
}

#[tokio::test]
async fn a_worker_asked_to_samples_each_shards_depth() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder();
    let prometheus = recorder.expect("the only recorder of this test binary");
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "gauged", 3);
    let later = (0..30u32).map(|n| (n, PushOptions::new().after(LONG)));
    queue.push_many_with(later).await.unwrap();
    let service = tower::service_fn(|_: Job<u32>| async { Ok::<_, BoxError>(()) });
    let worker = Worker::new(server.client(), queue.clone(), service)
        .sample_every(Some(ms(100)))
        .unwrap()
        .sample_shards();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(async move {
        let _ = stopped.await;
    }));
    let line = |shard: usize| {
        format!(r#"lockgate_queue_shard_messages{{queue="gauged",shard="{shard}",state="later"}}"#)
    };
    eventually("every shard's gauge is set", secs(10), async || {
        let page = prometheus.render();
        let values: Vec<f64> = (0..3)
            .filter_map(|shard| {
                let found = page.lines().find_map(|l| l.strip_prefix(&line(shard)));
                found.and_then(|v| v.trim().parse().ok())
            })
            .collect();
        let total: f64 = values.iter().sum();
        done_if(
            values.len() == 3 && total == 30.0,
            format_args!("{values:?}"),
        )
    })
    .await;
    let _ = stop.send(());
    run.await.unwrap().unwrap();
}

#[tokio::test]
async fn shards_are_claimed_beside_many_keyed_partitions_with_work() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "mixed", 3);
    let ids: Vec<String> = (0..30).map(|n| format!("u{n}")).collect();
    let plain = ids.iter().map(|id| (0u32, PushOptions::new().id(id)));
    queue.push_many_with(plain).await.unwrap();
    // More keyed partitions with work than one reading of the index names.
    let keyed = (0..100).map(|n| (1u32, PushOptions::new().key(format!("key{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    let mut shards = BTreeSet::new();
    for _ in 0..3 {
        let claimed = queue.claim(10, LONG).await.unwrap();
        let plain = claimed.jobs.iter().filter(|j| j.key().is_none());
        shards.extend(plain.map(|j| crc16(j.id()) % 3));
    }
    assert_eq!(
        shards,
        BTreeSet::from([0, 1, 2]),
        "every shard in three claims"
    );
}

#[tokio::test]
async fn pushing_an_id_again_marks_its_shard_again() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "remark", 3);
    // An id of shard 1 or 2.
    let id = (0..)
        .map(|n| format!("m{n}"))
        .find(|id| !crc16(id).is_multiple_of(3))
        .unwrap();
    queue
        .push_with(1, PushOptions::new().id(&id))
        .await
        .unwrap();
    // The mark was lost (a producer stopped between its script and it).
    let member = 16384 + crc16(&id) % 3;
    let _: i64 = redis::cmd("ZREM")
        .arg("lockgate:{remark}:partitions")
        .arg(member)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert!(queue.claim(10, LONG).await.unwrap().jobs.is_empty());
    // The producer's retry of the push marks it again.
    let again = queue
        .push_with(1, PushOptions::new().id(&id))
        .await
        .unwrap();
    assert!(!again.created);
    let claimed = queue.claim(10, LONG).await.unwrap();
    assert_eq!(claimed.jobs.len(), 1);
}

#[tokio::test]
async fn a_shards_small_set_of_leases_is_a_skiplist_that_holds_only_leases() {
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "small", 4);
    queue.push_many(0..40u32).await.unwrap();
    let mut claimed = Vec::new();
    while claimed.len() < 40 {
        claimed.extend(queue.claim(40, LONG).await.unwrap().jobs);
    }
    // Each shard's set was made a skiplist at creation (one claim's ZADD
    // into a listpack is a linear search per member) and holds its leases.
    let mut leases = 0;
    for active in all_keys(&conn)
        .await
        .iter()
        .filter(|k| k.ends_with(":active"))
    {
        let encoding: String = redis::cmd("OBJECT")
            .arg("ENCODING")
            .arg(active)
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert_eq!(encoding, "skiplist", "{active}");
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(active)
            .arg(0)
            .arg(-1)
            .query_async(&mut conn.clone())
            .await
            .unwrap();
        assert!(members.iter().all(|m| m.contains(':')), "{members:?}");
        leases += members.len();
    }
    assert_eq!(leases, 40);
    queue.ack_many(&claimed).await.unwrap();
    assert_eq!(stats(&queue).await.active, 0);
}

#[tokio::test]
async fn idle_workers_take_turns_at_recovery_instead_of_each_sweeping_every_shard() {
    // Four idle workers of a queue of 8 shards, leases of 300 ms: each
    // looks for expired leases every 100 ms. One sweep of the 8 shards per
    // 100 ms serves them all; each sweeping every shard would be 4 × 8
    // script calls per 100 ms.
    let server = server();
    let mut conn = manager(&server).await;
    let queue = sharded(conn.clone(), "idle", 8);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for _ in 0..4 {
        let service = tower::service_fn(|_: Job<u32>| async { Ok::<_, BoxError>(()) });
        // No depth sampling: its stats scripts are not what is counted.
        let worker = Worker::new(server.client(), queue.clone(), service)
            .lease(ms(300))
            .and_then(|w| w.sample_every(None))
            .unwrap();
        let mut stopped = stopped.clone();
        runs.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    tokio::time::sleep(ms(300)).await;
    let scripts = async |conn: &mut redis::aio::ConnectionManager| {
        let calls = lockgate::testing::command_calls(conn).await.unwrap();
        ["evalsha", "fcall"]
            .iter()
            .filter_map(|c| calls.get(*c))
            .sum::<u64>()
    };
    let (before, started) = (scripts(&mut conn).await, std::time::Instant::now());
    tokio::time::sleep(secs(1)).await;
    let calls = scripts(&mut conn).await - before;
    let sweeps = started.elapsed().as_millis() as u64 / 100 + 2;
    let _ = stop.send(true);
    for run in runs {
        run.await.unwrap().unwrap();
    }
    assert!(
        calls <= 8 * sweeps + 16,
        "{calls} script calls in {:?}: at most {sweeps} sweeps of 8 shards expected",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_worker_with_a_short_lease_recovers_beside_one_with_a_long_lease() {
    // A message whose worker died: claimed with a 300 ms lease, never
    // settled. A worker with a 30 s lease (it looks every 10 s) takes its
    // turn at recovery first; one with a 300 ms lease (every 100 ms) must
    // not wait for it.
    let server = server();
    let conn = manager(&server).await;
    let queue = sharded(conn.clone(), "leases", 2);
    queue.push(7).await.unwrap();
    let claimed = queue.claim(1, ms(300)).await.unwrap();
    assert_eq!(claimed.jobs.len(), 1);
    let handled = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runs = Vec::new();
    for lease in [secs(30), ms(300)] {
        let service = recorder(&handled);
        let worker = Worker::new(server.client(), queue.clone(), service)
            .lease(lease)
            .unwrap();
        let mut stopped = stopped.clone();
        runs.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
        tokio::time::sleep(ms(100)).await;
    }
    eventually("the short-lease worker recovers it", secs(4), async || {
        let handled = handled.lock().unwrap().clone();
        done_if(handled == [7], format_args!("handled {handled:?}"))
    })
    .await;
    let _ = stop.send(true);
    for run in runs {
        run.await.unwrap().unwrap();
    }
}
