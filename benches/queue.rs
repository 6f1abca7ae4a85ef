//! Queue and worker benchmarks: memory per message, claim throughput and
//! its cost as the schedule grows, end-to-end throughput against the bare
//! scripts, commands per message, and delivery lag of delayed messages.
//!
//! `cargo bench --bench queue` (full run); built and run on tiny inputs by
//! `cargo test --all-targets`. `cargo bench --bench queue -- --bench lag`
//! runs only the sections whose name contains `lag`.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use common::*;
use lockgate::testing::RedisServer;
use lockgate::{BoxError, Job, PushOptions, Queue, Worker};
use redis::aio::ConnectionManager;
use tokio::sync::Mutex;

type Conn = ConnectionManager;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with("--"));
    let run = |name: &str| filter.as_deref().is_none_or(|f| name.contains(f));
    if run("memory") {
        memory().await?;
    }
    if run("claim") {
        claim_throughput().await?;
        claim_scaling().await?;
    }
    if run("throughput") {
        end_to_end().await?;
    }
    if run("priorit") {
        priority_claim_cost().await?;
    }
    if run("events") {
        events_cost().await?;
    }
    if run("lag") {
        lag(size(10_000, 200), Duration::from_secs(2)).await?;
        lag(200, Duration::from_secs(2)).await?;
    }
    Ok(())
}

/// A 100-byte JSON payload: a string of 98 characters plus its quotes.
fn payload() -> String {
    "x".repeat(98)
}

async fn memory() -> Result<(), BoxError> {
    let n = size(100_000, 1_000);
    println!("## Redis memory per waiting message ({n} messages, 100-byte payload)");
    println!("| state | bytes/message |\n|---|---|");
    for (label, options) in [
        ("due now", PushOptions::new()),
        (
            "delayed 1 h",
            PushOptions::new().after(Duration::from_secs(3600)),
        ),
    ] {
        let server = RedisServer::start()?;
        let conn = server.connection_manager().await?;
        let queue: Queue<String> = Queue::new(conn, "mem")?;
        queue.push(payload()).await?; // create the keys first
        let before = used_memory(&server)?;
        let msg = payload();
        queue
            .push_many_with((0..n).map(|_| (&msg, options.clone())))
            .await?;
        let after = used_memory(&server)?;
        println!("| {label} | {:.0} |", (after - before) as f64 / n as f64);
    }
    println!();
    Ok(())
}

/// Messages claimed per second with 8 concurrent claimers, by batch size.
async fn claim_throughput() -> Result<(), BoxError> {
    let n = size(200_000, 2_000);
    println!("## claim throughput, 8 claimers, {n} due messages (claims only)");
    println!("| batch | claimed messages/s |\n|---|---|");
    for batch in [1, 10, 100] {
        let server = RedisServer::start()?;
        let conn = server.connection_manager().await?;
        let queue: Queue<String> = Queue::new(conn, "claim")?;
        let msg = payload();
        queue.push_many(std::iter::repeat_n(&msg, n)).await?;
        let start = Instant::now();
        let claimers: Vec<_> = (0..8)
            .map(|_| {
                let queue = queue.clone();
                tokio::spawn(async move {
                    loop {
                        let claimed = queue.claim(batch, Duration::from_secs(60)).await?;
                        if claimed.jobs.is_empty() {
                            return Ok::<_, BoxError>(());
                        }
                    }
                })
            })
            .collect();
        for c in claimers {
            c.await??;
        }
        println!(
            "| {batch} | {:.0} |",
            n as f64 / start.elapsed().as_secs_f64()
        );
    }
    println!();
    Ok(())
}

/// Time of one claim of 10 due messages beside N messages due later.
async fn claim_scaling() -> Result<(), BoxError> {
    println!("## claim cost as the schedule grows (claim 10 due messages beside N later ones)");
    println!("| N later | mean claim latency |\n|---|---|");
    let sizes: &[usize] = if full_run() {
        &[1_000, 10_000, 100_000, 1_000_000]
    } else {
        &[1_000]
    };
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<String> = Queue::new(conn, "scale")?;
    let msg = payload();
    let mut later = 0;
    for &target in sizes {
        let options = PushOptions::new().after(Duration::from_secs(3600));
        queue
            .push_many_with((later..target).map(|_| (&msg, options.clone())))
            .await?;
        later = target;
        let rounds = 200;
        queue
            .push_many(std::iter::repeat_n(&msg, rounds * 10))
            .await?;
        let start = Instant::now();
        for _ in 0..rounds {
            let claimed = queue.claim(10, Duration::from_secs(60)).await?;
            assert_eq!(claimed.jobs.len(), 10);
        }
        println!(
            "| {target} | {:.1} µs |",
            start.elapsed().as_secs_f64() * 1e6 / rounds as f64
        );
    }
    println!();
    Ok(())
}

