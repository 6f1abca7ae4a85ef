//! Hot keys beside GroupMQ (npm `groupmq` 1.1, the free per-group FIFO queue
//! on Redis), in the same run: 30,000 messages over 10 keys, then 50,000
//! over 5 (10,000 per key), all pushed before the workers start, handled by 3 worker processes of
//! concurrency 8, each handler taking 1 to 4 ms. Reported for both:
//! messages per second, how busy each key was (the share of the run during
//! which one of its messages was being handled: with one at a time per key,
//! the ceiling is 100 %; and the same share of the time the key had
//! messages waiting, to its own last end, which leaves out the end of the
//! run after its backlog drained while others' had not), order inversions per key (a message that started
//! after a later-pushed one of its key), overlaps (two handlers of one key
//! at once: must be 0), and Redis commands and the server's CPU time
//! (`INFO cpu`, user and system) per message while handling.
//! Each side gets a fresh redis-server from `lockgate::testing`.
//!
//! ```text
//! cargo bench -p lockgate-bench --bench groupmq --no-run
//! benches/pin.sh 0 1 cargo bench -p lockgate-bench --bench groupmq   # server on CPU 0, clients on 1
//! cargo test -p lockgate-bench --bench groupmq                       # smoke run, tiny inputs
//! ```
//!
//! GroupMQ runs from `bench/groupmq/hot.mjs` (installed with `npm ci` there
//! on first use; needs `node` and `npm`). lockgate runs twice: the keyed
//! queue (messages pushed with `PushOptions::key`, a plain handler) in
//! runs of 8 (`Worker::key_batch`'s default) and one at a time
//! (`key_batch(1)`), and the layer recipe (unkeyed messages, a `LockLayer` with
//! `retry(4).then_defer(queue, until_released())`: into the key's line).
//!
//! Then many keys (issue 35, item 9): 30,000 messages over 10 to 100,000
//! keys, no-op handlers, the same 3 processes × 8: GroupMQ, lockgate's
//! keyed queue (runs of 8, and one at a time), and lockgate's queue without keys beside them (the ceiling
//! a keyed message is held to), and the floor (`floor/`: two bare scripts
//! that keep a key's messages in order under its lock, with none of the
//! keyed queue's other duties; what those duties cost), and the floor
//! again with every key its scripts touch declared by the caller, as the
//! keyed queue's must be (a claim takes among the keys its last call
//! named), and the lean layout (`floor/lean.rs`: the declared floor with
//! the duties a lone key's turn pays, laid out as a redesign would be).
//! `GROUPMQ_KEYS=<k>` runs either part at k
//! keys alone; `GROUPMQ_GAPS=1` prints, per lockgate run, where the keys'
//! idle time went (per gap size, per key, and each worker process's first
//! start and keys); `GROUPMQ_TIMELINE=1` prints, per lockgate run,
//! the messages ended per 100 ms (a stretch of zeros is keys left idle);
//! `GROUPMQ_ONLY=keyed` (or `keyed1`, `plain`, `floor`, `declared`,
//! `lean`) runs that side
//! of the many-keys part alone, three times (see `alone`);
//! `GROUPMQ_PROFILE=1` prints, per lockgate run, each command's calls and
//! server µs per message (`INFO commandstats`: a script's inner commands
//! count on their own and inside its `evalsha` (or `fcall`), so its own Lua
//! work is its `evalsha` time less theirs).
//! `GROUPMQ_BENCH=hot` or `many` runs one
//! part alone.

