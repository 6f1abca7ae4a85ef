//! `lockgate bench`: the workloads of BENCHMARKS.md, against the user's own
//! Redis, under a throwaway prefix that is deleted afterwards (also on
//! Ctrl-C).
//!
//! Each figure stands beside a comparator measured in the same run, as in
//! BENCHMARKS.md: the lock cycle beside the bare `SET NX PX` +
//! compare-and-delete pair, hot keys beside the uncontended cycle, the
//! worker beside the push rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressStyle};
use lockgate::{
    Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Queue, ReleaseListener, Worker,
};
use redis::aio::ConnectionManager;
use serde::Serialize;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};

/// How big a run is.
#[derive(Debug, Clone, Copy)]
pub struct Size {
    /// How long each timed workload runs.
    pub duration: Duration,
    /// Messages through the worker, and delayed messages.
    pub messages: usize,
}

/// One figure and its same-run comparator.
#[derive(Debug, Serialize)]
pub struct Row {
    pub workload: &'static str,
    pub lockgate: String,
    pub comparator: String,
    /// lockgate's rate over the comparator's, when both are rates.
    pub ratio: Option<f64>,
    /// The numbers behind the row, by name (rates per second, times in ms).
    pub figures: serde_json::Value,
}

const TASKS: usize = 50;

/// One cycle of a timed workload (boxed: the workloads differ in type).
type Cycle = std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), BoxError>> + Send>>;

/// Runs every workload under `prefix`; `progress` shows which.
pub async fn run(
    client: &redis::Client,
    conn: &ConnectionManager,
    prefix: &str,
    size: Size,
    progress: &ProgressBar,
) -> Result<Vec<Row>, BoxError> {
    progress.set_length(4);
    progress.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();

    progress.set_message("lock cycle");
    let locker = Locker::new(conn.clone())
        .prefix(prefix)?
        .ttl(Duration::from_secs(10))?;
    let plain = plain_pair(conn, prefix, size.duration).await?;
    let layer = layer_cycles(&locker, size.duration).await?;
    rows.push(Row {
        workload: "lock cycle, 50 tasks, distinct keys",
        lockgate: format!("{layer:.0} cycles/s through the LockLayer"),
        comparator: format!("{plain:.0} cycles/s: SET NX PX + compare-and-delete script"),
        ratio: Some(layer / plain),
        figures: serde_json::json!({"layer_cycles_per_s": layer, "plain_pair_cycles_per_s": plain}),
    });
    progress.inc(1);

    progress.set_message("hot keys");
    let listener = ReleaseListener::connect(client.clone()).await?;
    let (hot, p50, p99) = hot_keys(&locker, listener, size.duration).await?;
    rows.push(Row {
        workload: "50 tasks over 5 hot keys, retry woken by the release",
        lockgate: format!("{hot:.0} acquisitions/s, call p50 {p50:.2} ms, p99 {p99:.2} ms"),
        comparator: format!("{layer:.0} cycles/s on distinct keys (above)"),
        ratio: Some(hot / layer),
        figures: serde_json::json!({"acquisitions_per_s": hot, "call_p50_ms": p50, "call_p99_ms": p99}),
    });
    progress.inc(1);

    progress.set_message("queue end to end");
    let queue: Queue<u64> = Queue::new(conn.clone(), "bench-e2e")?.prefix(prefix)?;
    let (pushed, handled) = end_to_end(client.clone(), &queue, size.messages).await?;
    rows.push(Row {
        workload: "queue end to end: push, worker at concurrency 50, no-op handler, ack",
        lockgate: format!("{handled:.0} messages/s handled"),
        comparator: format!("{pushed:.0} messages/s pushed (batches of 100)"),
        ratio: Some(handled / pushed),
        figures: serde_json::json!({"handled_per_s": handled, "pushed_per_s": pushed}),
    });
    progress.inc(1);

    progress.set_message("delayed messages");
    let count = size.messages.min(10_000);
    let (p50, p99) = delayed_lag(client, conn, prefix, count).await?;
    rows.push(Row {
        workload: "delayed messages, due → handler start",
        lockgate: format!("p50 {p50:.2} ms, p99 {p99:.2} ms ({count} messages due over 2 s)"),
        comparator: "—".into(),
        ratio: None,
        figures: serde_json::json!({"lag_p50_ms": p50, "lag_p99_ms": p99, "messages": count}),
    });
    progress.inc(1);
    progress.finish_and_clear();
    Ok(rows)
}

