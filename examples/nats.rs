//! A real broker in front: NATS JetStream messages through a `LockLayer`.
//!
//! Orders arrive on the JetStream subjects `lockgate-example.orders.<account>`.
//! Orders of one account must never be handled at the same time, in
//! whatever process. Each message goes through a `LockLayer` keyed by the
//! subject's last token: when the account is busy, the order waits briefly
//! (woken by the release), then joins the account's line in a lockgate
//! queue. Only once the layer has answered (handled, or deferred in Redis) is the
//! JetStream message acknowledged, so a crash in between makes JetStream
//! redeliver it rather than lose it; and the message's stream sequence is
//! its id in the queue (`with_message_id`), so a redelivered copy of an
//! order that was deferred already is not pushed twice. A `Worker` on the
//! queue claims the waiting orders with the account's lock, through the
//! same handler, the instant their account frees.
//!
//! ```text
//! cargo run --example nats --features test-util
//! ```
//!
//! NATS comes from `NATS_URL` when set, else a throwaway `nats-server -js`
//! is started; Redis likewise from `REDIS_URL` or a throwaway
//! `redis-server` (a server that merely answers on a well-known port is
//! never used). `ORDERS=n` publishes n orders first (default 12), then
//! exits once this process has handled that many; `ORDERS=0` publishes
//! nothing and consumes until it is stopped: run several of those beside a
//! producer of your own. Every handled order prints
//! `handled <order> <account> <start µs> <end µs>` (unix time).
//!
//! The example uses the stream `LOCKGATE_EXAMPLE` (its durable consumer
//! `lockgate-example`) and the keys under `lockgate:{nats-orders}`, the
//! same in every process, so that several consumers share them. It never
//! purges them (a server it did not start may hold orders of another run,
//! which it then handles too).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind, stream};
use futures_util::StreamExt;
use lockgate::layer::{DeferDelay, with_message_id};
use lockgate::{
    Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Outcome, Queue, ReleaseListener, Worker,
};
use serde::{Deserialize, Serialize};
use tower::{Service, ServiceBuilder, ServiceExt};

const STREAM: &str = "LOCKGATE_EXAMPLE";
const SUBJECT: &str = "lockgate-example.orders";
const CONSUMER: &str = "lockgate-example";
const QUEUE: &str = "nats-orders";
/// How long JetStream waits for an acknowledgement before it redelivers.
const ACK_WAIT: Duration = Duration::from_secs(5);
/// Orders handled at once from the stream, per process.
const IN_FLIGHT: usize = 32;

/// What the producer publishes; the account is the subject's last token.
#[derive(Debug, Serialize, Deserialize)]
struct Payload {
    id: u64,
    amount: i64,
}

/// An order as the handler sees it, and as it waits in the queue.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u64,
    account: String,
    amount: i64,
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("nats example failed: {e}");
        std::process::exit(1);
    }
}

/// JetStream: a stream for the orders, and one durable consumer that every
/// process of this pipeline shares (each message goes to one of them).
async fn jetstream_consumer(
    nats_url: &str,
) -> Result<(jetstream::Context, PullConsumer), BoxError> {
    let js = jetstream::new(async_nats::connect(nats_url).await?);
    // A busy server may let a JetStream request time out (processes of the
    // pipeline starting together create the same stream and consumer): try
    // again a few times before giving up.
    let stream = retried(|| {
        js.get_or_create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec![format!("{SUBJECT}.*")],
            ..Default::default()
        })
    })
    .await?;
    let consumer: PullConsumer = retried(|| {
        stream.get_or_create_consumer(
            CONSUMER,
            pull::Config {
                durable_name: Some(CONSUMER.into()),
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                ..Default::default()
            },
        )
    })
    .await?;
    Ok((js, consumer))
}

async fn run() -> Result<(), BoxError> {
    let ms = Duration::from_millis;
    let orders: usize = match std::env::var("ORDERS") {
        Ok(n) => n.parse().map_err(|e| format!("ORDERS={n}: {e}"))?,
        Err(_) => 12,
    };
    let (nats_url, _nats) = lockgate::testing::nats_url_or_throwaway()?;
    let (client, _redis) = lockgate::testing::redis_url_or_throwaway()?;
    println!(
        "NATS at {nats_url}, Redis at {}",
        client.get_connection_info().addr()
    );

    let (js, consumer) = jetstream_consumer(&nats_url).await?;

    // lockgate: the queue orders wait in, a lock per account.
    let conn = client.get_connection_manager().await?;
    let queue: Queue<Order> = Queue::new(conn.clone(), QUEUE)?;
    let listener = ReleaseListener::connect(client.clone()).await?;
    let locker = Locker::new(conn).ttl(Duration::from_secs(5))?;
    // Wait up to ~10 ms for the account, then join the account's line.
    let strategy = OnConflict::retry(Backoff::exponential(ms(2), ms(5))?.max_elapsed(ms(10)))
        .then_defer(queue.clone(), DeferDelay::until_released());
    let lock = LockLayer::new(locker, |order: &Order| order.account.clone())
        .on_conflict(strategy)
        .wake_on_release(listener);

    // One lock and one handler for both entry points: the stream, and the
    // worker that runs the orders waiting in line.
    let handled = Arc::new(AtomicUsize::new(0));
    let handler = {
        let handled = handled.clone();
        move |order: Order| handle(order, handled.clone())
    };
    let pipeline = ServiceBuilder::new()
        .layer(lock.clone())
        .service_fn(handler.clone());
    // The worker's stack locks the claimed `Job` itself (the same layer,
    // re-keyed), so that an order it finds busy again is rescheduled in
    // place, and hands the handler the payload below it.
    let worker_service = ServiceBuilder::new()
        .layer(lock.key_fn(|job: &Job<Order>| job.account.clone()))
        .map_request(Job::into_payload)
        .service_fn(handler);

    if orders > 0 {
        publish(&js, orders).await?;
        println!("published {orders} orders for alice, bob and carol");
    }

    // A short lease: a worker that dies gives its orders back within 5 s.
    let worker =
        Worker::new(client, queue.clone(), worker_service).lease(Duration::from_secs(5))?;
    let metrics = worker.metrics();
    let all_handled = async {
        if orders == 0 {
            std::future::pending::<()>().await;
        }
        while handled.load(Ordering::Relaxed) < orders {
            tokio::time::sleep(ms(10)).await;
        }
    };
    tokio::select! {
        consumed = consume(consumer, pipeline) => consumed?,
        worked = worker.run_until(all_handled) => worked?,
    }
    let deferred = metrics.snapshot().done;
    println!(
        "handled {} orders: {} straight from the stream, {deferred} after waiting in a busy account's line",
        handled.load(Ordering::Relaxed),
        handled
            .load(Ordering::Relaxed)
            .saturating_sub(deferred as usize),
    );
    Ok(())
}