#[path = "../../benches/common/mod.rs"]
mod common;
mod floor;

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockgate::layer::DeferDelay;
use lockgate::testing::RedisServer;
use lockgate::{Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use serde::{Deserialize, Serialize};
use tower::ServiceBuilder;

/// (messages, keys) of each workload; smoke runs use the first, tiny.
const WORKLOADS: [(usize, usize); 2] = [(30_000, 10), (50_000, 5)];
/// The many-keys part: messages, and the key counts.
const MANY: (usize, [usize; 5]) = (30_000, [10, 100, 1_000, 10_000, 100_000]);
const WORKERS: usize = 3;
const CONCURRENCY: usize = 8;
/// Handler time, uniform in this range (ms).
const HANDLER: (u64, u64) = (1, 4);
/// No-op handlers (the many-keys part).
const NO_OP: (u64, u64) = (0, 0);
const ROLE: &str = "LOCKGATE_BENCH_ROLE";
/// The handler's time range a worker process runs, "<min>-<max>" ms.
const HANDLER_MS: &str = "LOCKGATE_BENCH_HANDLER";

/// How lockgate's side keeps a key's messages apart.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// The keyed queue: messages pushed with their key, in runs of
    /// `Worker::key_batch`'s default (8).
    Keyed,
    /// The same, one message at a time (`key_batch(1)`): what the keyed
    /// queue did before runs.
    KeyedOne,
    /// The layer recipe: unkeyed messages, a `LockLayer` that defers
    /// into the key's line.
    Layer,
    /// Messages without a key, a plain handler: no order per key.
    Plain,
    /// The floor of a keyed message's cost (`floor/`): two bare scripts,
    /// a key's line as a list, its lock as the lease.
    Floor,
    /// The floor with every key its scripts touch declared, as the keyed
    /// queue's must be: a claim takes among the keys its last one named.
    Declared,
    /// The declared floor with the keyed queue's duties a lone key's turn
    /// pays (`floor/lean.rs`): what a redesign laid out that way would
    /// cost.
    Lean,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Keyed => "keyed",
            Mode::KeyedOne => "keyed1",
            Mode::Layer => "layer",
            Mode::Plain => "plain",
            Mode::Floor => "floor",
            Mode::Declared => "declared",
            Mode::Lean => "lean",
        }
    }

    fn named(name: &std::ffi::OsStr) -> Self {
        [
            Mode::Keyed,
            Mode::KeyedOne,
            Mode::Layer,
            Mode::Plain,
            Mode::Floor,
            Mode::Declared,
            Mode::Lean,
        ]
        .into_iter()
        .find(|mode| name == mode.name())
        .unwrap_or(Mode::Plain)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Msg {
    key: String,
    seq: u64,
}

/// One run's figures (GroupMQ's script prints the same fields).
#[derive(Debug, Deserialize)]
struct Summary {
    handled: usize,
    seconds: f64,
    busy_min: f64,
    busy_mean: f64,
    backlogged_min: f64,
    backlogged_mean: f64,
    handler_ms: f64,
    inversions: usize,
    overlaps: usize,
    commands: u64,
    /// The server's CPU time while handling (user and system, seconds).
    server_cpu: f64,
}

fn main() -> Result<(), BoxError> {
    let runtime = tokio::runtime::Runtime::new()?;
    if let Some(role) = std::env::var_os(ROLE) {
        let url = std::env::args().nth(1).ok_or("worker: no server url")?;
        let handler = std::env::var(HANDLER_MS)?;
        let (min, max) = handler.split_once('-').ok_or("worker: no handler time")?;
        let handler = (min.parse()?, max.parse()?);
        return runtime.block_on(work(&url, Mode::named(&role), handler));
    }
    let only = std::env::var("GROUPMQ_BENCH").ok();
    let runs = |part: &str| only.as_deref().is_none_or(|only| only == part);
    if runs("hot") {
        let workloads = match common::full_run() {
            true => &WORKLOADS[..],
            false => &[(300, 10)][..],
        };
        let picked = std::env::var("GROUPMQ_KEYS").ok();
        let picked = picked.map(|k| k.parse::<usize>()).transpose()?;
        for &(messages, keys) in workloads {
            if picked.is_some_and(|k| k != keys) {
                continue;
            }
            let groupmq = {
                let server = RedisServer::start()?;
                groupmq(&server, (messages, keys), HANDLER)?
            };
            let mut lockgate = Vec::new();
            for mode in [Mode::Keyed, Mode::KeyedOne, Mode::Layer] {
                let server = RedisServer::start()?;
                let run = drive(&server, (messages, keys), mode, HANDLER);
                lockgate.push(runtime.block_on(run)?);
            }
            report(messages, keys, &groupmq, &lockgate)?;
        }
    }
    if runs("many") {
        many_keys(&runtime)?;
    }
    Ok(())
}

/// The many-keys part: per key count, GroupMQ, the keyed queue and the
/// queue without keys, no-op handlers, each on a fresh server.
fn many_keys(runtime: &tokio::runtime::Runtime) -> Result<(), BoxError> {
    let (messages, counts) = match common::full_run() {
        true => MANY,
        false => (300, [10, 100, 1_000, 10_000, 100_000]),
    };
    let counts = if common::full_run() {
        &counts[..]
    } else {
        &counts[..1]
    };
    // `GROUPMQ_KEYS=1000` (say) runs that key count alone.
    let picked = std::env::var("GROUPMQ_KEYS").ok();
    let picked = picked.map(|k| k.parse::<usize>()).transpose()?;
    let counts: Vec<usize> = (counts.iter().copied())
        .filter(|keys| picked.is_none_or(|k| k == *keys))
        .collect();
    println!(
        "\nmany keys: {messages} messages, {WORKERS} worker processes × concurrency {CONCURRENCY}, no-op handlers"
    );
    println!(
        "| keys | GroupMQ 1.1 msg/s (commands; server µs) | lockgate keyed msg/s (commands; server µs) | keyed, key_batch 1 | lockgate unkeyed msg/s (commands; server µs) | floor msg/s (commands; server µs) | floor, keys declared | lean layout | keyed / unkeyed | keyed / GroupMQ | keyed / unkeyed server µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for keys in counts {
        if let Some(only) = std::env::var_os("GROUPMQ_ONLY") {
            let mode = Mode::named(&only);
            if only != mode.name() {
                return Err(format!("GROUPMQ_ONLY: no side named {only:?}").into());
            }
            alone(runtime, (messages, keys), mode)?;
            continue;
        }
        let groupmq = groupmq(&RedisServer::start()?, (messages, keys), NO_OP)?;
        let mut lockgate = Vec::new();
        let modes = [
            Mode::Keyed,
            Mode::KeyedOne,
            Mode::Plain,
            Mode::Floor,
            Mode::Declared,
            Mode::Lean,
        ];
        for mode in modes {
            let server = RedisServer::start()?;
            let run = drive(&server, (messages, keys), mode, NO_OP);
            lockgate.push(runtime.block_on(run)?);
        }
        let rate = |s: &Summary| s.handled as f64 / s.seconds;
        let cell = |s: &Summary| {
            format!(
                "{:.0} ({:.1}; {:.0} µs)",
                rate(s),
                s.commands as f64 / s.handled as f64,
                server_us(s)
            )
        };
        let [keyed, one, plain, floor, declared, lean] = &lockgate[..] else {
            return Err("a lockgate run is missing".into());
        };
        println!(
            "| {keys} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.1} |",
            cell(&groupmq),
            cell(keyed),
            cell(one),
            cell(plain),
            cell(floor),
            cell(declared),
            cell(lean),
            rate(keyed) / rate(plain),
            rate(keyed) / rate(&groupmq),
            server_us(keyed) / server_us(plain)
        );
        let sides = [
            ("GroupMQ", &groupmq),
            ("keyed", keyed),
            ("keyed1", one),
            ("unkeyed", plain),
            ("floor", floor),
            ("declared", declared),
            ("lean", lean),
        ];
        for (name, s) in sides {
            if s.handled != messages {
                return Err(format!("{name}: {} of {messages} handled", s.handled).into());
            }
        }
        let overlaps = [&groupmq, keyed, one, floor, declared, lean].map(|s| s.overlaps);
        if overlaps.iter().sum::<usize>() != 0 {
            return Err(format!("{keys} keys: handlers of one key overlapped").into());
        }
    }
    Ok(())
}

/// `GROUPMQ_ONLY=<mode>` (`keyed`, `keyed1`, `plain`, `floor`,
/// `declared`): runs that
/// side of the many-keys part alone, three times, each on a fresh server,
/// one line each: the way to compare two builds, whose figures move far
/// less from run to run than the whole table's.
fn alone(
    runtime: &tokio::runtime::Runtime,
    (messages, keys): (usize, usize),
    mode: Mode,
) -> Result<(), BoxError> {
    for _ in 0..3 {
        let server = RedisServer::start()?;
        let s = runtime.block_on(drive(&server, (messages, keys), mode, NO_OP))?;
        if s.handled != messages || s.overlaps != 0 {
            let e = format!(
                "{}: {} of {messages} handled, {} overlaps",
                mode.name(),
                s.handled,
                s.overlaps
            );
            return Err(e.into());
        }
        println!(
            "{} alone, {keys} keys: {:.0} msg/s ({:.1} commands; {:.1} µs per message)",
            mode.name(),
            s.handled as f64 / s.seconds,
            s.commands as f64 / s.handled as f64,
            server_us(&s)
        );
    }
    Ok(())
}

/// Prints a workload's table; fails if a side lost a message or ran two
/// handlers of a key at once.
fn report(
    messages: usize,
    keys: usize,
    groupmq: &Summary,
    lockgate: &[Summary],
) -> Result<(), BoxError> {
    println!(
        "\nhot keys: {messages} messages over {keys} keys, {WORKERS} worker processes × concurrency {CONCURRENCY}, handlers {}–{} ms",
        HANDLER.0, HANDLER.1
    );
    println!(
        "| queue | messages/s | key busy (mean, min) | busy while backlogged (mean, min) | handler ms | order inversions | overlaps | commands per message | server µs per message |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let rows = [
        ("GroupMQ 1.1", groupmq),
        ("lockgate, keyed queue (runs of 8)", &lockgate[0]),
        ("lockgate, keyed queue, key_batch 1", &lockgate[1]),
        ("lockgate, layer recipe", &lockgate[2]),
    ];
    for (name, s) in rows {
        println!(
            "| {name} | {:.0} | {:.0} %, {:.0} % | {:.1} %, {:.1} % | {:.2} | {} | {} | {:.1} | {:.0} |",
            s.handled as f64 / s.seconds,
            s.busy_mean * 100.0,
            s.busy_min * 100.0,
            s.backlogged_mean * 100.0,
            s.backlogged_min * 100.0,
            s.handler_ms,
            s.inversions,
            s.overlaps,
            s.commands as f64 / s.handled as f64,
            server_us(s)
        );
    }
    for (name, s) in rows {
        if s.handled != messages || s.overlaps != 0 {
            let e = format!(
                "{name}: {} of {messages} handled, {} overlaps",
                s.handled, s.overlaps
            );
            return Err(e.into());
        }
    }
    Ok(())
}

/// Runs GroupMQ's side (`bench/groupmq/hot.mjs`) against `server`, its
/// handlers taking `handler` ms (min, max).
fn groupmq(
    server: &RedisServer,
    (messages, keys): (usize, usize),
    handler: (u64, u64),
) -> Result<Summary, BoxError> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("groupmq");
    if !dir.join("node_modules").exists() {
        let status = Command::new("npm")
            .args(["ci", "--silent"])
            .current_dir(&dir)
            .status()?;
        if !status.success() {
            return Err("npm ci in bench/groupmq failed (are node and npm installed?)".into());
        }
    }
    let output = Command::new("node")
        .arg("hot.mjs")
        .arg(server.url())
        .args([messages, keys, WORKERS, CONCURRENCY].map(|n| n.to_string()))
        .args([handler.0, handler.1].map(|n| n.to_string()))
        .current_dir(&dir)
        .stderr(Stdio::inherit())
        .output()?;
    if !output.status.success() {
        return Err(format!("GroupMQ's run failed: {}", output.status).into());
    }
    let line = String::from_utf8(output.stdout)?;
    Ok(serde_json::from_str(line.trim())?)
}