/// The bare pair: `SET NX PX`, then a compare-and-delete script.
async fn plain_pair(
    conn: &ConnectionManager,
    prefix: &str,
    duration: Duration,
) -> Result<f64, BoxError> {
    let release = redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0",
    );
    let release = Arc::new(release);
    let (conn, prefix) = (conn.clone(), prefix.to_owned());
    timed(duration, move |task| {
        let (mut conn, release) = (conn.clone(), release.clone());
        let key = format!("{prefix}:bare:{task}");
        Box::pin(async move {
            let set: Option<String> = redis::cmd("SET")
                .arg(&key)
                .arg("token")
                .arg("NX")
                .arg("PX")
                .arg(10_000)
                .query_async(&mut conn)
                .await?;
            if set.is_some() {
                let _: i64 = release
                    .key(&key)
                    .arg("token")
                    .invoke_async(&mut conn)
                    .await?;
            }
            Ok(())
        }) as Cycle
    })
    .await
}

/// The request is the key (a key function takes `&Request`).
#[allow(clippy::ptr_arg)]
fn own_key(key: &String) -> String {
    key.clone()
}

/// The LockLayer's cycle: acquire, a no-op handler, release.
async fn layer_cycles(
    locker: &Locker<ConnectionManager>,
    duration: Duration,
) -> Result<f64, BoxError> {
    let svc = LockLayer::new(locker.clone(), own_key).layer(tower::service_fn(|_: String| async {
        Ok::<_, BoxError>(())
    }));
    timed(duration, move |task| {
        let svc = svc.clone();
        Box::pin(async move {
            let mut svc = svc;
            let _ = svc.ready().await?.call(format!("cycle-{task}")).await?;
            Ok(())
        }) as Cycle
    })
    .await
}

/// 50 tasks over 5 keys, retrying woken by the release: rate, p50, p99.
async fn hot_keys(
    locker: &Locker<ConnectionManager>,
    listener: ReleaseListener,
    duration: Duration,
) -> Result<(f64, f64, f64), BoxError> {
    let backoff = Backoff::exponential(Duration::from_micros(500), Duration::from_millis(8))?
        .unlimited_attempts()
        .max_elapsed(Duration::from_secs(30));
    let svc = LockLayer::new(locker.clone(), |key: &String| key.clone())
        .on_conflict(OnConflict::retry(backoff))
        .wake_on_release(listener)
        .layer(tower::service_fn(|_: String| async {
            Ok::<_, BoxError>(())
        }));
    let latencies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let rate = timed(duration, {
        let latencies = latencies.clone();
        move |task| {
            let (svc, latencies) = (svc.clone(), latencies.clone());
            Box::pin(async move {
                let started = Instant::now();
                let mut svc = svc;
                let _ = svc.ready().await?.call(format!("hot-{}", task % 5)).await?;
                if let Ok(mut l) = latencies.lock() {
                    l.push(started.elapsed());
                }
                Ok(())
            }) as Cycle
        }
    })
    .await?;
    let mut latencies = latencies.lock().map_err(|_| "poisoned")?.clone();
    Ok((
        rate,
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
    ))
}

