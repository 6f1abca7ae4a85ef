//! The recommended path when you own the queue: push each message with its
//! key, and a plain handler runs under the key's lock. No `LockLayer`, no
//! strategy, nothing parked or retried.
//!
//! Orders for one account must never be handled at the same time, and must
//! run in the order they were pushed. Each order is pushed with its account
//! as its key (`PushOptions::key`): the queue claims an account's orders one
//! at a time, in push order, each together with the account's lock, so the
//! handler (a plain `service_fn`) holds that lock and reads its fence with
//! `HeldLock::current()`. Meanwhile other code, an admin task standing in
//! for an HTTP handler, locks `alice` with `Locker::lock` (the same lock, the
//! same fences): it waits for alice's running order, and alice's next order
//! waits for it, unclaimed, until its guard is released.
//!
//! ```text
//! cargo run --example keyed --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one; there, every key goes under a prefix made for the run, which
//! the run deletes at the end (`lockgate::testing::ExampleRedis`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::{BoxError, HeldLock, Job, Locker, PushOptions, Queue, Worker};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tokio::time::{Instant, sleep};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u32,
    account: String,
}

/// A stand-in for storage that refuses writes with a fence lower than the
/// highest it has seen for the account (see `examples/fencing.rs`), and
/// records who worked on which account when.
#[derive(Debug, Default)]
struct Ledger {
    /// The highest fence written per account.
    fences: HashMap<String, u64>,
    /// (account, what, start ms, end ms), in the order the work ended.
    work: Vec<(String, String, u128, u128)>,
    /// Writes refused for a stale fence (none, when locks hold).
    refused: usize,
}

type Shared = Arc<Mutex<Ledger>>;

/// Records one piece of work on `account` done holding `fence`; refuses it
/// when a later holder has written already.
fn record(ledger: &Shared, account: &str, what: String, fence: u64, start: u128, end: u128) {
    let Ok(mut guard) = ledger.lock() else { return };
    let ledger = &mut *guard;
    let last = ledger.fences.entry(account.to_owned()).or_default();
    let written = fence > *last;
    *last = (*last).max(fence);
    ledger.refused += usize::from(!written);
    let verdict = if written {
        "written"
    } else {
        "REFUSED (stale fence)"
    };
    println!("{start:>5}–{end:<5} ms  {account:<5}  {what:<12}  fence {fence}  {verdict}");
    ledger.work.push((account.to_owned(), what, start, end));
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("keyed failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let redis = lockgate::testing::ExampleRedis::from_env("keyed")?;
    println!("using {redis}");
    let client = redis.client();
    let conn = client.get_connection_manager().await?;
    let queue: Queue<Order> = Queue::new(conn, "keyed-orders")?.prefix(redis.prefix())?;
    let locker = Locker::connect(client.clone())
        .await?
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(2))?;

    // The producer: each order pushed with its account as its key.
    let accounts = ["alice", "bob", "alice", "carol", "alice", "bob", "alice"];
    for (id, account) in (1..).zip(accounts) {
        let order = Order {
            id,
            account: account.into(),
        };
        queue
            .push_with(&order, PushOptions::new().key(account))
            .await?;
    }
    println!(
        "pushed {} orders, each with its account as its key\n",
        accounts.len()
    );

    let ledger = Shared::default();
    let started = Instant::now();
    // The handler: a plain function, no LockLayer; it holds the account's lock.
    let handler = tower::service_fn({
        let ledger = ledger.clone();
        move |job: Job<Order>| handle(job, ledger.clone(), started)
    });
    let worker = Worker::new(client, queue.clone(), handler).concurrency(4)?;
    let metrics = worker.metrics();

    // Other code locking one of the keys, while the worker runs.
    let admin = tokio::spawn(audit(locker, ledger.clone(), started));
    let done = async {
        let deadline = Instant::now() + Duration::from_secs(20);
        while metrics.snapshot().done < accounts.len() as u64 && Instant::now() < deadline {
            sleep(Duration::from_millis(10)).await;
        }
    };
    worker.run_until(done).await?;
    admin.await??;

    check(&ledger, accounts.len())?;
    println!("\nevery account ran one piece of work at a time, its orders in push order");
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}

/// The business logic: runs while the order's account is locked.
async fn handle(job: Job<Order>, ledger: Shared, started: Instant) -> Result<(), BoxError> {
    let lock = HeldLock::current().ok_or("a keyed job runs holding its key's lock")?;
    let fence = lock.fence().await?;
    let start = started.elapsed().as_millis();
    sleep(Duration::from_millis(60)).await; // work on the account
    let what = format!("order {}", job.id);
    record(
        &ledger,
        &job.account,
        what,
        fence,
        start,
        started.elapsed().as_millis(),
    );
    Ok(())
}

/// An admin task outside the worker: locks `alice` (waiting in her line,
/// woken by the release), works 150 ms holding the lock, releases it.
async fn audit(
    locker: Locker<ConnectionManager>,
    ledger: Shared,
    started: Instant,
) -> Result<(), BoxError> {
    sleep(Duration::from_millis(30)).await; // alice's first order is running
    let guard = locker.lock("alice", Duration::from_secs(5)).await?;
    let fence = guard.fence().await?;
    let start = started.elapsed().as_millis();
    sleep(Duration::from_millis(150)).await;
    let end = started.elapsed().as_millis();
    let held = guard.release().await?;
    if !held {
        return Err("the admin lost alice's lock while working".into());
    }
    record(&ledger, "alice", "admin audit".into(), fence, start, end);
    Ok(())
}

/// Fails unless every piece of work ran, no two on one account overlapped,
/// and each account's orders ran in push order.
fn check(ledger: &Shared, orders: usize) -> Result<(), BoxError> {
    let ledger = ledger.lock().map_err(|_| "ledger poisoned")?;
    if ledger.refused > 0 {
        return Err(format!("{} writes refused for a stale fence", ledger.refused).into());
    }
    if ledger.work.len() != orders + 1 {
        return Err(format!("{} of {} pieces of work ran", ledger.work.len(), orders + 1).into());
    }
    let mut by_account: HashMap<&str, Vec<_>> = HashMap::new();
    for (account, what, start, end) in &ledger.work {
        by_account
            .entry(account)
            .or_default()
            .push((*start, *end, what));
    }
    for (account, mut work) in by_account {
        work.sort();
        if let Some(w) = work.windows(2).find(|w| w[1].0 < w[0].1) {
            return Err(format!("{account}: {} overlapped {}", w[0].2, w[1].2).into());
        }
        let ids: Vec<u32> = work
            .iter()
            .filter_map(|(_, _, what)| what.strip_prefix("order ")?.parse().ok())
            .collect();
        if !ids.is_sorted() {
            return Err(format!("{account}: orders ran as {ids:?}").into());
        }
    }
    Ok(())
}
