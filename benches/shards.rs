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
//! `SHARDS_EACH=1` prints each run's figures to stderr, with its commands per
//! message by command;
//! `SHARDS_KEYS=<k>` gives the one-master run's messages k keys;
//! `SHARDS_SERVER_ARGS="--zset-max-listpack-entries 0"` starts every
//! server with those arguments (see BENCHMARKS.md: the shards' small active sets);
//! `SHARDS_MESSAGES=<n>` pushes n messages per run of a full run instead
//! of the default. Run under `benches/callgrind.sh`, the servers run under
//! Valgrind's callgrind and each run adds the instructions the servers
//! executed per message (user space), less what they execute idle (their
//! timers, the cluster bus) over the run's time, measured for a second
//! before it: a count that does not depend on how the servers share this
//! machine's cores.

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
    /// Of `cpu_us`, the part spent in the kernel (`used_cpu_sys`).
    sys_us: f64,
    commands: f64,
    scripts: f64,
    /// The servers' reads from clients (`total_reads_processed`).
    reads: f64,
    /// The servers' sleeps (voluntary context switches, Linux).
    sleeps: f64,
    /// The servers' instructions, when they run under callgrind, less
    /// those they execute idle over the run's time.
    instructions: f64,
    per_server: Vec<u64>,
}

/// One server's counters so far (or over a run).
#[derive(Clone, Copy, Default)]
struct Counters {
    /// CPU time, user and system, in µs (`INFO cpu`).
    user_us: u64,
    sys_us: u64,
    /// Commands (those inside scripts included) and script calls.
    commands: u64,
    scripts: u64,
    reads: u64,
    sleeps: u64,
    instructions: u64,
}

impl Counters {
    /// What `self` counted since `before`.
    fn since(self, before: Self) -> Self {
        Self {
            user_us: self.user_us.saturating_sub(before.user_us),
            sys_us: self.sys_us.saturating_sub(before.sys_us),
            commands: self.commands.saturating_sub(before.commands),
            scripts: self.scripts.saturating_sub(before.scripts),
            reads: self.reads.saturating_sub(before.reads),
            sleeps: self.sleeps.saturating_sub(before.sleeps),
            instructions: self.instructions.saturating_sub(before.instructions),
        }
    }

    /// The sum of `all`'s counters.
    fn sum(all: &[Self]) -> Self {
        all.iter().fold(Self::default(), |a, b| Self {
            user_us: a.user_us + b.user_us,
            sys_us: a.sys_us + b.sys_us,
            commands: a.commands + b.commands,
            scripts: a.scripts + b.scripts,
            reads: a.reads + b.reads,
            sleeps: a.sleeps + b.sleeps,
            instructions: a.instructions + b.instructions,
        })
    }
}

/// A server's CPU time so far, user and system, in µs (`INFO cpu`).
async fn server_cpu_us(conn: &redis::aio::MultiplexedConnection) -> Result<(u64, u64), BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn.clone())
        .await?;
    let field = |name: &str| -> Result<u64, BoxError> {
        let value = info.lines().find_map(|l| l.strip_prefix(name));
        let secs: f64 = value
            .ok_or(format!("INFO cpu has no {name}"))?
            .trim()
            .parse()?;
        Ok((secs * 1e6) as u64)
    };
    Ok((field("used_cpu_user:")?, field("used_cpu_sys:")?))
}

/// Whether the servers run under callgrind (`benches/callgrind.sh`).
fn under_callgrind() -> bool {
    std::env::var_os("LOCKGATE_CALLGRIND").is_some()
}

/// The instructions the server process `pid` has executed so far, summed
/// over its threads, as `callgrind_control -e Ir` tells them; 0 when the
/// servers do not run under callgrind.
fn instructions(pid: Option<u32>) -> Result<u64, BoxError> {
    let Some(pid) = pid.filter(|_| under_callgrind()) else {
        return Ok(0);
    };
    let out = std::process::Command::new("callgrind_control")
        .args(["-e", "Ir", &pid.to_string()])
        .output()?;
    let text = String::from_utf8(out.stdout)?;
    // `   Th 1  25,978,596`: one line per thread.
    let threads = text.lines().filter_map(|l| {
        let count = l.trim().strip_prefix("Th ")?.split_whitespace().nth(1)?;
        count.replace(',', "").parse::<u64>().ok()
    });
    match threads.collect::<Vec<_>>() {
        counts if counts.is_empty() => Err(format!("callgrind_control said: {text}").into()),
        counts => Ok(counts.iter().sum()),
    }
}

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

