//! Keyed messages (`PushOptions::key`): how long a cold key's message waits
//! while hot keys have a backlog, beside the same without the backlog, what
//! a claim costs as the number of keys with waiting messages grows, what a
//! push of one message costs the server keyed beside unkeyed, and how
//! close one hot key comes to 1 / (handler time + one round trip); what
//! reading a keyed queue costs, and a recovery sweep on one server and on
//! a Redis Cluster.
//!
//! `cargo bench --bench keyed` (full run); built and run on tiny inputs by
//! `cargo test --all-targets`.

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::*;
use lockgate::testing::RedisServer;
use lockgate::{BoxError, Job, PushOptions, Queue, Worker};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    key: String,
    /// When it was pushed (unix µs, this host's clock).
    pushed: u64,
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // `KEYED_BENCH=reads` (say) runs that part alone.
    let only = std::env::var("KEYED_BENCH").ok();
    let runs = |part: &str| only.as_deref().is_none_or(|only| only == part);
    if runs("cold") {
        println!("## a cold key's message under hot keys' backlog: push → handler start");
        println!(
            "3 workers × concurrency 8 in one process, handlers 2 ms; a cold message every 20 ms"
        );
        println!("| hot backlog | cold messages | p50 | p99 | max |\n|---|---|---|---|---|");
        for backlog in [0, size(2_000, 20)] {
            cold_latency(backlog).await?;
        }
    }
    if runs("claims") {
        println!("\n## claim cost as keys with waiting messages grow (one message per key)");
        println!(
            "| keys | claimed and acknowledged per s, one claimer, batches of 100 |\n|---|---|"
        );
        for keys in [size(1_000, 10), size(100_000, 100)] {
            claim_cost(keys).await?;
        }
    }
    if runs("renew") {
        println!(
            "\n## renewing the leases of messages in flight, keyed (one per key) beside unkeyed"
        );
        println!(
            "median of 5 `Queue::extend` calls over all of them; commands and the server's time in `EVALSHA` per call (`INFO commandstats`)"
        );
        println!(
            "| in flight | keyed | its commands | its server time | unkeyed | its commands | its server time |\n|---|---|---|---|---|---|---|"
        );
        for n in [size(1_000, 10), size(10_000, 20)] {
            renew_cost(n).await?;
        }
    }
    if runs("hot") {
        println!(
            "\n## one hot key, handlers of 2 ms: messages per second beside 1 / (handler + round trip)"
        );
        println!(
            "| messages | per s | handler (mean) | round trip (mean PING) | ceiling | share |\n|---|---|---|---|---|---|"
        );
        hot_key(size(3_000, 30)).await?;
    }
    if runs("push") {
        println!("\n## pushing one message at a time, keyed beside unkeyed");
        println!(
            "server µs per push: the push script's or function's time per call (`INFO commandstats`), median of 5 rounds"
        );
        println!(
            "| messages per round | keyed, a key each | keyed, one key | unkeyed |\n|---|---|---|---|"
        );
        push_cost(size(5_000, 20)).await?;
    }
    if runs("reads") {
        println!(
            "\n## reading a queue of one message per key beside one of as many messages without a key"
        );
        println!(
            "median of 5 calls; commands: `INFO commandstats` per call, scripts' inner commands included"
        );
        println!(
            "| messages | keyed stats | its commands | unkeyed stats | its commands | keyed recovery sweep | its commands | key_stats(10) | its commands | queue_names | its commands | first sweep of 5 minutes (every partition) | its commands |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for keys in [size(10_000, 100), size(100_000, 200)] {
            reads(keys).await?;
        }
    }
    if runs("cluster_drain") {
        println!(
            "\n## draining keyed messages on a 3-master Redis Cluster, one message per key, three claimers (a handle each), batches of 100"
        );
        println!(
            "commands: `INFO commandstats` of every node, scripts' inner commands included, per message"
        );
        println!("| messages | per s | commands per message |\n|---|---|---|");
        for keys in [size(1_000, 10), size(10_000, 100)] {
            cluster_drain(keys).await?;
        }
    }
    if runs("cluster_sweeps") {
        println!(
            "\n## recovery sweeps, stats and looks on a 3-master Redis Cluster, one message per key, 1,000 of them at work (a 10-minute lease)"
        );
        println!(
            "median of 5 calls; commands: `INFO commandstats` of every node per call, scripts' inner commands included"
        );
        println!(
            "| messages | partitions | recovery sweep | its commands | first sweep of 5 minutes (every partition) | its commands | stats | its commands | recent_stats(10 s), kept | its commands | peek(10) | its commands | key_stats(10) | its commands | dead_letters(20) | its commands |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        for keys in [size(10_000, 100), size(100_000, 200)] {
            cluster_sweeps(keys).await?;
        }
    }
    Ok(())
}

