//! Lock cycles per second: through the LockLayer vs the bare scripts, and
//! contention on hot keys.
//!
//! `cargo bench --bench lock` (full run, three rounds, medians); built and run
//! on tiny inputs by `cargo test --all-targets`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use lockgate::testing::RedisServer;
use lockgate::{Backoff, BoxError, LockLayer, Locker, OnConflict};
use redis::Script;
use tower::{Service, ServiceBuilder, ServiceExt};

const TASKS: usize = 50;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    // `cargo bench --bench lock -- memory`: only the bytes-left measurement.
    if std::env::args().any(|a| a == "memory") {
        return bytes_left().await;
    }
    let server = RedisServer::start()?;
    let conn = server.multiplexed().await?;
    let secs = if full_run() { 3.0 } else { 0.2 };
    let rounds = if full_run() { 5 } else { 1 };

    let (mut command, mut bare, mut peer, mut locker, mut layer) = (
        Cycles::new(),
        Cycles::new(),
        Cycles::new(),
        Cycles::new(),
        Cycles::new(),
    );
    let mut permits = [(1, Cycles::new()), (4, Cycles::new()), (16, Cycles::new())];
    for _ in 0..rounds {
        command
            .measure(&conn, bare_cycles(conn.clone(), secs, false))
            .await?;
        bare.measure(&conn, bare_cycles(conn.clone(), secs, true))
            .await?;
        peer.measure(&conn, rslock_cycles(&server.url(), secs))
            .await?;
        locker
            .measure(&conn, locker_cycles(conn.clone(), secs))
            .await?;
        layer
            .measure(&conn, layer_cycles(conn.clone(), secs))
            .await?;
        for (n, cycles) in &mut permits {
            cycles
                .measure(&conn, permit_cycles(conn.clone(), secs, *n))
                .await?;
        }
    }
    let (command_rate, peer_rate) = (command.rate(), peer.rate());
    println!("## lock cycle, {TASKS} tasks, distinct keys (median of {rounds} rounds of {secs} s)");
    println!(
        "| path | cycles/s | vs plain pair | vs rslock | client CPU per cycle | server CPU per cycle |\n|---|---|---|---|---|---|"
    );
    let row = |path: &str, cycles: &Cycles| {
        let rate = cycles.rate();
        println!(
            "| {path} | {rate:.0} | {:.1} % | {:.1} % | {:.2} µs | {:.2} µs |",
            100.0 * rate / command_rate,
            100.0 * rate / peer_rate,
            cycles.client_us(),
            cycles.server_us(),
        )
    };
    row(
        "plain pair: SET NX PX command + compare-and-delete script",
        &command,
    );
    row(
        "bare scripts: SET NX PX script + compare-and-delete script",
        &bare,
    );
    row("rslock 0.10 (Redlock on one server): lock + unlock", &peer);
    row("lockgate Locker: acquire + release", &locker);
    row(
        "lockgate LockLayer: acquire + no-op handler + release",
        &layer,
    );
    for (n, cycles) in &permits {
        row(
            &format!("lockgate LockLayer, {n} permits per key: acquire + no-op handler + release"),
            cycles,
        );
    }
    println!(
        "LockLayer / Locker = {:.1} %; LockLayer with 1 permit / LockLayer (lock) = {:.1} %\n",
        100.0 * layer.rate() / locker.rate(),
        100.0 * permits[0].1.rate() / layer.rate()
    );

    rate_decisions(conn.clone(), secs).await?;
    hot_keys(conn, secs).await?;
    bytes_left().await
}

/// One path's rounds: its rates, and the CPU time the client process and
/// the server spent per cycle (steadier than rates on a shared machine, and
/// they tell which side a difference comes from).
struct Cycles {
    rates: Vec<f64>,
    client: Vec<f64>,
    server: Vec<f64>,
}

impl Cycles {
    fn new() -> Self {
        Self {
            rates: Vec::new(),
            client: Vec::new(),
            server: Vec::new(),
        }
    }

