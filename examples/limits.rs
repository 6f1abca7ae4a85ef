//! Per-key limits beyond one holder: tenants on different plans run up to
//! their plan's number of jobs at a time, and each tenant's calls to an
//! upstream API are rate limited; what does not fit is deferred, not lost.
//!
//! Two layers around one handler, both keyed by tenant:
//! * a `RateLimitLayer`: at most 4 jobs per 500 ms per tenant; a job over
//!   the rate is deferred to exactly the next free slot, which is reserved
//!   for it (it runs then, however many jobs come meanwhile);
//! * a `LockLayer` with `Permits` from the key function: "pro" tenants run 3
//!   jobs at a time, "free" tenants 1; a job that finds its tenant's permits
//!   taken waits a little for a release (woken by it), then joins the
//!   tenant's line in the queue, from which the queue claims it with a
//!   permit as one frees, in line order.
//!
//! ```text
//! cargo run --example limits --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one; there, every key goes under a prefix made for the run
//! instead of `lockgate`, which the run deletes at the end
//! (`lockgate::testing::ExampleRedis`). The example touches the queue's keys (`lockgate:{limits-jobs}` and the
//! tenants' lines, `lockgate:{<t>}:limits-jobs:*`), the tenants' permits
//! (`lockgate:permits:{<tenant>}`), `lockgate:rate:{acme}` and
//! `lockgate:rate:{solo}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::layer::{DeferDelay, RateLimitLayer, RateSlot};
use lockgate::lock::rate::Rate;
use lockgate::{
    Backoff, BoxError, HeldLock, Job, LockLayer, Locker, OnConflict, Permits, Queue,
    ReleaseListener, Worker,
};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Report {
    id: u32,
    tenant: String,
    pro: bool,
}

/// The tenant's key for the rate limit.
fn tenant(job: &Job<Report>) -> String {
    job.tenant.clone()
}

/// The tenant's key with its plan's permits.
fn plan(job: &Job<Report>) -> Permits<String> {
    Permits::new(job.tenant.clone(), if job.pro { 3 } else { 1 })
}

/// What ran: per tenant, the most jobs at once, and every start.
#[derive(Default)]
struct Seen {
    running: HashMap<String, usize>,
    most: HashMap<String, usize>,
    done: usize,
}

type Log = Arc<Mutex<Seen>>;

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("limits failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let redis = lockgate::testing::ExampleRedis::from_env("limits")?;
    println!("using {redis}");
    let client = redis.client();
    let conn = client.get_connection_manager().await?;
    let listener = ReleaseListener::connect(client.clone()).await?;
    let queue: Queue<Report> = Queue::new(conn.clone(), "limits-jobs")?.prefix(redis.prefix())?;

    let ms = Duration::from_millis;
    let locker = Locker::new(conn)
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(5))?;
    let rate = RateLimitLayer::new(locker.clone(), tenant, Rate::new(4, ms(500))?).on_conflict(
        OnConflict::defer(queue.clone(), DeferDelay::until_allowed()),
    );
    let permits = LockLayer::new(locker, plan)
        .on_conflict(
            OnConflict::retry(Backoff::exponential(ms(5), ms(20))?.max_elapsed(ms(100)))
                .then_defer(queue.clone(), DeferDelay::until_released()),
        )
        .wake_on_release(listener);
    let log: Log = Default::default();
    let started = Instant::now();
    let service = ServiceBuilder::new()
        .layer(rate)
        .layer(permits)
        .service_fn({
            let log = log.clone();
            move |job: Job<Report>| handle(job, log.clone(), started)
        });

    // Twelve reports each for acme (pro: 3 at a time) and solo (free: 1).
    let jobs: Vec<Report> = (0..24)
        .map(|id| Report {
            id,
            tenant: if id % 2 == 0 { "acme" } else { "solo" }.into(),
            pro: id % 2 == 0,
        })
        .collect();
    queue.push_many(&jobs).await?;
    println!("pushed 24 reports: 12 for acme (pro plan), 12 for solo (free plan)\n");

    let worker = Worker::new(client, queue.clone(), service).concurrency(8)?;
    let metrics = worker.metrics();
    let done = {
        let log = log.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            while log.lock().map(|l| l.done).unwrap_or(0) < 24 && Instant::now() < deadline {
                tokio::time::sleep(ms(20)).await;
            }
        }
    };
    worker.run_until(done).await?;

    let m = metrics.snapshot();
    report(&log, &m)?;
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}

/// Prints the summary; fails unless every report ran.
fn report(log: &Log, m: &lockgate::worker::MetricsSnapshot) -> Result<(), BoxError> {
    let seen = log.lock().map_err(|_| "log poisoned")?;
    println!(
        "\nsummary: {} handled, {} deferrals (over the rate or out of permits), {} dead",
        m.done, m.deferred, m.dead
    );
    for (tenant, permits) in [("acme", 3), ("solo", 1)] {
        println!(
            "{tenant}: at most {} at a time (its plan allows {permits})",
            seen.most.get(tenant).copied().unwrap_or(0)
        );
    }
    if seen.done < 24 {
        return Err(format!("only {} of 24 reports ran", seen.done).into());
    }
    Ok(())
}

/// The business logic: a call to the upstream API, per tenant.
async fn handle(job: Job<Report>, log: Log, started: Instant) -> Result<(), BoxError> {
    let permit = HeldLock::current()
        .and_then(|held| held.permits())
        .unwrap_or(0);
    let slot = RateSlot::current().is_some();
    {
        let mut seen = log.lock().map_err(|_| "log poisoned")?;
        let running = seen.running.entry(job.tenant.clone()).or_default();
        *running += 1;
        let now = *running;
        let most = seen.most.entry(job.tenant.clone()).or_default();
        *most = (*most).max(now);
    }
    println!(
        "{:>5} ms  report {:>2} for {:<4}  (of {permit} permits, rate slot {}, deferred {} times)",
        started.elapsed().as_millis(),
        job.id,
        job.tenant,
        if slot { "held" } else { "none" },
        job.deferrals(),
    );
    tokio::time::sleep(Duration::from_millis(120)).await;
    let mut seen = log.lock().map_err(|_| "log poisoned")?;
    if let Some(running) = seen.running.get_mut(&job.tenant) {
        *running -= 1;
    }
    seen.done += 1;
    Ok(())
}
