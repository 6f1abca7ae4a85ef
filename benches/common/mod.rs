//! Shared by the benchmark programs: mode detection and statistics.
#![allow(dead_code)]

use std::time::Duration;

/// `cargo bench` passes `--bench`; `cargo test --all-targets` does not, and
/// then each benchmark only checks that it runs, on tiny inputs.
pub fn full_run() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Scales a workload down in smoke mode.
pub fn size(full: usize, smoke: usize) -> usize {
    if full_run() { full } else { smoke }
}

/// The value at quantile `q` (0..=1) of a sorted slice.
pub fn quantile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// CPU time this process has used (user + system), from `/proc/self/stat`
/// (clock ticks of 10 ms: read it around runs of seconds).
pub fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name (field 2) may hold spaces; fields after it do not.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15, the 12th and 13th after the name.
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

/// The server's `used_memory` (`INFO memory`), in bytes.
pub fn used_memory(
    server: &lockgate::testing::RedisServer,
) -> Result<i64, Box<dyn std::error::Error + Send + Sync>> {
    let info: String = server.query(redis::cmd("INFO").arg("memory"))?;
    Ok(info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .ok_or("no used_memory in INFO")?
        .trim()
        .parse()?)
}

/// CPU time the server has used (user + system, `INFO cpu`).
pub async fn server_cpu(conn: &redis::aio::MultiplexedConnection) -> redis::RedisResult<Duration> {
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn.clone())
        .await?;
    let secs: f64 = info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_user:")
                .or_else(|| l.strip_prefix("used_cpu_sys:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    Ok(Duration::from_secs_f64(secs))
}

/// Runs a worker at concurrency 50 with a no-op handler over `queue` until
/// `n` messages are acknowledged; returns messages per second.
pub async fn drain<T, C, K>(
    connector: K,
    queue: &lockgate::Queue<T, C>,
    n: usize,
) -> Result<f64, lockgate::BoxError>
where
    T: serde::Serialize + serde::de::DeserializeOwned + Send + Sync + 'static,
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    K: lockgate::queue::Connector,
{
    let service =
        tower::service_fn(|_: lockgate::Job<T>| async { Ok::<_, lockgate::BoxError>(()) });
    let worker = lockgate::Worker::new(connector, queue.clone(), service).concurrency(50)?;
    let metrics = worker.metrics();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let start = std::time::Instant::now();
    let run = tokio::spawn(worker.run_until(stopped));
    while metrics.snapshot().done < n as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = stop.send(());
    run.await??;
    Ok(rate)
}