    /// Runs one round (a `run_tasks` of `secs`), recording its rate and
    /// the CPU both sides used per cycle.
    async fn measure(
        &mut self,
        conn: &redis::aio::MultiplexedConnection,
        round: impl Future<Output = Result<(f64, f64), BoxError>>,
    ) -> Result<(), BoxError> {
        let (client, server) = (process_cpu(), server_cpu(conn).await?);
        let (rate, cycles) = round.await?;
        let (client, server) = (process_cpu() - client, server_cpu(conn).await? - server);
        let per = |cpu: Duration| cpu.as_secs_f64() * 1e6 / cycles.max(1.0);
        self.rates.push(rate);
        self.client.push(per(client));
        self.server.push(per(server));
        Ok(())
    }

    fn rate(&self) -> f64 {
        median(self.rates.clone())
    }

    fn client_us(&self) -> f64 {
        median(self.client.clone())
    }

    fn server_us(&self) -> f64 {
        median(self.server.clone())
    }
}

/// What stays in Redis per distinct key once its lock is released, right
/// away and after the fence grace period, and once a lock expired unreleased
/// (`INFO memory` `used_memory` delta over the key count, on a fresh server).
async fn bytes_left() -> Result<(), BoxError> {
    let keys = size(100_000, 1_000);
    let server = RedisServer::start()?;
    let conn = server.multiplexed().await?;
    let used = async || -> Result<(i64, i64), BoxError> {
        let bytes = used_memory(&server)?;
        let count: i64 = redis::cmd("DBSIZE").query_async(&mut conn.clone()).await?;
        Ok((bytes, count))
    };
    // Expired keys are removed by Redis' active expiry, a sampling process;
    // poll until they are all gone (bounded).
    let drained = async || -> Result<(i64, i64), BoxError> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (bytes, count) = used().await?;
            if count == 0 || Instant::now() > deadline {
                return Ok((bytes, count));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let per_key = |bytes: i64, base: i64| (bytes - base) as f64 / keys as f64;
    let lockers = |ttl| -> Result<Locker<redis::aio::MultiplexedConnection>, BoxError> {
        Ok(Locker::new(conn.clone()).ttl(ttl)?)
    };
    let run = async |locker: Locker<_>, release: bool| -> Result<(), BoxError> {
        let handles: Vec<_> = (0..TASKS)
            .map(|task| {
                let locker = locker.clone();
                tokio::spawn(async move {
                    for i in (task..keys).step_by(TASKS) {
                        let lease = locker.acquire(&format!("order-{i}")).await?.lease();
                        let lease = lease.ok_or("distinct keys are never contended")?;
                        if release {
                            locker.release(&lease).await?;
                        }
                    }
                    Ok::<_, BoxError>(())
                })
            })
            .collect();
        for h in handles {
            h.await??;
        }
        Ok(())
    };

    // Load the scripts (the script cache counts in used_memory) before the
    // baseline, and leave no key behind.
    let warm = lockers(Duration::from_secs(60))?;
    let lease = warm.acquire("warm-up").await?.lease().ok_or("warm-up")?;
    warm.release(&lease).await?;
    redis::cmd("FLUSHALL").exec_async(&mut conn.clone()).await?;
    let (base, _) = used().await?;
    run(lockers(Duration::from_secs(60))?, true).await?;
    let (released, released_keys) = used().await?;
    let grace = lockgate::lock::FENCE_GRACE;
    tokio::time::sleep(grace).await;
    let (after_grace, grace_keys) = drained().await?;

    // Long enough that none expires before all are taken and counted.
    let ttl = Duration::from_millis(size(5_000, 500) as u64);
    let (base2, _) = used().await?;
    run(lockers(ttl)?, false).await?;
    let (held, held_keys) = used().await?;
    tokio::time::sleep(ttl).await;
    let (expired, expired_keys) = drained().await?;

    println!("## Redis memory left per distinct lock key ({keys} keys, used_memory delta / keys)");
    println!("| moment | keys in Redis | bytes per key |\n|---|---|---|");
    println!(
        "| acquired and released, right after the release | {released_keys} | {:.1} |",
        per_key(released, base)
    );
    println!(
        "| acquired and released, after the fence grace ({grace:?}) | {grace_keys} | {:.1} |",
        per_key(after_grace, base)
    );
    println!(
        "| acquired, held (for comparison) | {held_keys} | {:.1} |",
        per_key(held, base2)
    );
    println!(
        "| acquired, never released, after the TTL ({ttl:?}) | {expired_keys} | {:.1} |",
        per_key(expired, base2)
    );
    Ok(())
}

/// The minimal correct lock, no library around it: the acquire as a plain
/// command, or (`script`) as a one-line script, as redis-rs users write it.
async fn bare_cycles(
    conn: redis::aio::MultiplexedConnection,
    secs: f64,
    script: bool,
) -> Result<(f64, f64), BoxError> {
    let release = Arc::new(Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    ));
    let acquire = Arc::new(Script::new(
        "return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])",
    ));
    run_tasks(secs, move |task, stop, count| {
        let mut conn = conn.clone();
        let (acquire, release) = (acquire.clone(), release.clone());
        async move {
            let key = format!("bare:lock:{{{task}}}");
            let token = format!("{:032x}", rand::random::<u128>());
            while !stop.load(Ordering::Relaxed) {
                let ok: Option<String> = if script {
                    acquire
                        .key(&key)
                        .arg(&token)
                        .arg(10_000)
                        .invoke_async(&mut conn)
                        .await?
                } else {
                    redis::cmd("SET")
                        .arg(&key)
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut conn)
                        .await?
                };
                if ok.is_some() {
                    let _: i64 = release
                        .key(&key)
                        .arg(&token)
                        .invoke_async(&mut conn)
                        .await?;
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        }
    })
    .await
}

/// The peer crate: rslock's `LockManager` on this one server (read from
/// rslock 0.10.0's `src/lock.rs`). Per cycle, the same two commands as the
/// plain pair, on one multiplexed connection it keeps:
/// - `lock`: 20 random bytes as the value, then `SET key value NX PX ttl`
///   (quorum 1 of 1; on refusal it would send the unlock script and retry, 3
///   tries with up to 200 ms sleeps, never here: every task has its own key);
/// - `unlock`: `EVALSHA` of `if GET == value then DEL` (on the first call
///   only, `NOSCRIPT`, then `SCRIPT LOAD` and `EVALSHA` again).
///
/// Client-side extras: the manager's server-list mutex is taken twice per
/// lock and once per unlock, the connection's mutex once per command, and
/// `redis::Script::new` hashes the script (SHA-1) on every unlock.
async fn rslock_cycles(url: &str, secs: f64) -> Result<(f64, f64), BoxError> {
    let manager = Arc::new(rslock::LockManager::new(vec![url.to_owned()]));
    run_tasks(secs, move |task, stop, count| {
        let manager = manager.clone();
        async move {
            let key = format!("rslock:{task}");
            while !stop.load(Ordering::Relaxed) {
                let lock = manager
                    .lock(key.as_bytes(), Duration::from_secs(10))
                    .await
                    .map_err(|e| format!("rslock: {e:?}"))?;
                manager.unlock(&lock).await;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    })
    .await
}

/// lockgate's own scripts, issued directly, without the layer.
async fn locker_cycles(
    conn: redis::aio::MultiplexedConnection,
    secs: f64,
) -> Result<(f64, f64), BoxError> {
    let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
    run_tasks(secs, move |task, stop, count| {
        let locker = locker.clone();
        async move {
            let key = format!("locker-{task}");
            while !stop.load(Ordering::Relaxed) {
                if let Some(lease) = locker.acquire(&key).await?.lease() {
                    locker.release(&lease).await?;
                    count.fetch_add(1, Ordering::Relaxed);
                }
            }
            Ok(())
        }
    })
    .await
}

async fn layer_cycles(
    conn: redis::aio::MultiplexedConnection,
    secs: f64,
) -> Result<(f64, f64), BoxError> {
    let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locker, |key: &String| key.clone()))
        .service_fn(|_: String| async { Ok::<_, BoxError>(()) });
    run_tasks(secs, move |task, stop, count| {
        let mut service = service.clone();
        async move {
            let key = format!("layer-{task}");
            while !stop.load(Ordering::Relaxed) {
                let _ = service.ready().await?.call(key.clone()).await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    })
    .await
}

/// The layer's cycle with `n` permits per key (a semaphore; distinct keys).
async fn permit_cycles(
    conn: redis::aio::MultiplexedConnection,
    secs: f64,
    n: u32,
) -> Result<(f64, f64), BoxError> {
    let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locker, |key: &String| key.clone()).permits(n)?)
        .service_fn(|_: String| async { Ok::<_, BoxError>(()) });
    run_tasks(secs, move |task, stop, count| {
        let mut service = service.clone();
        async move {
            let key = format!("permits-{task}");
            while !stop.load(Ordering::Relaxed) {
                let _ = service.ready().await?.call(key.clone()).await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }
    })
    .await
}

/// A rate limit's admission decisions (`Locker::admit`, one script each),
/// `TASKS` tasks: admitted (a key per task, under its limit) and refused
/// (one key over its limit).
async fn rate_decisions(
    conn: redis::aio::MultiplexedConnection,
    secs: f64,
) -> Result<(), BoxError> {
    use lockgate::lock::rate::Rate;
    let locker = Locker::new(conn.clone());
    println!("## rate limit admission decisions, {TASKS} tasks ({secs} s)");
    println!(
        "| decision | decisions/s | client CPU per decision | server CPU per decision |\n|---|---|---|---|"
    );
    for (name, rate, shared) in [
        (
            "admitted (a key per task, 10^6 per 10 s)",
            Rate::new(1_000_000, Duration::from_secs(10))?,
            false,
        ),
        (
            "refused (one key, 1 per 10 s)",
            Rate::new(1, Duration::from_secs(10))?,
            true,
        ),
    ] {
        let mut cycles = Cycles::new();
        let locker = locker.clone();
        cycles
            .measure(
                &conn,
                run_tasks(secs, move |task, stop, count| {
                    let locker = locker.clone();
                    async move {
                        let key = if shared {
                            "rate-hot".to_owned()
                        } else {
                            format!("rate-{task}")
                        };
                        while !stop.load(Ordering::Relaxed) {
                            locker.admit(&key, &rate).await?;
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(())
                    }
                }),
            )
            .await?;
        println!(
            "| {name} | {:.0} | {:.2} µs | {:.2} µs |",
            cycles.rate(),
            cycles.client_us(),
            cycles.server_us()
        );
    }
    println!();
    Ok(())
}

/// Runs `TASKS` tasks for `secs`; returns completed cycles per second, and
/// the cycles completed in all (until every task stopped).
async fn run_tasks<F, Fut>(secs: f64, task: F) -> Result<(f64, f64), BoxError>
where
    F: Fn(usize, Arc<AtomicBool>, Arc<AtomicU64>) -> Fut,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..TASKS)
        .map(|i| tokio::spawn(task(i, stop.clone(), count.clone())))
        .collect();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let n = count.load(Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    for h in handles {
        h.await??;
    }
    Ok((n as f64 / elapsed, count.load(Ordering::Relaxed) as f64))
}

/// 50 tasks over 5 hot keys, each retrying with backoff until it gets the
/// lock: rate, waiting time, and how evenly acquisitions spread over tasks.
async fn hot_keys(conn: redis::aio::MultiplexedConnection, secs: f64) -> Result<(), BoxError> {
    let locker = Locker::new(conn).ttl(Duration::from_secs(10))?;
    let backoff = Backoff::exponential(Duration::from_micros(500), Duration::from_millis(8))?
        .unlimited_attempts()
        .max_elapsed(Duration::from_secs(5));
    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker, |key: &String| key.clone())
                .on_conflict(OnConflict::retry(backoff)),
        )
        .service_fn(|_: String| async { Ok::<_, BoxError>(()) });
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..TASKS)
        .map(|task| {
            let mut service = service.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let key = format!("hot-{}", task % 5);
                let mut waits = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    let _ = service.ready().await?.call(key.clone()).await?;
                    waits.push(start.elapsed());
                }
                Ok::<_, BoxError>(waits)
            })
        })
        .collect();
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let elapsed = start.elapsed().as_secs_f64();
    let mut all = Vec::new();
    let mut per_task = Vec::new();
    for h in handles {
        let waits = h.await??;
        per_task.push(waits.len());
        all.extend(waits);
    }
    all.sort();
    per_task.sort();
    println!("## 50 tasks over 5 hot keys, retry with backoff 0.5–8 ms ({secs} s)");
    println!(
        "{:.0} acquisitions/s; call latency (wait + cycle) p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; per-task acquisitions {}–{}",
        all.len() as f64 / elapsed,
        ms(quantile(&all, 0.5)),
        ms(quantile(&all, 0.99)),
        ms(quantile(&all, 1.0)),
        per_task[0],
        per_task[per_task.len() - 1],
    );
    Ok(())
}