/// Publishes `n` orders over three accounts, and waits for JetStream to
/// have stored them.
async fn publish(js: &jetstream::Context, n: usize) -> Result<(), BoxError> {
    let accounts = ["alice", "bob", "carol"];
    let mut stored = Vec::with_capacity(n);
    for id in 0..n as u64 {
        let subject = format!("{SUBJECT}.{}", accounts[id as usize % accounts.len()]);
        let payload = serde_json::to_vec(&Payload {
            id,
            amount: 10 * id as i64,
        })?;
        stored.push(js.publish(subject, payload.into()).await?);
    }
    for ack in stored {
        ack.await?;
    }
    Ok(())
}

/// Runs `request` until it succeeds, at most 5 times, waiting 200 ms, then
/// twice as long, between tries.
async fn retried<T, E, F>(mut request: impl FnMut() -> F) -> Result<T, E>
where
    F: std::future::Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut wait = Duration::from_millis(200);
    for _ in 1..5 {
        match request().await {
            Ok(done) => return Ok(done),
            Err(e) => eprintln!("jetstream: {e}; trying again in {wait:?}"),
        }
        tokio::time::sleep(wait).await;
        wait *= 2;
    }
    request().await
}

/// Feeds JetStream messages through the pipeline, `IN_FLIGHT` at a time;
/// returns only when the subscription fails.
async fn consume<S>(consumer: PullConsumer, pipeline: S) -> Result<(), BoxError>
where
    S: Service<Order, Response = Outcome<()>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    let messages = consumer
        .stream()
        .max_messages_per_batch(IN_FLIGHT)
        .messages()
        .await?;
    messages
        .for_each_concurrent(IN_FLIGHT, |message| {
            let pipeline = pipeline.clone();
            async move {
                let delivered = match message {
                    Ok(message) => deliver(message, pipeline).await,
                    Err(e) => Err(e.into()),
                };
                if let Err(e) = delivered {
                    eprintln!("jetstream: {e}");
                }
            }
        })
        .await;
    Err("the JetStream subscription ended".into())
}

/// One JetStream message: through the lock, then acknowledged.
async fn deliver<S>(message: jetstream::Message, mut pipeline: S) -> Result<(), BoxError>
where
    S: Service<Order, Response = Outcome<()>, Error = BoxError>,
{
    let info = message.info()?;
    // The broker's identity of the message: a redelivery carries the same.
    let id = format!("{}:{}", info.stream, info.stream_sequence);
    let account = message
        .subject
        .as_str()
        .rsplit('.')
        .next()
        .unwrap_or_default();
    let order = match serde_json::from_slice::<Payload>(&message.payload) {
        Ok(Payload { id, amount }) => Order {
            id,
            account: account.to_owned(),
            amount,
        },
        Err(e) => {
            // Never handled, never redelivered: say so, and end it.
            eprintln!("message {id} is not an order ({e}); terminating it");
            return message.ack_with(AckKind::Term).await;
        }
    };
    let ready = pipeline.ready().await?;
    match with_message_id(&id, || ready.call(order)).await {
        // Handled, or deferred in Redis: only now may JetStream forget it.
        Ok(Outcome::Done(())) | Ok(Outcome::Deferred { .. }) => message.double_ack().await?,
        // The handler failed (or Redis did): JetStream redelivers it.
        Err(e) => {
            eprintln!("message {id} failed ({e}); redelivered in 1 s");
            message
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await?;
        }
    }
    Ok(())
}

/// The business logic: runs while its account's lock is held.
async fn handle(order: Order, handled: Arc<AtomicUsize>) -> Result<(), BoxError> {
    let start = micros();
    tokio::time::sleep(Duration::from_millis(20)).await; // work that must not overlap per account
    let end = micros();
    println!(
        "handled {} {} {start} {end} (amount {})",
        order.id, order.account, order.amount
    );
    handled.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

fn micros() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros()
}
