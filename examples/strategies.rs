//! The three conflict strategies side by side on one hot key.
//!
//! A holder keeps the key `hot` for about 300 ms. Meanwhile three messages
//! for that key arrive, one through each of three `LockLayer`s:
//!
//! * `fail()` answers at once with `Contended`, saying when to retry;
//! * `retry(backoff)` sleeps with jittered backoff until the holder lets go,
//!   then runs the handler;
//! * `defer(queue, holder_ttl)` puts the message aside in a Redis delay
//!   queue, due when the holder's lock runs out, and frees the caller.
//!
//! Finally a `Worker` on the queue brings the deferred message back through
//! the `defer` layer once it is due.
//!
//! ```text
//! cargo run --example strategies --features test-util
//! REDIS_URL=redis://my-redis:6379/ cargo run --example strategies --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one; there, every key goes under a prefix made for the run, which
//! the run deletes at the end (`lockgate::testing::ExampleRedis`): nothing
//! else on a server the example did not start is touched.

use std::time::{Duration, SystemTime};

use lockgate::layer::DeferDelay;
use lockgate::{
    Acquisition, Backoff, BoxError, Contended, Job, LockLayer, Locker, OnConflict, Outcome, Queue,
    Worker,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};
use tower::{ServiceBuilder, ServiceExt};

const KEY: &str = "hot";
const QUEUE: &str = "strategies-example";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Message {
    key: String,
    text: String,
}

fn message(text: &str) -> Message {
    Message {
        key: KEY.to_owned(),
        text: text.to_owned(),
    }
}

fn key_of(m: &Message) -> String {
    m.key.clone()
}

/// The handler behind every layer.
async fn handle(m: Message) -> Result<String, BoxError> {
    Ok(format!("handled {:?}", m.text))
}

/// The holder: takes `hot` with a 400 ms TTL and lets go after 300 ms, in
/// a task of its own (awaited at the end).
async fn hold(
    conn: ConnectionManager,
    prefix: &str,
) -> Result<JoinHandle<lockgate::Result<bool>>, BoxError> {
    let holder = Locker::new(conn)
        .prefix(prefix)?
        .ttl(Duration::from_millis(400))?;
    let lease = match holder.acquire(KEY).await? {
        Acquisition::Acquired(lease) => lease,
        Acquisition::Contended(busy) => {
            return Err(format!("`{KEY}` is already held elsewhere: {busy}").into());
        }
    };
    println!(
        "[holder] took `{KEY}` (fence {}) for ~300 ms",
        holder.fence(&lease).await?
    );
    Ok(tokio::spawn(async move {
        sleep(Duration::from_millis(300)).await;
        let released = holder.release(&lease).await;
        println!("[holder] released `{KEY}`");
        released
    }))
}

/// What each strategy answered, and after how long.
type Answer = (Result<Outcome<String>, BoxError>, Duration);

/// Prints the three answers; fails on an error other than `fail()`'s.
fn report(failed: Answer, retried: Answer, deferred: Answer) -> Result<(), BoxError> {
    match failed {
        (Err(e), after) => match e.downcast_ref::<Contended>() {
            Some(busy) => println!(
                "[fail]  error after {after:?}: `{}` is busy, retry after {:?}",
                busy.key(),
                busy.retry_after()
            ),
            None => return Err(e),
        },
        (Ok(outcome), _) => println!("[fail]  unexpectedly got through: {outcome:?}"),
    }
    let (outcome, after) = retried;
    match outcome? {
        Outcome::Done(reply) => println!("[retry] done after {} ms: {reply}", after.as_millis()),
        other => println!("[retry] {other:?}"),
    }
    let (outcome, after) = deferred;
    match outcome? {
        Outcome::Deferred { id, due } => {
            let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
            println!(
                "[defer] deferred after {after:?}: id {id}, due in {} ms (when the holder's lock runs out)",
                wait.as_millis()
            );
        }
        Outcome::Done(reply) => println!("[defer] the key was free after all: {reply}"),
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("strategies failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let ms = Duration::from_millis;
    // Keep `redis` alive until the end: a throwaway server dies with it.
    let redis = lockgate::testing::ExampleRedis::from_env("strategies")?;
    println!("using {redis}");
    let client = redis.client();
    let address = client.get_connection_info().addr().to_string();
    let config = ConnectionManagerConfig::new().set_number_of_retries(2);
    let conn = ConnectionManager::new_with_config(client.clone(), config)
        .await
        .map_err(|e| format!("could not connect to Redis at {address}: {e}"))?;

    let queue: Queue<Message> = Queue::new(conn.clone(), QUEUE)?.prefix(redis.prefix())?;

    let releasing = hold(conn.clone(), redis.prefix()).await?;

    // Three layers over one locker, differing only in their strategy.
    let locker = Locker::new(conn.clone())
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(5))?;
    let fail = ServiceBuilder::new()
        .layer(LockLayer::new(locker.clone(), key_of).on_conflict(OnConflict::fail()))
        .service_fn(handle);
    let retry = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), key_of).on_conflict(OnConflict::retry(
                Backoff::exponential(ms(10), ms(100))?.max_attempts(30),
            )),
        )
        .service_fn(handle);
    let defer_layer = LockLayer::new(locker.clone(), key_of).on_conflict(OnConflict::defer(
        queue.clone(),
        DeferDelay::holder_ttl(ms(50)),
    ));
    let defer = ServiceBuilder::new()
        .layer(defer_layer.clone())
        .service_fn(handle);

    let started = Instant::now();
    let (failed, retried, deferred) = tokio::join!(
        async {
            let r = fail.oneshot(message("via fail")).await;
            (r, started.elapsed())
        },
        async {
            let r = retry.oneshot(message("via retry")).await;
            (r, started.elapsed())
        },
        async {
            let r = defer.clone().oneshot(message("via defer")).await;
            (r, started.elapsed())
        },
    );

    report(failed, retried, deferred)?;
    releasing.await??;

    // A worker on the queue brings deferred messages back through the same
    // `defer` layer, over the claimed `Job` (so that a key found busy again
    // reschedules the job in place), and the same handler (unwrapping the
    // `Job` below the layer); it stops after the first message it handles,
    // or after 5 s.
    let (handled_tx, mut handled_rx) = mpsc::unbounded_channel();
    let service = ServiceBuilder::new()
        .layer(defer_layer.key_fn(|job: &Job<Message>| job.key.clone()))
        .map_request(|job: Job<Message>| {
            println!("[worker] claimed {} ({:?})", job.id(), job.text);
            job.into_payload()
        })
        .service_fn(handle)
        .map_response(move |outcome| {
            if let Outcome::Done(reply) = &outcome {
                println!("[worker] {reply}");
                let _ = handled_tx.send(());
            }
            outcome
        });
    let handled = async {
        let _ = timeout(Duration::from_secs(5), handled_rx.recv()).await;
    };
    let worker = Worker::new(client, queue.clone(), service);
    let metrics = worker.metrics();
    worker.run_until(handled).await?;
    if metrics.snapshot().done != 1 {
        return Err("the worker did not bring the deferred message back".into());
    }
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}