async fn commandstats(conn: &mut Conn) -> Result<HashMap<String, u64>, BoxError> {
    Ok(lockgate::testing::command_calls(conn).await?)
}

/// Worker throughput (push, no-op handler, ack) at concurrency 50, beside
/// the bare minimal scripts doing the same in the same run.
async fn end_to_end() -> Result<(), BoxError> {
    let n = size(100_000, 2_000);
    let rounds = if full_run() { 3 } else { 1 };
    let (mut worker_rates, mut bare_rates, mut push_rates) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_message = (0.0, 0.0);
    for _ in 0..rounds {
        let server = RedisServer::start()?;
        let mut conn = server.connection_manager().await?;
        let queue: Queue<String> = Queue::new(conn.clone(), "e2e")?;
        let msg = payload();
        let before = commandstats(&mut conn).await?;
        let start = Instant::now();
        queue.push_many(std::iter::repeat_n(&msg, n)).await?;
        push_rates.push(n as f64 / start.elapsed().as_secs_f64());

        worker_rates.push(drain(server.client(), &queue, n).await?);
        let after = commandstats(&mut conn).await?;
        let delta = |name: &str| after.get(name).unwrap_or(&0) - before.get(name).unwrap_or(&0);
        let all: u64 = after.keys().map(|k| delta(k)).sum::<u64>() - delta("info");
        let script_calls = delta("evalsha") + delta("eval");
        // Commands the client sent: script calls plus any plain command
        // (BLPOP, CONFIG, ...) other than those issued inside scripts.
        let inside: u64 = [
            "zrangebyscore",
            "zrem",
            "hmget",
            "incr",
            "zadd",
            "time",
            "zrange",
            "hsetnx",
            "hdel",
            "lpush",
            "ltrim",
            "zscore",
            "hget",
            "hset",
            "zcount",
            "zcard",
        ]
        .iter()
        .map(|c| delta(c))
        .sum();
        let client_calls = all - inside;
        per_message = (client_calls as f64 / n as f64, all as f64 / n as f64);
        let _ = script_calls;

        bare_rates.push(bare(&server, n).await?);
    }
    println!(
        "## end to end: push {n} messages, worker at concurrency 50 with a no-op handler, ack (median of {rounds})"
    );
    println!("| path | messages/s |\n|---|---|");
    println!(
        "| push_many (batches of 1000) | {:.0} |",
        median(push_rates)
    );
    println!(
        "| bare minimal scripts: claim 100, ack each, 50 in flight, no library | {:.0} |",
        median(bare_rates.clone())
    );
    println!(
        "| lockgate Worker: claim, service call, ack | {:.0} |",
        median(worker_rates.clone())
    );
    println!(
        "Worker / bare = {:.1} %",
        100.0 * median(worker_rates) / median(bare_rates)
    );
    println!(
        "Redis commands per processed message (push + claim + ack, INFO commandstats, last round): {:.2} client calls, {:.2} commands in all\n",
        per_message.0, per_message.1
    );
    Ok(())
}

