//! lockgate's queue beside the official Rust port of BullMQ (crate
//! `bullmq-official`), in the same run: end-to-end throughput of a worker at
//! concurrency 50, due-time lag of delayed messages, and Redis bytes per
//! waiting message. Every measurement gets a fresh redis-server from
//! `lockgate::testing`, the same for both, with the same 100-byte payload.
//!
//! ```text
//! cargo bench -p lockgate-bench --bench bullmq                      # full run
//! benches/pin.sh 0 1 cargo bench -p lockgate-bench --bench bullmq   # server on CPU 0, client on 1
//! cargo test -p lockgate-bench --benches                            # smoke run, tiny inputs
//! ```
//!
//! Both are configured as their users would for this job: lockgate's
//! defaults (acknowledged messages are deleted); BullMQ with
//! `removeOnComplete: true` (its default keeps every completed job) and its
//! other defaults, its events stream included.

#[path = "../../benches/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bullmq::options::RedisConnectionOptions;
use bullmq::types::RemoveOnFinish;
use bullmq::{BulkJob, QueueOptions, WorkerOptions};
use common::{drain, full_run, median, ms, quantile, size, used_memory};
use lockgate::testing::RedisServer;
use lockgate::{BoxError, Job, PushOptions, Queue, Worker};
use tokio::sync::Mutex;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let run = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    if run("memory") {
        memory().await?;
    }
    if run("throughput") {
        throughput().await?;
    }
    if run("lag") {
        lag(size(10_000, 200), Duration::from_secs(2), 10).await?;
        lag(200, Duration::from_secs(2), 10).await?;
        // BullMQ times delayed jobs with a blocking command's timeout, which
        // Redis checks `hz` times a second: the same at hz 100.
        lag(200, Duration::from_secs(2), 100).await?;
    }
    Ok(())
}

/// A 100-byte JSON payload: a string of 98 characters plus its quotes.
fn payload() -> String {
    "x".repeat(98)
}

fn connection(server: &RedisServer) -> RedisConnectionOptions {
    RedisConnectionOptions::new().url(server.url())
}

