//! One queue over shards (`Queue::shards`): on one master, n shards
//! against the one-slot queue (throughput, server CPU and commands per
//! message); on a three-master cluster, the sharded queue against the
//! one-slot queue (each master's share of the commands, server CPU per
//! message summed over the masters), for messages without a key and keyed
//! ones. Each pair is measured in the same run, alternately.
//!
//! `cargo bench --bench shards` (full run; `-- --bench cluster` for one
//! section); built and run on tiny inputs by `cargo test --all-targets`.
//! `SHARDS_ROUNDS=<r>` runs each comparison r times (3 by default), and
//! `SHARDS_EACH=1` prints each run's figures to stderr;
//! `SHARDS_KEYS=<k>` gives the one-master run's messages k keys;
//! `SHARDS_SERVER_ARGS="--zset-max-listpack-entries 0"` starts every
//! server with those arguments (see BENCHMARKS.md: the shards' small active sets).

mod common;

use std::time::Duration;

use common::*;
use lockgate::testing::{RedisCluster, RedisServer};
use lockgate::{BoxError, PushOptions, Queue};
use redis::aio::ConnectionLike;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let run = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    if run("one_master") {
        one_master().await?;
    }
    if run("cluster") {
        cluster().await?;
    }
    Ok(())
}

/// What one run through a queue cost: messages/s of the worker, server CPU
/// and commands per message (summed over the servers), each server's
/// commands.
struct Run {
    rate: f64,
    cpu_us: f64,
    commands: f64,
    scripts: f64,
    /// The servers' reads from clients (`total_reads_processed`).
    reads: f64,
    /// The servers' sleeps (voluntary context switches, Linux).
    sleeps: f64,
    per_server: Vec<u64>,
}

/// One server's counters: CPU time, commands, script calls, reads, sleeps.
type Counters = (Duration, u64, u64, u64, u64);

/// How often the server process `pid` has gone to sleep (it waits for
/// clients in `epoll_wait`): its voluntary context switches; 0 where
/// `/proc` does not say.
fn sleeps(pid: Option<u32>) -> u64 {
    let status = pid.and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/status")).ok());
    let field = status.as_deref().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
    });
    field.and_then(|n| n.trim().parse().ok()).unwrap_or(0)
}

/// A server's reads from its clients so far: each is one wake-up of its
/// event loop for a connection, however many requests it carried.
async fn reads(conn: &redis::aio::MultiplexedConnection) -> Result<u64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut conn.clone())
        .await?;
    let field = info
        .lines()
        .find_map(|l| l.strip_prefix("total_reads_processed:"))
        .ok_or("INFO stats has no total_reads_processed")?;
    Ok(field.trim().parse()?)
}

/// Every server's counters so far.
async fn counters(nodes: &[&RedisServer]) -> Result<Vec<Counters>, BoxError> {
    let mut out = Vec::new();
    for node in nodes {
        let mut conn = node.multiplexed().await?;
        let calls = lockgate::testing::command_calls(&mut conn).await?;
        let all = calls
            .iter()
            .filter(|(name, _)| *name != "info")
            .map(|(_, n)| n)
            .sum();
        let scripts = calls.get("evalsha").copied().unwrap_or(0);
        let cpu = server_cpu(&conn).await?;
        out.push((cpu, all, scripts, reads(&conn).await?, sleeps(node.pid())));
    }
    Ok(out)
}