/// The least a Redis queue can do: claim up to 100 due ids with their
/// payloads in one script, ack each with a second one, 50 acks in flight.
async fn bare(server: &RedisServer, n: usize) -> Result<f64, BoxError> {
    let mut conn = server.connection_manager().await?;
    let msg = payload();
    let push = redis::Script::new(
        "for i = 1, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i+1]) redis.call('ZADD', KEYS[2], 0, ARGV[i]) end",
    );
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut call = push.key("bare:{q}:data");
        call.key("bare:{q}:schedule");
        for i in chunk {
            call.arg(i).arg(&msg);
        }
        call.invoke_async::<()>(&mut conn).await?;
    }
    let claim = redis::Script::new(
        "local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
         if #ids == 0 then return {} end
         redis.call('ZREM', KEYS[1], unpack(ids))
         local out = {}
         for i, id in ipairs(ids) do redis.call('ZADD', KEYS[2], ARGV[1] + 30000, id) out[#out+1] = id end
         local data = redis.call('HMGET', KEYS[3], unpack(ids))
         for i, d in ipairs(data) do out[#out+1] = d end
         return out",
    );
    let ack = Arc::new(redis::Script::new(
        "if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then redis.call('HDEL', KEYS[2], ARGV[1]) end",
    ));
    let permits = Arc::new(tokio::sync::Semaphore::new(50));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    loop {
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_millis() as u64;
        let reply: Vec<String> = claim
            .key("bare:{q}:schedule")
            .key("bare:{q}:active")
            .key("bare:{q}:data")
            .arg(now)
            .invoke_async(&mut conn)
            .await?;
        if reply.is_empty() {
            break;
        }
        let ids = &reply[..reply.len() / 2];
        for id in ids {
            let permit = permits.clone().acquire_owned().await?;
            let (mut conn, ack, id, done) = (conn.clone(), ack.clone(), id.clone(), done.clone());
            tokio::spawn(async move {
                let _: redis::RedisResult<()> = ack
                    .key("bare:{q}:active")
                    .key("bare:{q}:data")
                    .arg(id)
                    .invoke_async(&mut conn)
                    .await;
                done.fetch_add(1, Ordering::Relaxed);
                drop(permit);
            });
        }
    }
    while done.load(Ordering::Relaxed) < n as u64 {
        tokio::task::yield_now().await;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Lag from each delayed message's due time to its handler's start.
async fn lag(n: usize, over: Duration) -> Result<(), BoxError> {
    let server = RedisServer::start()?;
    let conn = server.connection_manager().await?;
    let queue: Queue<u64> = Queue::new(conn, "lag")?;
    let lags = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let record = lags.clone();
    let service = tower::service_fn(move |job: Job<u64>| {
        let lag = SystemTime::now()
            .duration_since(job.due_at())
            .unwrap_or_default();
        let record = record.clone();
        async move {
            record.lock().await.push(lag);
            Ok::<_, BoxError>(())
        }
    });
    let worker = Worker::new(server.client(), queue.clone(), service).concurrency(50)?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(worker.run_until(stopped));
    // A separate producer task pushes the messages one by one, each due at
    // its own moment spread evenly over `over`, starting 300 ms from now.
    let producer = tokio::spawn({
        let queue = queue.clone();
        async move {
            let first = SystemTime::now() + Duration::from_millis(300);
            for i in 0..n {
                let due = first + over.mul_f64(i as f64 / n as f64);
                queue.push_at(i as u64, due).await?;
            }
            Ok::<_, BoxError>(())
        }
    });
    producer.await??;
    let deadline = Instant::now() + over + Duration::from_secs(30);
    while lags.lock().await.len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    run.await??;
    let mut lags = lags.lock().await.clone();
    lags.sort();
    println!(
        "## delayed messages: {} due over {:?}, pushed one by one from a separate task; lag due → handler start\np50 {:.2} ms, p95 {:.2} ms, p99 {:.2} ms, max {:.2} ms\n",
        lags.len(),
        over,
        ms(quantile(&lags, 0.5)),
        ms(quantile(&lags, 0.95)),
        ms(quantile(&lags, 0.99)),
        ms(quantile(&lags, 1.0)),
    );
    Ok(())
}

/// The claim script before priorities, with today's prelude: the
/// comparator of the claim cost of a queue without priorities.
fn claim_before_priorities() -> redis::Script {
    redis::Script::new(&format!(
        "{}\n{}",
        include_str!("../src/queue/lua/prelude.lua"),
        include_str!("baseline/claim_before_priorities.lua")
    ))
}

/// Claims of 10 due messages beside 100,000 messages due later: mean
/// latency from one client and the server's CPU time per claim, for the
/// claim script before priorities, today's claim on a queue without
/// priorities, and today's claim with every message prioritized (spread over
/// the 9 levels), same run.
async fn priority_claim_cost() -> Result<(), BoxError> {
    let later = size(100_000, 1_000);
    let rounds = size(5_000, 50);
    let repeats = if full_run() { 3 } else { 1 };
    println!(
        "## claim cost with and without priorities: claim 10 due messages beside {later} later ones ({rounds} claims, median of {repeats}), same run"
    );
    println!("| claim | mean latency | server CPU per claim |\n|---|---|---|");
    let variants = [
        "before priorities (previous script)",
        "no priorities",
        "every message prioritized (levels 1–9)",
    ];
    let mut results: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); variants.len()];
    for _ in 0..repeats {
        for (v, result) in results.iter_mut().enumerate() {
            let server = RedisServer::start()?;
            let conn = server.connection_manager().await?;
            let cpu_conn = server.multiplexed().await?;
            let queue: Queue<String> = Queue::new(conn.clone(), "prio")?;
            let msg = payload();
            let options = |i: usize| {
                let options = PushOptions::new();
                if v == 2 {
                    options.priority((i % 9 + 1) as u8)
                } else {
                    options
                }
            };
            queue
                .push_many_with(
                    (0..later).map(|i| (&msg, options(i).after(Duration::from_secs(3600)))),
                )
                .await?;
            queue
                .push_many_with((0..rounds * 10).map(|i| (&msg, options(i))))
                .await?;
            let baseline = claim_before_priorities();
            let keys = ["data", "schedule", "active", "claims", "bell"]
                .map(|k| format!("lockgate:{{prio}}:{k}"));
            let cpu_before = server_cpu(&cpu_conn).await?;
            let start = Instant::now();
            for _ in 0..rounds {
                let got = if v == 0 {
                    let mut call = baseline.prepare_invoke();
                    for key in &keys {
                        call.key(key);
                    }
                    let reply: Vec<redis::Value> = call
                        .arg(10)
                        .arg(60_000)
                        .invoke_async(&mut conn.clone())
                        .await?;
                    (reply.len() - 3) / 3
                } else {
                    queue.claim(10, Duration::from_secs(60)).await?.jobs.len()
                };
                assert_eq!(got, 10);
            }
            let elapsed = start.elapsed();
            let cpu = server_cpu(&cpu_conn).await? - cpu_before;
            result.0.push(elapsed.as_secs_f64() * 1e6 / rounds as f64);
            result.1.push(cpu.as_secs_f64() * 1e6 / rounds as f64);
        }
    }
    for (name, (latency, cpu)) in variants.iter().zip(results) {
        println!(
            "| {name} | {:.1} µs | {:.1} µs |",
            median(latency),
            median(cpu)
        );
    }
    println!();
    Ok(())
}

/// Push and worker throughput with lifecycle events off and on (cap
/// 10,000), same run.
async fn events_cost() -> Result<(), BoxError> {
    let n = size(100_000, 2_000);
    let rounds = if full_run() { 3 } else { 1 };
    println!(
        "## lifecycle events off and on: push {n} messages, then a worker at concurrency 50 with a no-op handler (median of {rounds}), same run"
    );
    println!(
        "| events | push_many messages/s | worker messages/s | stream entries after |\n|---|---|---|---|"
    );
    let mut rows = Vec::new();
    for events in [false, true] {
        let (mut pushes, mut works, mut entries) = (Vec::new(), Vec::new(), 0);
        for _ in 0..rounds {
            let server = RedisServer::start()?;
            let mut conn = server.connection_manager().await?;
            let mut queue: Queue<String> = Queue::new(conn.clone(), "events")?;
            if events {
                queue = queue.record_events(10_000)?;
            }
            let msg = payload();
            let start = Instant::now();
            queue.push_many(std::iter::repeat_n(&msg, n)).await?;
            pushes.push(n as f64 / start.elapsed().as_secs_f64());
            works.push(drain(server.client(), &queue, n).await?);
            entries = redis::cmd("XLEN")
                .arg("lockgate:{events}:events")
                .query_async::<u64>(&mut conn)
                .await?;
        }
        let (push, work) = (median(pushes), median(works));
        println!(
            "| {} | {push:.0} | {work:.0} | {entries} |",
            if events { "on" } else { "off" }
        );
        rows.push((push, work));
    }
    println!(
        "events on / off: push {:.1} %, worker {:.1} %\n",
        100.0 * rows[1].0 / rows[0].0,
        100.0 * rows[1].1 / rows[0].1
    );
    Ok(())
}