/// Every server's calls of each command so far (`INFO commandstats`,
/// scripts' inner commands included), summed over the servers.
async fn command_calls(
    nodes: &[&RedisServer],
) -> Result<std::collections::HashMap<String, u64>, BoxError> {
    let mut all = std::collections::HashMap::new();
    for node in nodes {
        let mut conn = node.multiplexed().await?;
        for (name, n) in lockgate::testing::command_calls(&mut conn).await? {
            *all.entry(name).or_insert(0) += n;
        }
    }
    Ok(all)
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
        let (user_us, sys_us) = server_cpu_us(&conn).await?;
        let (reads, pid) = (reads(&conn).await?, node.pid());
        let instructions = tokio::task::block_in_place(|| instructions(pid))?;
        out.push(Counters {
            user_us,
            sys_us,
            commands: all,
            scripts,
            reads,
            sleeps: sleeps(pid),
            instructions,
        });
    }
    Ok(out)
}

/// The instructions the servers execute per second while nothing is sent
/// to them (their timers, the cluster bus), over a second; 0 unless they
/// run under callgrind.
async fn idle_instructions_per_second(nodes: &[&RedisServer]) -> Result<f64, BoxError> {
    if !under_callgrind() {
        return Ok(0.0);
    }
    let (before, started) = (counters(nodes).await?, std::time::Instant::now());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = counters(nodes).await?;
    let idle: u64 = (after.iter().zip(&before))
        .map(|(a, b)| a.since(*b).instructions)
        .sum();
    Ok(idle as f64 / started.elapsed().as_secs_f64())
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
    let idle = idle_instructions_per_second(nodes).await?;
    let calls_before = command_calls(nodes).await?;
    let (before, started) = (counters(nodes).await?, std::time::Instant::now());
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
    let background = (idle * started.elapsed().as_secs_f64()) as u64;
    let deltas: Vec<Counters> = (after.iter().zip(&before))
        .map(|(a, b)| a.since(*b))
        .collect();
    let all = Counters::sum(&deltas);
    let per = |count: u64| count as f64 / n as f64;
    if std::env::var_os("SHARDS_EACH").is_some() {
        let ms: Vec<u64> = deltas
            .iter()
            .map(|d| (d.user_us + d.sys_us) / 1000)
            .collect();
        eprintln!(
            "{}: {rate:.0}/s, {:.1} µs per message ({:.1} system), ms per server {ms:?}",
            queue.name(),
            per(all.user_us + all.sys_us),
            per(all.sys_us)
        );
        let calls_after = command_calls(nodes).await?;
        let mut each: Vec<(String, u64)> = (calls_after.into_iter())
            .map(|(name, n)| {
                let was = calls_before.get(&name).copied().unwrap_or(0);
                (name, n - was.min(n))
            })
            .filter(|(name, n)| *n > 0 && name != "info")
            .collect();
        each.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        let each: Vec<String> = (each.iter())
            .map(|(name, n)| format!("{name} {:.2}", per(*n)))
            .collect();
        eprintln!("  commands per message: {}", each.join(", "));
    }
    Ok(Run {
        rate,
        cpu_us: per(all.user_us + all.sys_us),
        sys_us: per(all.sys_us),
        commands: per(all.commands),
        scripts: per(all.scripts),
        reads: per(all.reads),
        sleeps: per(all.sleeps),
        instructions: per(all.instructions.saturating_sub(background)),
        per_server: deltas.iter().map(|d| d.commands).collect(),
    })
}

/// The medians of runs' figures; the last run's commands per server.
fn medians(runs: &[Run]) -> Run {
    let of = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
    Run {
        rate: of(|r| r.rate),
        cpu_us: of(|r| r.cpu_us),
        sys_us: of(|r| r.sys_us),
        commands: of(|r| r.commands),
        scripts: of(|r| r.scripts),
        reads: of(|r| r.reads),
        sleeps: of(|r| r.sleeps),
        instructions: of(|r| r.instructions),
        per_server: runs
            .last()
            .map(|r| r.per_server.clone())
            .unwrap_or_default(),
    }
}