/// A connection to each node of `cluster`, to read their commands.
async fn node_managers(
    cluster: &lockgate::testing::RedisCluster,
) -> Result<Vec<redis::aio::ConnectionManager>, BoxError> {
    let mut nodes = Vec::new();
    for node in cluster.nodes() {
        nodes.push(node.connection_manager().await?);
    }
    Ok(nodes)
}

/// Recovery sweeps of a keyed queue of `n` messages, a key each, on a
/// cluster: the first of 5 minutes (every partition) and the quiet ones
/// after it (those the leases index names).
async fn cluster_sweeps(n: usize) -> Result<(), BoxError> {
    let cluster = lockgate::testing::RedisCluster::start()?;
    let conn = cluster.connection().await?;
    let keyed: Queue<Msg, _> = Queue::new(conn.clone(), "keyed")?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let msgs = chunk.iter().map(|n| {
            let msg = Msg {
                key: format!("k{n}"),
                pushed: 0,
            };
            (msg, PushOptions::new().key(format!("k{n}")))
        });
        keyed.push_many_with(msgs).await?;
    }
    let mut at_work = 0;
    while at_work < n.min(1000) {
        let room = (n.min(1000) - at_work).min(100);
        at_work += keyed
            .claim(room, Duration::from_secs(600))
            .await?
            .jobs
            .len();
    }
    let partitions: u64 = redis::cmd("ZCARD")
        .arg("lockgate:{keyed}:partitions")
        .query_async(&mut conn.clone())
        .await?;
    let nodes = node_managers(&cluster).await?;
    let (started, before) = (Instant::now(), commands_on(&nodes).await?);
    keyed.recover(3).await?;
    let full_ms = ms(started.elapsed());
    // Each read of the counts costs one `INFO` per node.
    let full_cmds = commands_on(&nodes).await? - before - nodes.len() as u64;
    let (sweep_ms, sweep_cmds) =
        timed(&nodes, || async { keyed.recover(3).await.map(drop) }).await?;
    let (stats_ms, stats_cmds) = timed(&nodes, || async { keyed.stats().await.map(drop) }).await?;
    keyed.recent_stats(Duration::from_secs(10)).await?;
    let (kept_ms, kept_cmds) = timed(&nodes, || async {
        keyed.recent_stats(Duration::from_secs(10)).await.map(drop)
    })
    .await?;
    let (peek_ms, peek_cmds) = timed(&nodes, || async { keyed.peek(10).await.map(drop) }).await?;
    keyed.key_stats(10).await?;
    let (keys_ms, keys_cmds) =
        timed(&nodes, || async { keyed.key_stats(10).await.map(drop) }).await?;
    let (dead_ms, dead_cmds) = timed(&nodes, || async {
        keyed.dead_letters(None, 20).await.map(drop)
    })
    .await?;
    println!(
        "| {n} | {partitions} | {sweep_ms:.1} ms | {sweep_cmds} | {full_ms:.1} ms | {full_cmds} | {stats_ms:.1} ms | {stats_cmds} | {kept_ms:.1} ms | {kept_cmds} | {peek_ms:.1} ms | {peek_cmds} | {keys_ms:.1} ms | {keys_cmds} | {dead_ms:.1} ms | {dead_cmds} |"
    );
    Ok(())
}

