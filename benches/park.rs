//! Deferral churn: what a busy key costs a queue pipeline, for a timed
//! deferral, for a deferral into the key's line, and for messages pushed
//! with their key (claimed only when the key is free), beside the same
//! messages on keys that are never busy.
//!
//! The workload: messages on 20 keys, handlers of 2–20 ms, 4 workers of 10
//! slots each (one process, each worker on its own connections), the layer
//! retrying 4 times (1–8 ms backoff) before it gives up and defers. Per
//! handled message it reports the deferrals and the Redis commands the
//! server ran (`INFO commandstats`, commands inside scripts included).
//!
//! `cargo bench --bench park` (full run); built and run on tiny inputs by
//! `cargo test --all-targets`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::*;
use lockgate::layer::DeferDelay;
use lockgate::testing::RedisServer;
use lockgate::{Backoff, BoxError, Job, LockLayer, Locker, OnConflict, PushOptions, Queue, Worker};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    n: u32,
    key: String,
    /// How long the handler works, in ms.
    work: u64,
}

const KEYS: usize = 20;
const WORKERS: usize = 4;
const SLOTS: usize = 10; // the worker's default

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Every message on a key of its own: never busy.
    Uncontended,
    /// `retry(4).then_defer(queue, 50 ms)`.
    Timed,
    /// `retry(4).then_defer(queue, until_released())`: into the key's line.
    Line,
    /// Pushed with their key (`PushOptions::key`): claimed only with the
    /// key's lock, which the same layer then uses.
    Keyed,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Uncontended => "uncontended (a key per message)",
            Mode::Timed => "retry 4, then defer 50 ms",
            Mode::Line => "retry 4, then into the key's line",
            Mode::Keyed => "pushed with their key",
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let messages = size(5_000, 200);
    println!(
        "## Deferral churn: {messages} messages on {KEYS} keys, handlers 2–20 ms, {WORKERS} workers × {SLOTS} slots"
    );
    println!(
        "| mode | wall time | deferrals per message | Redis commands per handled message | script calls per handled message |"
    );
    println!("|---|---|---|---|---|");
    let mut breakdowns = Vec::new();
    for mode in [Mode::Uncontended, Mode::Timed, Mode::Line, Mode::Keyed] {
        let server = RedisServer::start()?;
        let (elapsed, deferrals, stats) = run(&server, mode, messages).await?;
        let per = |n: u64| n as f64 / messages as f64;
        println!(
            "| {} | {:.2} s | {:.2} | {:.1} | {:.2} |",
            mode.name(),
            elapsed.as_secs_f64(),
            per(deferrals),
            per(stats.all()),
            per(stats.scripts()),
        );
        breakdowns.push((mode, stats));
    }
    println!("\nCommands per handled message, by command (those above 0.1):");
    for (mode, stats) in breakdowns {
        let mut by: Vec<_> = stats.0.into_iter().collect();
        by.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let line: Vec<String> = by
            .iter()
            .map(|(name, n)| (name, *n as f64 / messages as f64))
            .filter(|(_, per)| *per >= 0.1)
            .map(|(name, per)| format!("{name} {per:.2}"))
            .collect();
        println!("* {}: {}", mode.name(), line.join(", "));
    }
    Ok(())
}

/// Calls per command the server ran (`INFO commandstats`), `INFO` itself
/// left out: it is the measurement, not the workload.
#[derive(Default)]
struct CommandStats(std::collections::BTreeMap<String, u64>);

impl CommandStats {
    fn all(&self) -> u64 {
        self.0.values().sum()
    }

    fn scripts(&self) -> u64 {
        ["evalsha", "eval"]
            .iter()
            .filter_map(|n| self.0.get(*n))
            .sum()
    }

    /// What ran between `before` and `self`.
    fn since(mut self, before: &CommandStats) -> CommandStats {
        for (name, calls) in &mut self.0 {
            *calls -= before.0.get(name).copied().unwrap_or(0);
        }
        self
    }
}

/// Pushes the messages, runs the workers until all are handled; returns the
/// wall time, the deferrals, and the commands the server ran meanwhile.
async fn run(
    server: &RedisServer,
    mode: Mode,
    messages: usize,
) -> Result<(Duration, u64, CommandStats), BoxError> {
    let conn = server.connection_manager().await?;
    let queue: Queue<Msg> = Queue::new(conn.clone(), "churn")?;
    let msgs: Vec<Msg> = (0..messages as u32)
        .map(|n| Msg {
            n,
            key: match mode {
                Mode::Uncontended => format!("own-{n}"),
                _ => format!("key-{}", n as usize % KEYS),
            },
            work: 2 + rand::random::<u64>() % 19,
        })
        .collect();
    for chunk in msgs.chunks(500) {
        if mode == Mode::Keyed {
            let keyed = chunk.iter().map(|m| (m, PushOptions::new().key(&m.key)));
            queue.push_many_with(keyed).await?;
        } else {
            queue.push_many(chunk).await?;
        }
    }
    let handled = Arc::new(AtomicU64::new(0));
    let deferrals = Arc::new(AtomicU64::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let before = commandstats(&conn).await?;
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..WORKERS {
        let conn = server.connection_manager().await?;
        let queue: Queue<Msg> = Queue::new(conn.clone(), "churn")?;
        let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
        let backoff = Backoff::exponential(Duration::from_millis(1), Duration::from_millis(8))?
            .max_attempts(4);
        let delay = match mode {
            Mode::Line => DeferDelay::until_released(),
            _ => DeferDelay::Fixed(Duration::from_millis(50)),
        };
        let (handled, deferrals) = (handled.clone(), deferrals.clone());
        let service = ServiceBuilder::new()
            .layer(
                LockLayer::new(locker, |job: &Job<Msg>| job.key.clone())
                    .on_conflict(OnConflict::retry(backoff).then_defer(queue.clone(), delay)),
            )
            .service_fn(move |job: Job<Msg>| {
                let (handled, deferrals) = (handled.clone(), deferrals.clone());
                async move {
                    tokio::time::sleep(Duration::from_millis(job.work)).await;
                    deferrals.fetch_add(u64::from(job.deferrals()), Ordering::Relaxed);
                    handled.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, BoxError>(())
                }
            });
        let worker = Worker::new(server.client(), queue, service).concurrency(SLOTS)?;
        let mut stopped = stopped.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    while handled.load(Ordering::Relaxed) < messages as u64 {
        if Instant::now() > deadline {
            return Err(format!(
                "{} of {messages} handled in 300 s",
                handled.load(Ordering::Relaxed)
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    let after = commandstats(&conn).await?;
    let _ = stop.send(true);
    for worker in workers {
        worker.await??;
    }
    Ok((
        elapsed,
        deferrals.load(Ordering::Relaxed),
        after.since(&before),
    ))
}

/// The calls of each command the server has run so far.
async fn commandstats(conn: &redis::aio::ConnectionManager) -> Result<CommandStats, BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn.clone())
        .await?;
    let mut stats = CommandStats::default();
    for line in info.lines() {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let Some(name) = name.strip_prefix("cmdstat_") else {
            continue;
        };
        let Some(calls) = rest
            .split("calls=")
            .nth(1)
            .and_then(|c| c.split(',').next())
            .and_then(|c| c.parse::<u64>().ok())
        else {
            continue;
        };
        if name != "info" {
            stats.0.insert(name.to_owned(), calls);
        }
    }
    Ok(stats)
}
