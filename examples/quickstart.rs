//! lockgate in one file: a producer, a worker, and a per-account lock.
//!
//! Orders for the same account must never be handled at the same time. Six
//! orders are pushed to a Redis queue (one of them delayed by half a
//! second); a `Worker` with four handler slots takes them, and a `LockLayer`
//! holds a lock per account around the handler. When an account is busy, the
//! order waits briefly (woken by the release itself, not by polling), then
//! joins the account's line in the queue: the queue claims an account's
//! orders one at a time, in line order, each together with the account's
//! lock, and the layer uses that lock instead of contending again.
//!
//! ```text
//! cargo run --example quickstart --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one (a Redis that merely answers on `127.0.0.1:6379` is never
//! used). On a throwaway server the keys are the defaults: the queue's
//! (`lockgate:{quickstart-orders}` and the lines of its accounts,
//! `lockgate:{<t>}:quickstart-orders:*`) and the accounts' locks
//! (`lockgate:lock:{<account>}`). On the server `REDIS_URL` names, every
//! key goes under a prefix made for this run instead of `lockgate`, and the
//! run deletes them at the end: nothing else there is read, changed,
//! purged or flushed.
//!
//! When your code owns the queue, pushing each order with its account as
//! the key (`PushOptions::key`) does the same with no `LockLayer` at all:
//! `examples/keyed.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::layer::DeferDelay;
use lockgate::{Backoff, BoxError, HeldLock, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u32,
    account: String,
}

/// One line per handled order, for the summary.
type Log = Arc<Mutex<Vec<String>>>;

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("quickstart failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    // Never a server found running: see the module doc.
    let redis = lockgate::testing::ExampleRedis::from_env("quickstart")?;
    println!("using {redis}");
    let client = redis.client();
    let conn = client.get_connection_manager().await?;

    // A fresh server (or a fresh prefix) holds nothing: no purge needed,
    // and none is ever done on a server the example did not start.
    let queue: Queue<Order> =
        Queue::new(conn.clone(), "quickstart-orders")?.prefix(redis.prefix())?;

    // The lock: one per account, 2 s TTL (renewed while a handler runs long).
    // A locker made from the client wakes its waiters when the lock they
    // wait for is released, in whatever process (one subscriber per process,
    // opened on the first wait).
    let locker = Locker::connect(client.clone())
        .await?
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(2))?;
    let ms = Duration::from_millis;
    // Wait up to ~50 ms for the account, then join the account's line.
    let strategy = OnConflict::retry(Backoff::exponential(ms(5), ms(20))?.max_elapsed(ms(50)))
        .then_defer(queue.clone(), DeferDelay::until_released());

    let log: Log = Default::default();
    let started = Instant::now();
    let service = ServiceBuilder::new()
        .layer(LockLayer::new(locker, |job: &Job<Order>| job.account.clone()).on_conflict(strategy))
        .service_fn({
            let log = log.clone();
            move |job: Job<Order>| handle(job, log.clone(), started)
        });

    // The producer: three orders for alice, two for bob, one delayed for carol.
    let orders = [
        (1, "alice"),
        (2, "alice"),
        (3, "bob"),
        (4, "alice"),
        (5, "bob"),
    ];
    queue
        .push_many(orders.map(|(id, account)| Order {
            id,
            account: account.into(),
        }))
        .await?;
    let carol = Order {
        id: 6,
        account: "carol".into(),
    };
    queue.push_after(carol, Duration::from_millis(500)).await?;
    println!("pushed 6 orders (order 6 is due in 500 ms)\n");

    // The worker runs until every order was handled (or 20 s passed).
    let worker = Worker::new(client, queue.clone(), service).concurrency(4)?;
    let metrics = worker.metrics();
    let done = {
        let log = log.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(20);
            while log.lock().map(|l| l.len()).unwrap_or(0) < 6 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    worker.run_until(done).await?;

    let m = metrics.snapshot();
    println!(
        "\nsummary: {} handled, {} deferred into their account's line, {} retried, {} dead",
        m.done, m.deferred, m.retried, m.dead
    );
    let stats = queue.stats().await?;
    println!(
        "queue afterwards: {} due, {} later, {} active, {} dead",
        stats.due, stats.later, stats.active, stats.dead
    );
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}

/// The business logic: runs while its account's lock is held.
async fn handle(job: Job<Order>, log: Log, started: Instant) -> Result<(), BoxError> {
    let fence = match HeldLock::current() {
        Some(lock) => lock.fence().await?,
        None => 0,
    };
    let at = started.elapsed().as_millis();
    // Work that must not overlap with other work on the same account.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let line = format!(
        "{at:>5} ms  order {} for {:<5}  attempt {}, deferred {} times, fence {fence}",
        job.id,
        job.account,
        job.attempt(),
        job.deferrals(),
    );
    println!("{line}");
    if let Ok(mut log) = log.lock() {
        log.push(line);
    }
    Ok(())
}