/// Pushes `n` keyed messages, a key each, on a 3-master cluster, then
/// three claimers (a queue handle each, as three processes would have)
/// claim and acknowledge them 100 at a time until none is left: messages
/// per second, and every node's commands per message.
async fn cluster_drain(n: usize) -> Result<(), BoxError> {
    let cluster = lockgate::testing::RedisCluster::start()?;
    let conn = cluster.connection().await?;
    let producer: Queue<Msg, _> = Queue::new(conn.clone(), "drained")?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let msgs = chunk.iter().map(|n| {
            let key = format!("k{n}");
            let msg = Msg {
                key: key.clone(),
                pushed: 0,
            };
            (msg, PushOptions::new().key(key))
        });
        producer.push_many_with(msgs).await?;
    }
    let nodes = node_managers(&cluster).await?;
    let (started, before) = (Instant::now(), commands_on(&nodes).await?);
    let total = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let claimers = (0..3).map(|_| {
        let queue: Result<Queue<Msg, _>, _> = Queue::new(conn.clone(), "drained");
        let total = total.clone();
        async move {
            let queue = queue?;
            let mut empty = 0;
            // Until every message is handled (a safety stop after 2,000
            // empty claims, 2 ms apart).
            while total.load(Ordering::Relaxed) < n && empty < 2_000 {
                let jobs = queue.claim(100, Duration::from_secs(60)).await?.jobs;
                if jobs.is_empty() {
                    empty += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                queue.ack_many(&jobs).await?;
                total.fetch_add(jobs.len(), Ordering::Relaxed);
            }
            Ok::<(), BoxError>(())
        }
    });
    futures_util::future::try_join_all(claimers).await?;
    let done = total.load(Ordering::Relaxed);
    let elapsed = started.elapsed().as_secs_f64();
    let commands = commands_on(&nodes).await? - before;
    let per_msg = commands as f64 / done.max(1) as f64;
    println!(
        "| {n} ({done} handled) | {:.0} | {per_msg:.1} |",
        done as f64 / elapsed
    );
    Ok(())
}

/// The server's time in the push scripts and functions so far (`EVALSHA`,
/// `FCALL`), in µs, and their calls (`INFO commandstats`).
async fn push_us(conn: &redis::aio::ConnectionManager) -> Result<(u64, u64), BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let field = |line: &str, name: &str| {
        let (_, rest) = line.split_once(name)?;
        rest.split(',').next()?.parse::<u64>().ok()
    };
    let (mut usec, mut calls) = (0, 0);
    for line in info.lines() {
        if line.starts_with("cmdstat_evalsha:") || line.starts_with("cmdstat_fcall:") {
            usec += field(line, "usec=").unwrap_or(0);
            calls += field(line, "calls=").unwrap_or(0);
        }
    }
    Ok((usec, calls))
}

/// `n` messages pushed one at a time (`push_with`, one call each) with a
/// key each, with one key, and without a key, on one fresh server, 5
/// rounds alternated: the server's time per push, median of the rounds.
async fn push_cost(n: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<u64> = Queue::new(conn.clone(), "pushes")?;
    let mut per_push = [Vec::new(), Vec::new(), Vec::new()];
    for round in 0..5 {
        for (side, times) in per_push.iter_mut().enumerate() {
            let before = push_us(&conn).await?;
            for i in 0..n {
                let id = format!("{round}-{side}-{i}");
                let options = match side {
                    0 => PushOptions::new().key(format!("k{i}")),
                    1 => PushOptions::new().key("one"),
                    _ => PushOptions::new(),
                };
                queue.push_with(i as u64, options.id(id)).await?;
            }
            let after = push_us(&conn).await?;
            let calls = (after.1 - before.1).max(1);
            times.push((after.0 - before.0) as f64 / calls as f64);
        }
    }
    let [keyed, one, plain] = per_push.map(median);
    println!("| {n} | {keyed:.1} µs | {one:.1} µs | {plain:.1} µs |");
    Ok(())
}

