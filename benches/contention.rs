//! Contention across processes: hot keys shared by several processes, and
//! how soon a release in one process lets a waiter in another one start,
//! with waiters polling with backoff (`LockLayer::poll_only`) and with
//! waiters woken by the release (the default of a locker made by
//! `Locker::connect`, nothing wired by hand), in the same run.
//!
//! The bench spawns its own child processes (this executable again, told
//! what to do by `LOCKGATE_CONTENTION_CHILD`); they share one redis-server
//! started by the parent.
//!
//! `cargo bench --bench contention` (full run; pin it with `benches/pin.sh`,
//! the children inherit the client's CPUs); built and run on tiny inputs by
//! `cargo test --all-targets`.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use lockgate::testing::RedisServer;
use lockgate::{Backoff, BoxError, LockLayer, Locker, OnConflict};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tower::{Service, ServiceExt};

const CHILD: &str = "LOCKGATE_CONTENTION_CHILD";

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec).await;
    }
    let server = RedisServer::start()?;
    let secs = if full_run() { 3.0 } else { 0.3 };
    println!("## Hot keys across processes: 5 keys, calls of a no-op handler ({secs} s)");
    println!(
        "| waiters | processes × tasks | acquisitions/s | call p50 | call p99 | call max | per process (min–max, vs mean) | per task (min–max) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (wake, processes, tasks, permits) in [
        (false, 5, 10, 1),
        (true, 5, 10, 1),
        (true, 1, 50, 1),
        (true, 5, 10, 2),
    ] {
        hot_keys(&server, wake, processes, tasks, permits, secs).await?;
    }
    let rounds = size(200, 5);
    println!("\n## Release → start of the next holder in another process ({rounds} handovers)");
    println!("| waiters | p50 | p99 | max |\n|---|---|---|---|");
    for wake in [false, true] {
        handover(&server, wake, rounds).await?;
    }
    Ok(())
}

fn mode(wake: bool) -> &'static str {
    if wake {
        "woken by default (Locker::connect)"
    } else {
        "polling (poll_only), backoff 0.5–8 ms"
    }
}

