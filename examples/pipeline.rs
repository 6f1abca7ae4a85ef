//! Plugging lockgate into your own pipeline.
//!
//! Messages arrive from a `Stream` (a stand-in for a Kafka or NATS consumer,
//! or an HTTP handler) and are driven through a `LockLayer`-wrapped service
//! with `tower::ServiceExt::call_all`, locked per device. Another holder (a
//! second process, say) keeps the hot device `sensor-a` busy for 400 ms, so
//! its messages retry briefly and are then deferred into a Redis delay queue:
//! the stream answers `Outcome::Deferred` for them and moves on at once. A
//! `Worker` on that queue brings them back through the same lock and handler
//! once they are due.
//!
//! ```text
//! cargo run --example pipeline --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one. The example only touches keys under
//! `lockgate:{pipeline-deferred}` and `lockgate:lock:`; on the server
//! `REDIS_URL` names, under a prefix made for the run instead of
//! `lockgate`, which the run deletes at the end
//! (`lockgate::testing::ExampleRedis`).

use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::{StreamExt, stream};
use lockgate::worker::MetricsSnapshot;
use lockgate::{
    Acquisition, Backoff, BoxError, HeldLock, Job, LockLayer, Locker, OnConflict, Outcome, Queue,
    Worker,
};
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep};
use tower::{Service, ServiceBuilder, ServiceExt};

const HOT: &str = "sensor-a";

/// A message from the outside world; readings of one device must be handled
/// one at a time.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    seq: u32,
    device: String,
    reading: i64,
}

/// The sequence numbers of handled messages, for the summary.
type Handled = Arc<Mutex<Vec<u32>>>;

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("pipeline failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let ms = Duration::from_millis;
    let redis = lockgate::testing::ExampleRedis::from_env("pipeline")?;
    println!("using {redis}");
    let client = redis.client();
    let conn = client.get_connection_manager().await?;
    let queue: Queue<Msg> =
        Queue::new(conn.clone(), "pipeline-deferred")?.prefix(redis.prefix())?;
    let started = Instant::now();
    let at = move || started.elapsed().as_millis();

    // Someone else holds the hot device for 400 ms.
    let releasing = hold(conn.clone(), redis.prefix(), started).await?;

    // One lock configuration for both entry points: retry ~30 ms, then defer
    // for 400 ms into the queue the worker consumes.
    let strategy = OnConflict::retry(Backoff::exponential(ms(10), ms(20))?.max_attempts(3))
        .then_defer(queue.clone(), ms(400));
    let locker = Locker::new(conn)
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(2))?;
    let lock = LockLayer::new(locker, |m: &Msg| m.device.clone()).on_conflict(strategy);
    let handled: Handled = Default::default();
    let handler = {
        let handled = handled.clone();
        move |m: Msg| handle(m, handled.clone(), started)
    };

    // One LockLayer serves both: over `Msg` for the stream, and re-keyed
    // over the claimed `Job<Msg>` for the worker (sharing this process's
    // per-key queue), the job unwrapped with `map_request` below it. A
    // message the worker finds busy again is the `Job` itself, rescheduled
    // in place: same id, its deferrals counted, so `max_deferrals` applies.
    let pipeline = ServiceBuilder::new()
        .layer(lock.clone())
        .service_fn(handler.clone());
    let worker_service = ServiceBuilder::new()
        .layer(lock.key_fn(|job: &Job<Msg>| job.device.clone()))
        .map_request(move |job: Job<Msg>| {
            let (seq, id) = (job.seq, job.id());
            println!("{:>4} ms  [worker]  brings back msg {seq} ({id})", at());
            job.into_payload()
        })
        .service_fn(handler);

    // The source: eight readings, one every 30 ms, half of them for the hot
    // device.
    let devices = [
        HOT, "sensor-b", HOT, "sensor-c", HOT, "sensor-b", HOT, "sensor-c",
    ];
    let msgs: Vec<Msg> = (1..)
        .zip(devices)
        .map(|(seq, device)| Msg {
            seq,
            device: device.into(),
            reading: 10 * i64::from(seq),
        })
        .collect();
    let total = msgs.len();
    let consume = consume(pipeline, &msgs, started);

    // The worker runs until every message was handled (or 10 s passed).
    let worker = Worker::new(client, queue.clone(), worker_service).concurrency(4)?;
    let metrics = worker.metrics();
    let all_handled = {
        let handled = handled.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(10);
            while handled.lock().map_or(0, |h| h.len()) < total && Instant::now() < deadline {
                sleep(ms(10)).await;
            }
        }
    };
    let (deferred, worked) = tokio::join!(consume, worker.run_until(all_handled));
    worked?;
    releasing.await??;

    let handled = handled.lock().map(|h| h.clone()).unwrap_or_default();
    report(&msgs, &deferred, &handled, metrics.snapshot())?;
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}