/// lockgate's side: pushes, starts the worker processes (handlers taking
/// `handler` ms), waits until the queue is empty, and sums up what the
/// workers recorded.
async fn drive(
    server: &RedisServer,
    (messages, keys): (usize, usize),
    mode: Mode,
    handler: (u64, u64),
) -> Result<Summary, BoxError> {
    let conn = server.connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "hot")?;
    let msgs: Vec<Msg> = (0..messages as u64)
        .map(|seq| Msg {
            key: format!("k{}", seq as usize % keys),
            seq,
        })
        .collect();
    for chunk in msgs.chunks(1000) {
        match mode {
            Mode::Layer | Mode::Plain => drop(queue.push_many(chunk).await?),
            Mode::Floor | Mode::Declared | Mode::Lean => {}
            Mode::Keyed | Mode::KeyedOne => {
                let keyed = chunk
                    .iter()
                    .map(|m| (m, lockgate::PushOptions::new().key(m.key.clone())));
                queue.push_many_with(keyed).await?;
            }
        }
    }
    if matches!(mode, Mode::Floor | Mode::Declared | Mode::Lean) {
        let lines: Vec<(String, String)> = (msgs.iter())
            .map(|m| Ok((m.key.clone(), serde_json::to_string(m)?)))
            .collect::<Result<_, serde_json::Error>>()?;
        match mode {
            Mode::Lean => floor::lean::push(&conn, &lines).await?,
            _ => floor::push(&conn, &lines).await?,
        }
    }
    let before = commands(&conn).await?;
    let cpu_before = server_cpu(&conn).await?;
    let profile_before = command_usec(&conn).await?;
    let mut children = Vec::new();
    for _ in 0..WORKERS {
        let child = Command::new(std::env::current_exe()?)
            .arg(server.url())
            .env(ROLE, mode.name())
            .env(HANDLER_MS, format!("{}-{}", handler.0, handler.1))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        children.push(child);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    loop {
        let left = match mode {
            Mode::Floor | Mode::Declared => floor::left(&conn).await?,
            Mode::Lean => floor::lean::left(&conn).await?,
            _ => {
                let stats = queue.stats().await?;
                stats.due + stats.later + stats.active
            }
        };
        if left == 0 {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("not done in 600 s: {left} left").into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = commands(&conn).await?;
    let server_cpu = server_cpu(&conn).await? - cpu_before;
    if std::env::var_os("GROUPMQ_PROFILE").is_some() {
        profile(mode, messages, &profile_before, &command_usec(&conn).await?);
    }
    let mut handled = Vec::new();
    for (n, mut child) in children.into_iter().enumerate() {
        drop(child.stdin.take());
        let out = child.wait_with_output()?;
        let from = handled.len();
        for line in out.stdout.lines() {
            let line = line?;
            let parts: Vec<&str> = line.split(' ').collect();
            if let [key, seq, start, end] = parts[..] {
                handled.push(Handled {
                    key: key.to_owned(),
                    seq: seq.parse()?,
                    start: start.parse()?,
                    end: end.parse()?,
                });
            }
        }
        if std::env::var_os("GROUPMQ_GAPS").is_some() {
            // When each worker process started handling, and its keys.
            let own = &handled[from..];
            let first = own.iter().map(|h| h.start).fold(f64::INFINITY, f64::min);
            let mut keys: Vec<&str> = own.iter().map(|h| h.key.as_str()).collect();
            keys.sort_unstable();
            keys.dedup();
            eprintln!("  worker {n}: first start {first:.1}, keys {keys:?}");
        }
    }
    Ok(summary(&handled, after - before, server_cpu))
}

/// One handled message, as a worker recorded it (wall clock, ms).
struct Handled {
    key: String,
    seq: u64,
    start: f64,
    end: f64,
}

/// The figures of a run, computed as GroupMQ's script computes them.
fn summary(handled: &[Handled], commands: u64, server_cpu: f64) -> Summary {
    let first = handled
        .iter()
        .map(|h| h.start)
        .fold(f64::INFINITY, f64::min);
    let last = handled.iter().map(|h| h.end).fold(0.0, f64::max);
    let mut by_key: BTreeMap<&str, Vec<&Handled>> = BTreeMap::new();
    for h in handled {
        by_key.entry(&h.key).or_default().push(h);
    }
    let (mut inversions, mut overlaps, mut busy, mut backlogged) = (0, 0, Vec::new(), Vec::new());
    for list in by_key.values_mut() {
        list.sort_by(|a, b| a.start.total_cmp(&b.start));
        for pair in list.windows(2) {
            inversions += usize::from(pair[1].seq < pair[0].seq);
            overlaps += usize::from(pair[1].start < pair[0].end);
        }
        let handling = list.iter().map(|h| h.end - h.start).sum::<f64>();
        busy.push(handling / (last - first));
        // Over the time the key had messages waiting: from the first start
        // to its own last end (all were pushed before the workers started).
        let own_last = list.iter().map(|h| h.end).fold(0.0, f64::max);
        backlogged.push(handling / (own_last - first));
    }
    let total: f64 = handled.iter().map(|h| h.end - h.start).sum();
    if std::env::var_os("GROUPMQ_GAPS").is_some() {
        // Where a key's idle time went, summed over keys (ms): before its
        // first start, between its messages by gap size, after its last end.
        let bounds = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, f64::INFINITY];
        let (mut sums, mut counts) = (vec![0.0; bounds.len()], vec![0usize; bounds.len()]);
        let (mut head, mut tail) = (0.0, 0.0);
        for list in by_key.values() {
            head += list[0].start - first;
            tail += last - list.iter().map(|h| h.end).fold(0.0, f64::max);
            for pair in list.windows(2) {
                let gap = (pair[1].start - pair[0].end).max(0.0);
                let i = bounds.iter().position(|b| gap < *b).unwrap_or(0);
                sums[i] += gap;
                counts[i] += 1;
            }
        }
        let span = (last - first) * by_key.len() as f64;
        for (key, list) in &by_key {
            let own_last = list.iter().map(|h| h.end).fold(0.0, f64::max);
            let gaps: Vec<f64> = (list.windows(2))
                .map(|pair| (pair[1].start - pair[0].end).max(0.0))
                .collect();
            let long: f64 = gaps.iter().filter(|g| **g >= 0.2).sum();
            eprintln!(
                "  key {key}: head {:.1} ms, gaps {:.1} ms ({:.1} ms in {} of 0.2 ms or more), own span {:.0} ms",
                list[0].start - first,
                gaps.iter().sum::<f64>(),
                long,
                gaps.iter().filter(|g| **g >= 0.2).count(),
                own_last - first
            );
        }
        eprintln!(
            "idle share of key time: head {:.2}% tail {:.2}%",
            head / span * 100.0,
            tail / span * 100.0
        );
        for (i, b) in bounds.iter().enumerate() {
            eprintln!(
                "  gaps < {b} ms: {} gaps, {:.2}%",
                counts[i],
                sums[i] / span * 100.0
            );
        }
    }
    if std::env::var_os("GROUPMQ_TIMELINE").is_some() {
        // Messages ended per 100 ms, from the first start.
        let mut buckets = vec![0usize; ((last - first) / 100.0) as usize + 1];
        for h in handled {
            buckets[((h.end - first) / 100.0) as usize] += 1;
        }
        eprintln!("ended per 100 ms: {buckets:?}");
    }
    Summary {
        handled: handled.len(),
        seconds: (last - first) / 1000.0,
        busy_min: busy.iter().copied().fold(f64::INFINITY, f64::min),
        busy_mean: busy.iter().sum::<f64>() / busy.len().max(1) as f64,
        backlogged_min: backlogged.iter().copied().fold(f64::INFINITY, f64::min),
        backlogged_mean: backlogged.iter().sum::<f64>() / backlogged.len().max(1) as f64,
        handler_ms: total / handled.len().max(1) as f64,
        inversions,
        overlaps,
        commands,
        server_cpu,
    }
}

/// The server's CPU time per message handled, in µs.
fn server_us(s: &Summary) -> f64 {
    s.server_cpu * 1e6 / s.handled.max(1) as f64
}

/// The server's CPU time so far, user and system, in seconds (INFO cpu).
async fn server_cpu(conn: &redis::aio::ConnectionManager) -> Result<f64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn.clone())
        .await?;
    let field = |name: &str| -> Result<f64, BoxError> {
        let line = (info.lines())
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .ok_or_else(|| format!("INFO cpu has no {name}"))?;
        Ok(line.trim().parse()?)
    };
    Ok(field("used_cpu_user")? + field("used_cpu_sys")?)
}