fn micros_since_epoch(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

// ---------------------------------------------------------------------------
// Memory per waiting message

async fn memory() -> Result<(), BoxError> {
    let n = size(100_000, 1_000);
    println!("## Redis bytes per waiting message ({n} messages, 100-byte payload), same run");
    println!("| state | lockgate | BullMQ (Rust) | BullMQ / lockgate |\n|---|---|---|---|");
    for (label, delay) in [
        ("due now", None),
        ("delayed 1 h", Some(Duration::from_secs(3600))),
    ] {
        let ours = lockgate_memory(n, delay).await?;
        let theirs = bullmq_memory(n, delay).await?;
        println!(
            "| {label} | {ours:.0} | {theirs:.0} | {:.2}× |",
            theirs / ours
        );
    }
    println!();
    Ok(())
}

async fn lockgate_memory(n: usize, delay: Option<Duration>) -> Result<f64, BoxError> {
    let server = RedisServer::start()?;
    let queue: Queue<String> = Queue::new(server.connection_manager().await?, "mem")?;
    queue.push(payload()).await?; // the keys exist before the first reading
    let before = used_memory(&server)?;
    let options = delay.map_or_else(PushOptions::new, |d| PushOptions::new().after(d));
    let msg = payload();
    queue
        .push_many_with((0..n).map(|_| (&msg, options.clone())))
        .await?;
    Ok((used_memory(&server)? - before) as f64 / n as f64)
}

async fn bullmq_memory(n: usize, delay: Option<Duration>) -> Result<f64, BoxError> {
    let server = RedisServer::start()?;
    let queue =
        bullmq::Queue::with_options("mem", QueueOptions::new().connection(connection(&server)))
            .await?;
    queue.add("m", payload()).await?;
    let before = used_memory(&server)?;
    add_bulk(&queue, n, delay).await?;
    let bytes = (used_memory(&server)? - before) as f64 / n as f64;
    queue.close().await;
    Ok(bytes)
}

/// `n` jobs with the payload, in bulks of 1000.
async fn add_bulk(
    queue: &bullmq::Queue,
    n: usize,
    delay: Option<Duration>,
) -> Result<(), BoxError> {
    let msg = payload();
    let mut left = n;
    while left > 0 {
        let take = left.min(1000);
        let jobs = (0..take)
            .map(|_| {
                let job = BulkJob::new("m", &msg);
                match delay {
                    Some(d) => job.delay(d),
                    None => job,
                }
            })
            .collect();
        queue.add_bulk(jobs).await?;
        left -= take;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// End-to-end throughput

async fn throughput() -> Result<(), BoxError> {
    let n = size(100_000, 2_000);
    let rounds = if full_run() { 3 } else { 1 };
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        ours.push(lockgate_throughput(n).await?);
        theirs.push(bullmq_throughput(n).await?);
    }
    let (ours, theirs) = (median(ours), median(theirs));
    println!(
        "## end to end: {n} waiting messages, a worker at concurrency 50 with a no-op handler, until all are acknowledged (median of {rounds}), same run"
    );
    println!("| queue | messages/s |\n|---|---|");
    println!("| lockgate Worker | {ours:.0} |");
    println!("| BullMQ (Rust) Worker, removeOnComplete | {theirs:.0} |");
    println!("lockgate / BullMQ = {:.2}×\n", ours / theirs);
    Ok(())
}

async fn lockgate_throughput(n: usize) -> Result<f64, BoxError> {
    let server = RedisServer::start()?;
    let queue: Queue<String> = Queue::new(server.connection_manager().await?, "e2e")?;
    let msg = payload();
    queue.push_many(std::iter::repeat_n(&msg, n)).await?;
    // Until `done`, the acknowledged messages, reaches n.
    drain(server.client(), &queue, n).await
}

async fn bullmq_throughput(n: usize) -> Result<f64, BoxError> {
    let server = RedisServer::start()?;
    let queue =
        bullmq::Queue::with_options("e2e", QueueOptions::new().connection(connection(&server)))
            .await?;
    add_bulk(&queue, n, None).await?;
    let done = Arc::new(AtomicU64::new(0));
    let counter = done.clone();
    let options = WorkerOptions::new()
        .connection(connection(&server))
        .concurrency(50)
        .remove_on_complete(RemoveOnFinish::Bool(true));
    let start = Instant::now();
    let worker = Arc::new(
        bullmq::Worker::with_options(
            "e2e",
            move |_job: bullmq::Job, _cancel| {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::Relaxed);
                    Ok(serde_json::Value::Null)
                }
            },
            options,
        )
        .await?,
    );
    // Its events go to an unbounded channel: read them, as a user must.
    let events = tokio::spawn({
        let worker = worker.clone();
        async move { while worker.next_event().await.is_some() {} }
    });
    while done.load(Ordering::Relaxed) < n as u64 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The processor returned; the last completions are written after it:
    // done when nothing is waiting or active any more.
    loop {
        let counts = queue.get_job_counts().await?;
        if counts.waiting == 0 && counts.active == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    worker.close(5_000).await?;
    events.abort();
    queue.close().await;
    Ok(rate)
}

// ---------------------------------------------------------------------------
// Delayed messages: due time to handler start

/// `n` messages due evenly over `over`, starting 300 ms from now, pushed one
/// by one from a separate task; the lag of each from its due time to its
/// handler's start.
async fn lag(n: usize, over: Duration, hz: u32) -> Result<(), BoxError> {
    let (ours, our_push) = lockgate_lag(n, over, hz).await?;
    let (theirs, their_push) = bullmq_lag(n, over, hz).await?;
    println!(
        "## delayed messages: {n} due over {over:?}, pushed one by one from a separate task; lag from due to handler start; server at hz {hz}; same run"
    );
    println!(
        "| queue | received | p50 ms | p99 ms | max ms | producer done after |\n|---|---|---|---|---|---|"
    );
    for (name, lags, push) in [
        ("lockgate", &ours, our_push),
        ("BullMQ (Rust)", &theirs, their_push),
    ] {
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} | {push:.2?} |",
            lags.len(),
            ms(quantile(lags, 0.5)),
            ms(quantile(lags, 0.99)),
            ms(quantile(lags, 1.0)),
        );
    }
    println!(
        "p99 BullMQ / lockgate = {:.1}×\n",
        ms(quantile(&theirs, 0.99)) / ms(quantile(&ours, 0.99)).max(0.001)
    );
    Ok(())
}