/// Messages per run: `SHARDS_MESSAGES`, or `full` in a full run and
/// `smoke` on tiny inputs.
fn messages(full: usize, smoke: usize) -> usize {
    let set = std::env::var("SHARDS_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok());
    set.filter(|_| full_run()).unwrap_or(size(full, smoke))
}

/// A run's instructions per message, as a table's last cell: empty unless
/// the servers run under callgrind.
fn instructions_cell(run: &Run) -> String {
    match under_callgrind() {
        true => format!(" {:.0} |", run.instructions),
        false => String::new(),
    }
}

/// The instructions column's heading, as [`instructions_cell`].
fn instructions_heading(what: &str) -> (String, &'static str) {
    match under_callgrind() {
        true => (
            format!(" server instructions per message ({what}, less idle) |"),
            "---|",
        ),
        false => (String::new(), ""),
    }
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
    let n = messages(100_000, 2_000);
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
    let (one, four) = (medians(&one), medians(&four));
    let (heading, rule) = instructions_heading("user space");
    println!(
        "## one master: {n} messages pushed (batches of 1000), then a worker at concurrency 50 with a no-op handler (median of {rounds}, alternated)"
    );
    println!(
        "| queue | messages/s | server CPU µs per message (of which system) | Redis commands per message | script calls per message | reads from clients per message | server sleeps per message |{heading}\n|---|---|---|---|---|---|---|{rule}"
    );
    for (label, run) in [
        ("one slot (`Queue::new`)", &one),
        ("4 shards on the same server", &four),
    ] {
        println!("| {label} | {} |{}", row(run), instructions_cell(run));
    }
    println!(
        "4 shards / one slot: throughput {:.1} %, server CPU {:.1} %\n",
        100.0 * four.rate / one.rate,
        100.0 * four.cpu_us / one.cpu_us
    );
    Ok(())
}

/// A run's rate, CPU (of which system), commands, script calls, reads and
/// sleeps, as cells.
fn row(run: &Run) -> String {
    format!(
        "{:.0} | {:.1} ({:.1}) | {:.2} | {:.3} | {:.3} | {:.3}",
        run.rate, run.cpu_us, run.sys_us, run.commands, run.scripts, run.reads, run.sleeps
    )
}

async fn cluster() -> Result<(), BoxError> {
    let n = messages(60_000, 1_500);
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
    let (heading, rule) = instructions_heading("all masters, user space");
    println!(
        "| workload | queue | messages/s | server CPU µs per message, all masters (of which system) | commands per message | script calls per message | reads from clients per message | server sleeps per message | commands per master | largest deviation from the mean |{heading}\n|---|---|---|---|---|---|---|---|---|---|{rule}"
    );
    // Without keys, a third placement: the same 3 shards with their slots
    // moved to one master. Beside the spread shards, it tells sharding's
    // own cost from that of three servers sharing this machine's one core.
    let placements: [(&str, usize, bool); 3] = [
        ("one slot", 1, false),
        ("3 shards", 3, false),
        ("3 shards, slots moved to one master", 3, true),
    ];
    let mut ratios = Vec::new();
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
        let medians: Vec<Run> = runs.iter().map(|runs| medians(runs)).collect();
        for ((label, ..), run) in placements.iter().zip(&medians) {
            let spread = spread(&run.per_server);
            println!(
                "| {workload} | {label} | {} | {:?} | {spread:.0} % |{}",
                row(run),
                run.per_server,
                instructions_cell(run)
            );
        }
        let one = &medians[0];
        for ((label, ..), run) in placements.iter().zip(&medians).skip(1) {
            let instructions = match under_callgrind() {
                true => format!(
                    ", instructions {:.1} %",
                    100.0 * run.instructions / one.instructions
                ),
                false => String::new(),
            };
            ratios.push(format!(
                "{workload}, {label} / one slot: server CPU {:.1} %{instructions}",
                100.0 * run.cpu_us / one.cpu_us
            ));
        }
    }
    // After the table, which a line between its rows would end.
    println!();
    for ratio in ratios {
        println!("{ratio}");
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