/// Each command's calls and µs so far (INFO commandstats), by name.
async fn command_usec(
    conn: &redis::aio::ConnectionManager,
) -> Result<BTreeMap<String, (u64, u64)>, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let field = |line: &str, name: &str| -> Option<u64> {
        line.split(name).nth(1)?.split(',').next()?.parse().ok()
    };
    Ok(info
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.strip_prefix("cmdstat_")?.split_once(':')?;
            Some((
                name.to_owned(),
                (field(rest, "calls=")?, field(rest, "usec=")?),
            ))
        })
        .collect())
}

/// `GROUPMQ_PROFILE=1`: prints, per message, what each command cost the
/// server while handling (calls; µs), a script's inner commands counted
/// both on their own and in its `evalsha` (or `fcall`).
fn profile(
    mode: Mode,
    messages: usize,
    before: &BTreeMap<String, (u64, u64)>,
    after: &BTreeMap<String, (u64, u64)>,
) {
    let mut rows: Vec<(&String, f64, f64)> = (after.iter())
        .map(|(name, (calls, usec))| {
            let (c0, u0) = before.get(name).copied().unwrap_or_default();
            let per = |n: u64| n as f64 / messages as f64;
            (
                name,
                per(calls.saturating_sub(c0)),
                per(usec.saturating_sub(u0)),
            )
        })
        .filter(|row| row.1 > 0.0)
        .collect();
    rows.sort_by(|a, b| b.2.total_cmp(&a.2));
    eprintln!("  {}: per message, command (calls; µs)", mode.name());
    for (name, calls, usec) in rows.iter().take(16) {
        eprintln!("    {name:<22} {calls:>7.3} {usec:>8.2}");
    }
}