/// `mode`, and the permits per key when there are several.
fn mode_with(wake: bool, permits: u32) -> String {
    match permits {
        1 => mode(wake).to_owned(),
        n => format!("{}, {n} permits per key", mode(wake)),
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// `processes` children, `tasks` tasks each, over 5 hot keys for `secs`,
/// each key a lock (`permits` 1) or a semaphore.
async fn hot_keys(
    server: &RedisServer,
    wake: bool,
    processes: usize,
    tasks: usize,
    permits: u32,
    secs: f64,
) -> Result<(), BoxError> {
    // Every child starts at the same moment, once all are up.
    let start_at = now_ns() + 1_500_000_000;
    let spec = format!(
        "hot;{};{wake};{tasks};{secs};{start_at};{permits}",
        server.url()
    );
    let children: Vec<_> = (0..processes)
        .map(|_| {
            Command::new(std::env::current_exe()?)
                .env(CHILD, &spec)
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<_, _>>()?;
    let mut latencies: Vec<Duration> = Vec::new();
    let mut per_process = Vec::new();
    let mut per_task = Vec::new();
    for child in children {
        let output = child.wait_with_output().await?;
        if !output.status.success() {
            return Err("a child process failed".into());
        }
        let text = String::from_utf8(output.stdout)?;
        let mut mine = 0;
        for line in text.lines() {
            let mut words = line.split(' ');
            match words.next() {
                Some("task") => {
                    let n: usize = words.next().ok_or("bad line")?.parse()?;
                    per_task.push(n);
                    mine += n;
                }
                Some("lat") => {
                    for us in words {
                        latencies.push(Duration::from_micros(us.parse()?));
                    }
                }
                _ => {}
            }
        }
        per_process.push(mine);
    }
    latencies.sort();
    per_task.sort();
    per_process.sort();
    let total: usize = per_process.iter().sum();
    let mean = total as f64 / processes as f64;
    let spread = |n: usize| 100.0 * (n as f64 - mean) / mean;
    println!(
        "| {} | {processes} × {tasks} | {:.0} | {:.2} ms | {:.2} ms | {:.2} ms | {}–{} ({:+.1} % / {:+.1} %) | {}–{} |",
        mode_with(wake, permits),
        total as f64 / secs,
        ms(quantile(&latencies, 0.5)),
        ms(quantile(&latencies, 0.99)),
        ms(quantile(&latencies, 1.0)),
        per_process[0],
        per_process[processes - 1],
        spread(per_process[0]),
        spread(per_process[processes - 1]),
        per_task[0],
        per_task[per_task.len() - 1],
    );
    Ok(())
}

/// The parent holds a key, a child waits for it; the parent releases and
/// the child's handler notes when it starts. Both clocks are this machine's.
async fn handover(server: &RedisServer, wake: bool, rounds: usize) -> Result<(), BoxError> {
    let spec = format!("handover;{};{wake}", server.url());
    let mut child = Command::new(std::env::current_exe()?)
        .env(CHILD, &spec)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut to_child = child.stdin.take().ok_or("no stdin")?;
    let mut from_child = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let conn = server.connection_manager().await?;
    let locker = Locker::new(conn.clone()).ttl(Duration::from_secs(30))?;
    let lock_key = locker.lock_key("handover");
    let mut gaps = Vec::new();
    for _ in 0..rounds {
        // The child releases just after its handler reported: wait for it.
        let lease = loop {
            match locker.acquire("handover").await?.lease() {
                Some(lease) => break lease,
                None => tokio::time::sleep(Duration::from_millis(1)).await,
            }
        };
        to_child.write_all(b"go\n").await?;
        to_child.flush().await?;
        // Until the child waits: it marked the lock (woken), or had time
        // to start polling.
        if wake {
            loop {
                let value: Option<String> = redis::cmd("GET")
                    .arg(&lock_key)
                    .query_async(&mut conn.clone())
                    .await?;
                if value.is_some_and(|v| v.ends_with('!')) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let released = now_ns();
        locker.release(&lease).await?;
        let line = from_child.next_line().await?.ok_or("child ended")?;
        let started: u128 = line.parse()?;
        gaps.push(Duration::from_nanos(started.saturating_sub(released) as u64));
    }
    drop(to_child);
    child.wait().await?;
    gaps.sort();
    println!(
        "| {} | {:.2} ms | {:.2} ms | {:.2} ms |",
        mode(wake),
        ms(quantile(&gaps, 0.5)),
        ms(quantile(&gaps, 0.99)),
        ms(quantile(&gaps, 1.0)),
    );
    Ok(())
}

/// A layer retrying for as long as any call here can take, woken by the
/// release or polling with backoff.
async fn layer(
    client: &redis::Client,
    wake: bool,
    permits: u32,
) -> Result<LockLayer<redis::aio::ConnectionManager, fn(&String) -> String>, BoxError> {
    #[allow(clippy::ptr_arg)] // the requests are `String`s
    fn key(k: &String) -> String {
        k.clone()
    }
    let backoff = Backoff::exponential(Duration::from_micros(500), Duration::from_millis(8))?
        .unlimited_attempts()
        .max_elapsed(Duration::from_secs(30));
    // Built as the README's first example builds it: a locker made from the
    // client wakes its waiters by itself; polling is the explicit opt-out.
    let locker = Locker::connect(client.clone()).await?;
    let layer = LockLayer::new(
        locker.ttl(Duration::from_secs(10))?,
        key as fn(&String) -> String,
    )
    .on_conflict(OnConflict::retry(backoff));
    let layer = if permits > 1 {
        layer.permits(permits)?
    } else {
        layer
    };
    Ok(if wake { layer } else { layer.poll_only() })
}

async fn child(spec: &str) -> Result<(), BoxError> {
    let parts: Vec<&str> = spec.split(';').collect();
    let client = redis::Client::open(*parts.get(1).ok_or("bad spec")?)?;
    let wake: bool = parts.get(2).ok_or("bad spec")?.parse()?;
    let permits: u32 = parts.get(6).map_or(Ok(1), |p| p.parse())?;
    let layer = layer(&client, wake, permits).await?;
    match parts[0] {
        "hot" => {
            let tasks: usize = parts.get(3).ok_or("bad spec")?.parse()?;
            let secs: f64 = parts.get(4).ok_or("bad spec")?.parse()?;
            let start_at: u128 = parts.get(5).ok_or("bad spec")?.parse()?;
            let service = tower::Layer::layer(
                &layer,
                tower::service_fn(|_: String| async { Ok::<_, BoxError>(()) }),
            );
            let wait = start_at.saturating_sub(now_ns());
            tokio::time::sleep(Duration::from_nanos(wait as u64)).await;
            let end = tokio::time::Instant::now() + Duration::from_secs_f64(secs);
            let handles: Vec<_> = (0..tasks)
                .map(|task| {
                    let mut service = service.clone();
                    tokio::spawn(async move {
                        let key = format!("hot-{}", task % 5);
                        let mut latencies = Vec::new();
                        while tokio::time::Instant::now() < end {
                            let started = tokio::time::Instant::now();
                            let _ = service.ready().await?.call(key.clone()).await?;
                            latencies.push(started.elapsed());
                        }
                        Ok::<_, BoxError>(latencies)
                    })
                })
                .collect();
            let mut all = String::from("lat");
            for handle in handles {
                let latencies = handle.await??;
                println!("task {}", latencies.len());
                for l in latencies {
                    all.push(' ');
                    all.push_str(&l.as_micros().to_string());
                }
            }
            println!("{all}");
        }
        "handover" => {
            let service = tower::Layer::layer(
                &layer,
                tower::service_fn(|_: String| async {
                    println!("{}", now_ns());
                    Ok::<_, BoxError>(())
                }),
            );
            let mut lines = BufReader::new(tokio::io::stdin()).lines();
            while lines.next_line().await?.is_some() {
                let _ = service.clone().oneshot("handover".to_owned()).await?;
            }
        }
        other => return Err(format!("unknown child role {other}").into()),
    }
    Ok(())
}