/// The commands the server has run so far (`INFO commandstats`).
async fn commands(conn: &redis::aio::ConnectionManager) -> Result<u64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let calls = info.lines().filter_map(|line| {
        let (_, rest) = line.split_once("calls=")?;
        rest.split(',').next()?.parse::<u64>().ok()
    });
    Ok(calls.sum())
}

/// Commands `nodes` (one server, or every node of a cluster) ran so far.
async fn commands_on(nodes: &[redis::aio::ConnectionManager]) -> Result<u64, BoxError> {
    let mut total = 0;
    for node in nodes {
        total += commands(node).await?;
    }
    Ok(total)
}

/// The median time of 5 runs of `call`, and its commands per run over
/// `nodes` (one server's connection, or one to every node of a cluster).
async fn timed<F, Fut>(
    nodes: &[redis::aio::ConnectionManager],
    call: F,
) -> Result<(f64, u64), BoxError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = lockgate::Result<()>>,
{
    let (mut times, before) = (Vec::new(), commands_on(nodes).await?);
    for _ in 0..5 {
        let started = Instant::now();
        call().await?;
        times.push(ms(started.elapsed()));
    }
    // Each INFO call counts itself once.
    let ran = commands_on(nodes).await? - before - nodes.len() as u64;
    Ok((median(times), ran / 5))
}

/// The server's time in `EVALSHA` so far, in µs (`INFO commandstats`).
async fn script_us(conn: &redis::aio::ConnectionManager) -> Result<u64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let line = info
        .lines()
        .find(|line| line.starts_with("cmdstat_evalsha:"));
    let usec = line.and_then(|line| line.split_once("usec=")?.1.split(',').next()?.parse().ok());
    Ok(usec.unwrap_or(0))
}

/// Claims `n` messages of `queue`, all of them in line.
async fn claim_all(queue: &Queue<Msg>, n: usize) -> Result<Vec<Job<Msg>>, BoxError> {
    let mut jobs = Vec::with_capacity(n);
    while jobs.len() < n {
        let claimed = queue.claim(1000, Duration::from_secs(60)).await?.jobs;
        if claimed.is_empty() {
            return Err(format!("claimed {} of {n}", jobs.len()).into());
        }
        jobs.extend(claimed);
    }
    Ok(jobs)
}

/// One `extend` over `n` messages in flight, keyed on `n` keys, beside
/// `n` without a key, on one fresh server: what a worker's renewal of
/// its in-flight messages costs every third of its lease.
async fn renew_cost(n: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let keyed: Queue<Msg> = Queue::new(conn.clone(), "keyed")?;
    let plain: Queue<Msg> = Queue::new(conn.clone(), "plain")?;
    let msg = |key: String| Msg { key, pushed: 0 };
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let msgs = chunk.iter().map(|k| {
            (
                msg(format!("k{k}")),
                PushOptions::new().key(format!("k{k}")),
            )
        });
        keyed.push_many_with(msgs).await?;
        plain
            .push_many(chunk.iter().map(|_| msg(String::new())))
            .await?;
    }
    let lease = Duration::from_secs(60);
    let mut row = format!("| {n} |");
    for queue in [&keyed, &plain] {
        let jobs = claim_all(queue, n).await?;
        let before = script_us(&conn).await?;
        let (took, commands) = timed(std::slice::from_ref(&conn), || async {
            queue.extend(&jobs, lease).await.map(|_| ())
        })
        .await?;
        let server_ms = (script_us(&conn).await? - before) as f64 / 5_000.0;
        row += &format!(" {took:.1} ms | {commands} | {server_ms:.1} ms |");
    }
    println!("{row}");
    Ok(())
}