fn server_at(hz: u32) -> Result<RedisServer, BoxError> {
    Ok(RedisServer::builder()
        .arg("--hz")
        .arg(hz.to_string())
        .start()?)
}

fn due_times(n: usize, over: Duration) -> Vec<SystemTime> {
    let first = SystemTime::now() + Duration::from_millis(300);
    (0..n)
        .map(|i| first + over.mul_f64(i as f64 / n as f64))
        .collect()
}

/// The lags, and how long the producer took to push everything (beyond
/// 300 ms + `over`, it fell behind the due times).
async fn lockgate_lag(
    n: usize,
    over: Duration,
    hz: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let server = server_at(hz)?;
    let queue: Queue<u64> = Queue::new(server.connection_manager().await?, "lag")?;
    let lags = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let service = tower::service_fn({
        let lags = lags.clone();
        move |job: Job<u64>| {
            let lag = SystemTime::now()
                .duration_since(job.due_at())
                .unwrap_or_default();
            let lags = lags.clone();
            async move {
                lags.lock().await.push(lag);
                Ok::<_, BoxError>(())
            }
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service).concurrency(50)?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stopped));
    let started = Instant::now();
    let producer = tokio::spawn(async move {
        for (i, due) in due_times(n, over).into_iter().enumerate() {
            queue.push_at(i as u64, due).await?;
        }
        Ok::<_, BoxError>(())
    });
    producer.await??;
    let pushed = started.elapsed();
    wait_for(&lags, n, over).await;
    let _ = stop.send(());
    run.await??;
    Ok((sorted(lags).await?, pushed))
}

async fn bullmq_lag(
    n: usize,
    over: Duration,
    hz: u32,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let server = server_at(hz)?;
    let queue =
        bullmq::Queue::with_options("lag", QueueOptions::new().connection(connection(&server)))
            .await?;
    let lags = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let options = WorkerOptions::new()
        .connection(connection(&server))
        .concurrency(50)
        .remove_on_complete(RemoveOnFinish::Bool(true));
    let worker = Arc::new(
        bullmq::Worker::with_options(
            "lag",
            {
                let lags = lags.clone();
                move |job: bullmq::Job, _cancel| {
                    // The due time the producer meant, carried in the payload
                    // (the job's own `delay` reads 0 once it was promoted).
                    // BullMQ keeps the timestamp and the delay in whole ms,
                    // so it may start a job up to ~2 ms before that time:
                    // such starts count as a lag of 0.
                    let now = micros_since_epoch(SystemTime::now());
                    let due = job
                        .data()
                        .get("due")
                        .and_then(serde_json::Value::as_u64)
                        .unwrap_or(now);
                    let lag = Duration::from_micros(now.saturating_sub(due));
                    let lags = lags.clone();
                    async move {
                        lags.lock().await.push(lag);
                        Ok(serde_json::Value::Null)
                    }
                }
            },
            options,
        )
        .await?,
    );
    let events = tokio::spawn({
        let worker = worker.clone();
        async move { while worker.next_event().await.is_some() {} }
    });
    let started = Instant::now();
    let producer = tokio::spawn({
        let queue = Arc::new(queue);
        let handle = queue.clone();
        let task = async move {
            for (i, due) in due_times(n, over).into_iter().enumerate() {
                let delay = due.duration_since(SystemTime::now()).unwrap_or_default();
                let data = serde_json::json!({ "i": i, "due": micros_since_epoch(due) });
                queue.add("m", data).delay(delay).await?;
            }
            Ok::<_, BoxError>(())
        };
        async move { (task.await, handle) }
    });
    let (produced, queue) = producer.await?;
    produced?;
    let pushed = started.elapsed();
    wait_for(&lags, n, over).await;
    worker.close(5_000).await?;
    events.abort();
    queue.close().await;
    Ok((sorted(lags).await?, pushed))
}

async fn wait_for(lags: &Mutex<Vec<Duration>>, n: usize, over: Duration) {
    let deadline = Instant::now() + over + Duration::from_secs(30);
    while lags.lock().await.len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn sorted(lags: Arc<Mutex<Vec<Duration>>>) -> Result<Vec<Duration>, BoxError> {
    let mut lags = lags.lock().await.clone();
    lags.sort();
    Ok(lags)
}