/// Pushes `n` messages (keyed over `keys` keys when `keys` > 0) in batches
/// of 1000, then drains them with a worker at concurrency 50 and a no-op
/// handler; measured on `nodes`.
async fn run_through<C, K>(
    queue: &Queue<u64, C>,
    connector: K,
    nodes: &[&RedisServer],
    (n, keys): (usize, usize),
) -> Result<Run, BoxError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: lockgate::queue::Connector + Clone,
{
    let before = counters(nodes).await?;
    let messages = (0..n as u64).map(|i| {
        let options = match keys {
            0 => PushOptions::new(),
            keys => PushOptions::new().key(format!("k{}", i % keys as u64)),
        };
        (i, options)
    });
    let messages: Vec<_> = messages.collect();
    for batch in messages.chunks(1000) {
        queue
            .push_many_with(batch.iter().map(|(m, o)| (m, o.clone())))
            .await?;
    }
    let rate = drain(connector, queue, n).await?;
    let after = counters(nodes).await?;
    let deltas: Vec<Counters> = (after.iter().zip(&before))
        .map(|(a, b)| {
            let cpu = a.0.saturating_sub(b.0);
            (
                cpu,
                a.1 - b.1,
                a.2 - b.2,
                a.3 - b.3,
                a.4.saturating_sub(b.4),
            )
        })
        .collect();
    let scripts: u64 = deltas.iter().map(|d| d.2).sum();
    let reads: u64 = deltas.iter().map(|d| d.3).sum();
    let sleeps: u64 = deltas.iter().map(|d| d.4).sum();
    let cpu: Duration = deltas.iter().map(|d| d.0).sum();
    let per_server: Vec<u64> = deltas.iter().map(|d| d.1).collect();
    if std::env::var_os("SHARDS_EACH").is_some() {
        let ms: Vec<u128> = deltas.iter().map(|d| d.0.as_millis()).collect();
        let per = cpu.as_secs_f64() * 1e6 / n as f64;
        eprintln!(
            "{}: {rate:.0}/s, {per:.1} µs per message, ms per server {ms:?}",
            queue.name()
        );
    }
    Ok(Run {
        rate,
        cpu_us: cpu.as_secs_f64() * 1e6 / n as f64,
        commands: per_server.iter().sum::<u64>() as f64 / n as f64,
        scripts: scripts as f64 / n as f64,
        reads: reads as f64 / n as f64,
        sleeps: sleeps as f64 / n as f64,
        per_server,
    })
}

/// The medians of runs' rate, CPU, commands, script calls, reads and
/// sleeps per message.
fn medians(runs: &[Run]) -> (f64, f64, f64, f64, f64, f64) {
    let of = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    (
        of(|r| r.rate),
        of(|r| r.cpu_us),
        of(|r| r.commands),
        of(|r| r.scripts),
        of(|r| r.reads),
        of(|r| r.sleeps),
    )
}

/// Rounds of each comparison: 3 in a full run (`SHARDS_ROUNDS` for more),
/// 1 on tiny inputs.
fn rounds() -> usize {
    match full_run() {
        true => std::env::var("SHARDS_ROUNDS")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(3),
        false => 1,
    }
}

/// The largest deviation of a server's share from the mean, in %.
fn spread(per_server: &[u64]) -> f64 {
    let mean = per_server.iter().sum::<u64>() as f64 / per_server.len() as f64;
    let worst = per_server
        .iter()
        .map(|n| (*n as f64 - mean).abs())
        .fold(0.0, f64::max);
    100.0 * worst / mean
}

async fn one_master() -> Result<(), BoxError> {
    let n = size(100_000, 2_000);
    let rounds = rounds();
    let (mut one, mut four) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for shards in [1, 4] {
            let mut builder = RedisServer::builder();
            if let Ok(args) = std::env::var("SHARDS_SERVER_ARGS") {
                builder = builder.args(args.split_whitespace());
            }
            let server = builder.start()?;
            let conn = server.connection_manager().await?;
            let queue: Queue<u64> = Queue::new(conn, format!("e2e{round}"))?.shards(shards)?;
            let keys = std::env::var("SHARDS_KEYS")
                .ok()
                .and_then(|k| k.parse().ok())
                .unwrap_or(0);
            let run = run_through(&queue, server.client(), &[&server], (n, keys)).await?;
            if shards == 1 {
                one.push(run)
            } else {
                four.push(run)
            }
        }
    }
    let ((r1, c1, k1, s1, d1, w1), (r4, c4, k4, s4, d4, w4)) = (medians(&one), medians(&four));
    println!(
        "## one master: {n} messages pushed (batches of 1000), then a worker at concurrency 50 with a no-op handler (median of {rounds}, alternated)"
    );
    println!(
        "| queue | messages/s | server CPU µs per message | Redis commands per message | script calls per message | reads from clients per message | server sleeps per message |\n|---|---|---|---|---|---|---|"
    );
    println!(
        "| one slot (`Queue::new`) | {r1:.0} | {c1:.1} | {k1:.2} | {s1:.3} | {d1:.3} | {w1:.3} |"
    );
    println!(
        "| 4 shards on the same server | {r4:.0} | {c4:.1} | {k4:.2} | {s4:.3} | {d4:.3} | {w4:.3} |"
    );
    println!(
        "4 shards / one slot: throughput {:.1} %, server CPU {:.1} %\n",
        100.0 * r4 / r1,
        100.0 * c4 / c1
    );
    Ok(())
}