/// `stats()` of a queue of `n` messages on `n` keys beside one of `n`
/// messages without a key, a recovery sweep of the keyed one (nothing
/// expired: the cost of looking), its `key_stats(10)`, and the listing of
/// the server's queues (`queue_names`).
async fn reads(n: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let keyed: Queue<Msg> = Queue::new(conn.clone(), "keyed")?;
    let plain: Queue<Msg> = Queue::new(conn.clone(), "plain")?;
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let msg = |n: &usize| Msg {
            key: format!("k{n}"),
            pushed: 0,
        };
        let keyed_msgs = chunk
            .iter()
            .map(|n| (msg(n), PushOptions::new().key(format!("k{n}"))));
        keyed.push_many_with(keyed_msgs).await?;
        plain.push_many(chunk.iter().map(msg)).await?;
    }
    let (keyed_ms, keyed_cmds) = timed(std::slice::from_ref(&conn), || async {
        keyed.stats().await.map(drop)
    })
    .await?;
    let (plain_ms, plain_cmds) = timed(std::slice::from_ref(&conn), || async {
        plain.stats().await.map(drop)
    })
    .await?;
    // The first recovery of every 5 minutes visits every partition: timed
    // alone; those after it visit what the leases index names.
    let (started, before) = (Instant::now(), commands(&conn).await?);
    keyed.recover(3).await?;
    let full_ms = ms(started.elapsed());
    let full_cmds = commands(&conn).await? - before - 1;
    let (sweep_ms, sweep_cmds) = timed(std::slice::from_ref(&conn), || async {
        keyed.recover(3).await.map(drop)
    })
    .await?;
    let (keys_ms, keys_cmds) = timed(std::slice::from_ref(&conn), || async {
        keyed.key_stats(10).await.map(drop)
    })
    .await?;
    let (names_ms, names_cmds) = timed(std::slice::from_ref(&conn), || async {
        lockgate::queue::queue_names(&conn, "lockgate")
            .await
            .map(drop)
    })
    .await?;
    println!(
        "| {n} | {keyed_ms:.1} ms | {keyed_cmds} | {plain_ms:.1} ms | {plain_cmds} | {sweep_ms:.1} ms | {sweep_cmds} | {keys_ms:.1} ms | {keys_cmds} | {names_ms:.1} ms | {names_cmds} | {full_ms:.1} ms | {full_cmds} |"
    );
    Ok(())
}