/// Calls of every command the server ran so far (INFO commandstats).
async fn commands(conn: &redis::aio::ConnectionManager) -> Result<u64, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    Ok(info
        .split("calls=")
        .skip(1)
        .filter_map(|c| c.split(',').next()?.parse::<u64>().ok())
        .sum())
}

/// A worker process: handles until its stdin closes, then prints `key seq
/// start end` per handled message; its handlers take `handler` ms (min,
/// max; none at all for (0, 0)).
async fn work(url: &str, mode: Mode, handler: (u64, u64)) -> Result<(), BoxError> {
    let client = redis::Client::open(url)?;
    let conn = client.get_connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "hot")?;
    let locker = Locker::connect(client.clone())
        .await?
        .ttl(Duration::from_secs(10))?;
    let backoff =
        Backoff::exponential(Duration::from_millis(1), Duration::from_millis(8))?.max_attempts(4);
    let records = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let layer = LockLayer::new(locker, |job: &Job<Msg>| job.key.clone()).on_conflict(
        OnConflict::retry(backoff).then_defer(queue.clone(), DeferDelay::until_released()),
    );
    let handler = tower::service_fn({
        let records = records.clone();
        move |job: Job<Msg>| {
            let records = records.clone();
            async move {
                let start = now_ms();
                // tokio's timer rounds a sleep up to its next 1 ms tick,
                // where node's fires on time: asked 1 ms less, the
                // handlers take as long as GroupMQ's (the table shows both).
                if handler.1 > 0 {
                    let spread = rand::random::<f64>() * (handler.1 - handler.0) as f64;
                    let ms = handler.0.saturating_sub(1) as f64 + spread;
                    tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
                }
                let line = format!("{} {} {start} {}", job.key, job.seq, now_ms());
                records.lock().unwrap().push(line);
                Ok::<_, BoxError>(())
            }
        }
    });
    let stdin_closed = async {
        let closed = tokio::task::spawn_blocking(|| {
            let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        });
        let _ = closed.await;
    };
    match mode {
        Mode::Keyed | Mode::KeyedOne | Mode::Plain => {
            let worker = Worker::new(client, queue, handler).concurrency(CONCURRENCY)?;
            let worker = match mode {
                Mode::KeyedOne => worker.key_batch(1)?,
                _ => worker,
            };
            worker.run_until(stdin_closed).await?;
        }
        Mode::Layer => {
            let service = ServiceBuilder::new().layer(layer).service(handler);
            let worker = Worker::new(client, queue, service).concurrency(CONCURRENCY)?;
            worker.run_until(stdin_closed).await?;
        }
        Mode::Floor | Mode::Declared | Mode::Lean => {
            work_floor(conn, &records, stdin_closed, mode).await?
        }
    }
    let mut out = std::io::stdout().lock();
    for line in records.lock().unwrap().iter() {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// The floor's worker process (no-op handlers): two loops, each claiming
/// up to 8 keys' heads and acknowledging them in one call, until `stop`;
/// `mode`: the floor, or the floor with every key declared.
async fn work_floor(
    conn: redis::aio::ConnectionManager,
    records: &std::sync::Mutex<Vec<String>>,
    stop: impl Future<Output = ()>,
    mode: Mode,
) -> Result<(), BoxError> {
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let record = |payload: &str| {
        let at = now_ms();
        if let Ok(m) = serde_json::from_str::<Msg>(payload) {
            records
                .lock()
                .unwrap()
                .push(format!("{} {} {at} {at}", m.key, m.seq));
        }
    };
    let stop = async {
        stop.await;
        let _ = stopping.send(true);
        Ok::<_, BoxError>(())
    };
    if mode == Mode::Lean {
        tokio::try_join!(
            floor::lean::work(conn.clone(), record, stopped.clone()),
            floor::lean::work(conn, record, stopped),
            stop
        )?;
    } else if mode == Mode::Declared {
        tokio::try_join!(
            floor::work_declared(conn.clone(), record, stopped.clone()),
            floor::work_declared(conn, record, stopped),
            stop
        )?;
    } else {
        tokio::try_join!(
            floor::work(conn.clone(), record, stopped.clone()),
            floor::work(conn, record, stopped),
            stop
        )?;
    }
    Ok(())
}

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}