async fn cluster() -> Result<(), BoxError> {
    let n = size(60_000, 1_500);
    let rounds = rounds();
    let mut builder = RedisCluster::builder();
    if let Ok(args) = std::env::var("SHARDS_SERVER_ARGS") {
        builder = builder.args(args.split_whitespace());
    }
    let cluster = builder.start()?;
    let nodes: Vec<&RedisServer> = cluster.nodes().iter().collect();
    let conn = cluster.connection().await?;
    println!(
        "## three-master cluster: {n} messages pushed (batches of 1000), then a worker at concurrency 50 with a no-op handler (median of {rounds}, alternated)"
    );
    println!(
        "| workload | queue | messages/s | server CPU µs per message (all masters) | commands per message | script calls per message | reads from clients per message | server sleeps per message | commands per master | largest deviation from the mean |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    // Without keys, a third placement: the same 3 shards with their slots
    // moved to one master. Beside the spread shards, it tells sharding's
    // own cost from that of three servers sharing this machine's one core.
    let placements: [(&str, usize, bool); 3] = [
        ("one slot", 1, false),
        ("3 shards", 3, false),
        ("3 shards, slots moved to one master", 3, true),
    ];
    for (workload, keys) in [("without keys", 0), ("keyed, 1000 keys", 1000)] {
        let placements = &placements[..if keys == 0 { 3 } else { 2 }];
        let mut runs: Vec<Vec<Run>> = placements.iter().map(|_| Vec::new()).collect();
        for round in 0..rounds {
            for (i, (_, shards, together)) in placements.iter().enumerate() {
                let name = format!("c{round}-{keys}-{shards}-{together}");
                let moved = match together {
                    true => gather(&cluster, &conn, &name, *shards).await?,
                    false => Vec::new(),
                };
                let queue: Queue<u64, _> = Queue::new(conn.clone(), name)?.shards(*shards)?;
                runs[i].push(run_through(&queue, cluster.client(), &nodes, (n, keys)).await?);
                for (slot, home) in moved {
                    tokio::task::block_in_place(|| {
                        cluster.move_slot(slot, home, (100, Duration::ZERO))
                    })?;
                }
            }
        }
        for ((label, ..), runs) in placements.iter().zip(&runs) {
            let (rate, cpu, commands, scripts, reads, sleeps) = medians(runs);
            let last = &runs[runs.len() - 1].per_server;
            let spread = spread(last);
            println!(
                "| {workload} | {label} | {rate:.0} | {cpu:.1} | {commands:.2} | {scripts:.3} | {reads:.3} | {sleeps:.3} | {last:?} | {spread:.0} % |"
            );
        }
        let c1 = medians(&runs[0]).1;
        for ((label, ..), runs) in placements.iter().zip(&runs).skip(1) {
            println!(
                "| {workload} | {label} / one slot, server CPU | | {:.1} % | | | | | | |",
                100.0 * medians(runs).1 / c1
            );
        }
    }
    println!();
    Ok(())
}

/// Moves the slots of queue `name`'s shards 1.. to the master of shard 0
/// (shard `i` is in slot `(CRC16(name) + i × 16384 / shards) mod 16384`);
/// returns each moved slot with the master it came from.
async fn gather<C: ConnectionLike + Clone>(
    cluster: &RedisCluster,
    conn: &C,
    name: &str,
    shards: usize,
) -> Result<Vec<(u16, usize)>, BoxError> {
    let first: u16 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(name)
        .query_async(&mut conn.clone())
        .await?;
    let home = cluster.node_of_slot(first);
    let mut moved = Vec::new();
    for i in 1..shards {
        let slot = ((usize::from(first) + i * 16384 / shards) % 16384) as u16;
        let from = cluster.node_of_slot(slot);
        tokio::task::block_in_place(|| cluster.move_slot(slot, home, (100, Duration::ZERO)))?;
        moved.push((slot, from));
    }
    Ok(moved)
}