/// The consumer loop: the messages arrive one every 30 ms, and `call_all`
/// runs the calls concurrently and answers in arrival order, so each answer
/// pairs with its message. Returns the deferred ones.
async fn consume<S>(pipeline: S, msgs: &[Msg], started: Instant) -> Vec<u32>
where
    S: Service<Msg, Response = Outcome<i64>>,
    S::Error: std::fmt::Display,
{
    let at = || started.elapsed().as_millis();
    let arrivals = stream::iter(msgs.to_vec()).then(|m| async move {
        sleep(Duration::from_millis(30)).await;
        m
    });
    let mut deferred = Vec::new();
    let mut answers = pin!(pipeline.call_all(arrivals));
    for m in msgs {
        let Some(answer) = answers.next().await else {
            break;
        };
        match answer {
            Ok(Outcome::Done(_)) => {}
            Ok(Outcome::Deferred { id, due }) => {
                let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
                println!(
                    "{:>4} ms  [stream]  msg {} ({}) deferred as {id}, due in {} ms",
                    at(),
                    m.seq,
                    m.device,
                    wait.as_millis()
                );
                deferred.push(m.seq);
            }
            Err(e) => println!("{:>4} ms  [stream]  msg {} failed: {e}", at(), m.seq),
        }
    }
    deferred
}

/// Takes the hot device's lock for 400 ms, as another process would, and
/// lets go in a task of its own (awaited at the end).
async fn hold(
    conn: ConnectionManager,
    prefix: &str,
    started: Instant,
) -> Result<JoinHandle<lockgate::Result<bool>>, BoxError> {
    let at = move || started.elapsed().as_millis();
    let holder = Locker::new(conn)
        .prefix(prefix)?
        .ttl(Duration::from_secs(2))?;
    let lease = match holder.acquire(HOT).await? {
        Acquisition::Acquired(lease) => lease,
        Acquisition::Contended(busy) => {
            return Err(format!("`{HOT}` is held elsewhere: {busy}").into());
        }
    };
    println!("{:>4} ms  [holder]  takes `{HOT}` for 400 ms", at());
    Ok(tokio::spawn(async move {
        sleep(Duration::from_millis(400)).await;
        println!("{:>4} ms  [holder]  releases `{HOT}`", at());
        holder.release(&lease).await
    }))
}

/// Says what happened to each message; fails unless every one was handled.
fn report(
    msgs: &[Msg],
    deferred: &[u32],
    handled: &[u32],
    w: MetricsSnapshot,
) -> Result<(), BoxError> {
    println!("\nwhat happened to each message:");
    for m in msgs {
        let fate = match (deferred.contains(&m.seq), handled.contains(&m.seq)) {
            (false, true) => "handled straight from the stream",
            (true, true) => "deferred, then handled by the worker",
            (_, false) => "NOT handled",
        };
        println!("  msg {} ({}): {fate}", m.seq, m.device);
    }
    println!(
        "worker: {} handled, {} deferred again, {} retried, {} dead",
        w.done, w.deferred, w.retried, w.dead
    );
    if handled.len() < msgs.len() {
        let n = handled.len();
        return Err(format!("only {n} of {} messages were handled", msgs.len()).into());
    }
    Ok(())
}

/// The business logic, the same from the stream and from the worker: runs
/// while its device's lock is held.
async fn handle(m: Msg, handled: Handled, started: Instant) -> Result<i64, BoxError> {
    let fence = match HeldLock::current() {
        Some(lock) => lock.fence().await?,
        None => 0,
    };
    sleep(Duration::from_millis(50)).await; // work that must not overlap per device
    println!(
        "{:>4} ms  [handler] msg {} ({}) reading {}, fence {fence}",
        started.elapsed().as_millis(),
        m.seq,
        m.device,
        m.reading
    );
    if let Ok(mut handled) = handled.lock() {
        handled.push(m.seq);
    }
    Ok(m.reading)
}