/// Pushes `messages`, then lets a worker (concurrency 50) handle them all.
/// Returns (push rate, handling rate).
/// Pushes `messages` to `queue` in batches of 100, then drains them with a
/// worker at concurrency 50 and a no-op handler: (pushed, handled) per
/// second.
async fn end_to_end<C, K>(
    connector: K,
    queue: &Queue<u64, C>,
    messages: usize,
) -> Result<(f64, f64), BoxError>
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
    K: lockgate::queue::Connector,
{
    let started = Instant::now();
    let payloads: Vec<u64> = (0..messages as u64).collect();
    for chunk in payloads.chunks(100) {
        queue.push_many(chunk).await?;
    }
    let pushed = messages as f64 / started.elapsed().as_secs_f64();
    let handled = Arc::new(AtomicU64::new(0));
    let service = {
        let handled = handled.clone();
        tower::service_fn(move |_: Job<u64>| {
            handled.fetch_add(1, Ordering::Relaxed);
            async { Ok::<_, BoxError>(()) }
        })
    };
    let started = Instant::now();
    let done = {
        let handled = handled.clone();
        async move {
            while handled.load(Ordering::Relaxed) < messages as u64 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    Worker::new(connector, queue.clone(), service)
        .concurrency(50)?
        .run_until(done)
        .await?;
    Ok((pushed, messages as f64 / started.elapsed().as_secs_f64()))
}

/// `count` messages due over the next 2 s; the lag from each one's due time
/// to its handler's start: (p50, p99) in ms.
async fn delayed_lag(
    client: &redis::Client,
    conn: &ConnectionManager,
    prefix: &str,
    count: usize,
) -> Result<(f64, f64), BoxError> {
    let queue: Queue<u64> = Queue::new(conn.clone(), "bench-delayed")?.prefix(prefix)?;
    let spread = Duration::from_secs(2);
    // Far enough ahead that every push lands before the first is due:
    // pushed by 50 tasks, a round trip each.
    let pushing = Instant::now();
    let start =
        SystemTime::now() + Duration::from_millis(500) + Duration::from_micros(200) * count as u32;
    let mut pushes = tokio::task::JoinSet::new();
    for task in 0..TASKS {
        let queue = queue.clone();
        pushes.spawn(async move {
            for i in (task..count).step_by(TASKS) {
                let at = start + spread.mul_f64(i as f64 / count.max(1) as f64);
                queue
                    .push_with(i as u64, lockgate::PushOptions::new().at(at))
                    .await?;
            }
            Ok::<_, BoxError>(())
        });
    }
    while let Some(pushed) = pushes.join_next().await {
        pushed??;
    }
    if SystemTime::now() > start {
        return Err(format!(
            "pushing {count} delayed messages took {:?}, past their due times: use fewer --messages",
            pushing.elapsed()
        )
        .into());
    }
    let lags = Arc::new(std::sync::Mutex::new(Vec::with_capacity(count)));
    let service = {
        let lags = lags.clone();
        tower::service_fn(move |job: Job<u64>| {
            let lag = SystemTime::now()
                .duration_since(job.due_at())
                .unwrap_or_default();
            if let Ok(mut l) = lags.lock() {
                l.push(lag);
            }
            async { Ok::<_, BoxError>(()) }
        })
    };
    let done = {
        let lags = lags.clone();
        async move {
            while lags.lock().map(|l| l.len()).unwrap_or(count) < count {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    Worker::new(client.clone(), queue, service)
        .concurrency(50)?
        .run_until(done)
        .await?;
    let mut lags = lags.lock().map_err(|_| "poisoned")?.clone();
    Ok((percentile(&mut lags, 0.5), percentile(&mut lags, 0.99)))
}

/// Runs `TASKS` tasks, each repeating `cycle(task)` until `duration` ends;
/// returns cycles per second.
async fn timed<F>(duration: Duration, cycle: F) -> Result<f64, BoxError>
where
    F: Fn(usize) -> Cycle + Send + Sync + 'static + Clone,
{
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let started = Instant::now();
    for task in 0..TASKS {
        let (stop, count, cycle) = (stop.clone(), count.clone(), cycle.clone());
        tasks.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                cycle(task).await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, BoxError>(())
        });
    }
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(count.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// The `q` quantile of `values`, in ms.
fn percentile(values: &mut [Duration], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort();
    let at = ((values.len() - 1) as f64 * q).round() as usize;
    values[at].as_secs_f64() * 1000.0
}

/// What one run of a queue on a cluster did: messages handled per second,
/// and per master the commands it served and its CPU time.
struct ClusterRun {
    handled: f64,
    commands: Vec<u64>,
    cpu: Vec<Duration>,
}

/// Runs the sharded-queue workload on a cluster whose masters are
/// `masters` (a connection to each): one queue in one slot, then the same
/// queue over as many shards as masters, each pushed `messages` and drained
/// by a worker at concurrency 50 (see docs/cluster.md, "One queue across a
/// Redis Cluster").
pub async fn run_cluster(
    client: &redis::cluster::ClusterClient,
    conn: &redis::cluster_async::ClusterConnection,
    masters: &[ConnectionManager],
    prefix: &str,
    size: Size,
    progress: &ProgressBar,
) -> Result<Vec<Row>, BoxError> {
    progress.set_length(2);
    let mut runs = Vec::new();
    for (shards, what) in [(1, "one slot"), (masters.len().max(1), "shards")] {
        progress.set_message(format!("queue in {what}"));
        let name = format!("bench-cluster-{shards}");
        let queue: Queue<u64, _> = Queue::new(conn.clone(), name)?
            .prefix(prefix)?
            .shards(shards)?;
        let before = master_counters(masters).await?;
        let (_, handled) = end_to_end(client.clone(), &queue, size.messages).await?;
        let after = master_counters(masters).await?;
        let delta = |i: usize| {
            (
                after[i].0.saturating_sub(before[i].0),
                after[i].1 - before[i].1,
            )
        };
        runs.push(ClusterRun {
            handled,
            cpu: (0..masters.len()).map(|i| delta(i).0).collect(),
            commands: (0..masters.len()).map(|i| delta(i).1).collect(),
        });
        progress.inc(1);
    }
    let (one, sharded) = (&runs[0], &runs[1]);
    let per_message = |run: &ClusterRun| {
        let cpu: Duration = run.cpu.iter().sum();
        cpu.as_secs_f64() * 1e6 / size.messages as f64
    };
    let mean = sharded.commands.iter().sum::<u64>() as f64 / masters.len().max(1) as f64;
    let worst = (sharded.commands.iter())
        .map(|c| (*c as f64 - mean).abs())
        .fold(0.0, f64::max);
    Ok(vec![Row {
        workload: "one queue across the masters: push, worker at concurrency 50, no-op handler, ack",
        lockgate: format!(
            "{:.0} messages/s over {} shards; commands per master {:?} (largest deviation {:.0} %); server CPU {:.1} µs per message",
            sharded.handled,
            masters.len(),
            sharded.commands,
            100.0 * worst / mean.max(1.0),
            per_message(sharded)
        ),
        comparator: format!(
            "{:.0} messages/s in one slot; server CPU {:.1} µs per message",
            one.handled,
            per_message(one)
        ),
        ratio: Some(sharded.handled / one.handled),
        figures: serde_json::json!({
            "sharded_handled_per_s": sharded.handled,
            "one_slot_handled_per_s": one.handled,
            "sharded_commands_per_master": sharded.commands,
            "sharded_server_cpu_us_per_message": per_message(sharded),
            "one_slot_server_cpu_us_per_message": per_message(one),
        }),
    }])
}

/// Per master: its CPU time so far and the commands it has served.
async fn master_counters(masters: &[ConnectionManager]) -> Result<Vec<(Duration, u64)>, BoxError> {
    let mut out = Vec::with_capacity(masters.len());
    for master in masters {
        let mut conn = master.clone();
        let info: String = redis::cmd("INFO")
            .arg("everything")
            .query_async(&mut conn)
            .await?;
        let field = |name: &str| {
            (info.lines()).find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(':')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
        };
        let cpu = field("used_cpu_user").unwrap_or(0.0) + field("used_cpu_sys").unwrap_or(0.0);
        let commands = field("total_commands_processed").unwrap_or(0.0);
        out.push((Duration::from_secs_f64(cpu), commands as u64));
    }
    Ok(out)
}