/// `messages` messages on one key, a worker of 4 slots, each handler
/// sleeping 2 ms (tokio's timer rounds up to its millisecond: the handler
/// time is measured, and the ceiling uses it).
async fn hot_key(messages: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "keyed")?;
    for chunk in (0..messages).collect::<Vec<_>>().chunks(1000) {
        let msgs = chunk.iter().map(|_| {
            let msg = Msg {
                key: "hot".into(),
                pushed: 0,
            };
            (msg, PushOptions::new().key("hot"))
        });
        queue.push_many_with(msgs).await?;
    }
    let mut ping = conn.clone();
    let rtt_started = Instant::now();
    for _ in 0..1000 {
        redis::cmd("PING").query_async::<()>(&mut ping).await?;
    }
    let rtt = rtt_started.elapsed() / 1000;
    let busy = Arc::new(Mutex::new((0usize, Duration::ZERO)));
    let seen = busy.clone();
    let service = tower::service_fn(move |_: Job<Msg>| {
        let seen = seen.clone();
        async move {
            let started = Instant::now();
            tokio::time::sleep(Duration::from_millis(2)).await;
            let mut busy = seen.lock().unwrap_or_else(|e| e.into_inner());
            busy.0 += 1;
            busy.1 += started.elapsed();
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue, service).concurrency(4)?;
    let started = Instant::now();
    let done = busy.clone();
    worker
        .run_until(async move {
            while done.lock().unwrap_or_else(|e| e.into_inner()).0 < messages {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await?;
    let elapsed = started.elapsed();
    let (handled, spent) = *busy.lock().unwrap_or_else(|e| e.into_inner());
    let handler = spent / handled.max(1) as u32;
    let rate = handled as f64 / elapsed.as_secs_f64();
    let ceiling = 1.0 / (handler + rtt).as_secs_f64();
    println!(
        "| {handled} | {rate:.0} | {:.3} ms | {:.3} ms | {ceiling:.0} | {:.1} % |",
        handler.as_secs_f64() * 1e3,
        rtt.as_secs_f64() * 1e3,
        rate / ceiling * 100.0
    );
    Ok(())
}

/// 5 hot keys with `backlog` messages each, pushed first; then 100 cold
/// messages, each on a key of its own, one every 20 ms.
async fn cold_latency(backlog: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn, "keyed")?;
    for key in 0..5 {
        let key = format!("hot-{key}");
        for chunk in (0..backlog).collect::<Vec<_>>().chunks(1000) {
            let msgs = chunk.iter().map(|_| {
                let msg = Msg {
                    key: key.clone(),
                    pushed: 0,
                };
                (msg, PushOptions::new().key(key.clone()))
            });
            queue.push_many_with(msgs).await?;
        }
    }
    let lags = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for _ in 0..3 {
        let conn = server.connection_manager().await?;
        let queue: Queue<Msg> = Queue::new(conn, "keyed")?;
        let lags = lags.clone();
        let service = tower::service_fn(move |job: Job<Msg>| {
            let lags = lags.clone();
            async move {
                if job.pushed > 0 {
                    let lag = Duration::from_micros(unix_us().saturating_sub(job.pushed));
                    lags.lock().unwrap().push(lag);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, BoxError>(())
            }
        });
        let worker = Worker::new(server.client(), queue, service).concurrency(8)?;
        let mut stopped = stopped.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cold = size(100, 20);
    for n in 0..cold {
        let key = format!("cold-{n}");
        let msg = Msg {
            key: key.clone(),
            pushed: unix_us(),
        };
        queue.push_with(msg, PushOptions::new().key(key)).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    while lags.lock().unwrap().len() < cold {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let left = queue.stats().await?;
    let _ = stop.send(true);
    for worker in workers {
        worker.await??;
    }
    let mut lags = lags.lock().unwrap().clone();
    lags.sort();
    println!(
        "| {} ({} still waiting at the end) | {cold} | {:.2} ms | {:.2} ms | {:.2} ms |",
        backlog * 5,
        left.due,
        ms(quantile(&lags, 0.5)),
        ms(quantile(&lags, 0.99)),
        ms(*lags.last().unwrap_or(&Duration::ZERO)),
    );
    Ok(())
}

/// `keys` keys with one message each; one claimer takes them all in
/// batches of 100, acknowledging each batch.
async fn claim_cost(keys: usize) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn, "keyed")?;
    for chunk in (0..keys).collect::<Vec<_>>().chunks(1000) {
        let msgs = chunk.iter().map(|n| {
            let key = format!("k{n}");
            (
                Msg {
                    key: key.clone(),
                    pushed: 0,
                },
                PushOptions::new().key(key),
            )
        });
        queue.push_many_with(msgs).await?;
    }
    let started = Instant::now();
    let mut done = 0;
    let mut empty = 0;
    while done < keys && empty < 100 {
        let jobs = queue.claim(100, Duration::from_secs(60)).await?.jobs;
        if jobs.is_empty() {
            empty += 1;
            continue;
        }
        done += jobs.len();
        queue.ack_many(&jobs).await?;
    }
    let rate = done as f64 / started.elapsed().as_secs_f64();
    println!("| {keys} ({done} claimed) | {rate:.0} |");
    Ok(())
}
