//! lockgate's metrics in Prometheus: a worker handles orders through a
//! per-account `LockLayer` while `metrics-exporter-prometheus` serves them
//! at `/metrics`.
//!
//! lockgate records through the `metrics` facade and ships no exporter: the
//! application installs the one it wants, before it starts its workers (see
//! `lockgate::telemetry` for every name).
//!
//! ```text
//! cargo run --example prometheus --features test-util
//! curl -s http://127.0.0.1:9464/metrics | grep lockgate_     # meanwhile
//! ```
//!
//! `METRICS_ADDR` sets the address to serve on (default `127.0.0.1:9464`),
//! `RUN_FOR_MS` how long the example runs (default 3000). Redis is a
//! throwaway `redis-server` started here, unless `REDIS_URL` names one. The
//! example only touches keys under `lockgate:{prometheus-orders}` and
//! `lockgate:lock:{account-*}`; on the server `REDIS_URL` names, under a
//! prefix made for the run instead of `lockgate`, which the run deletes at
//! the end (`lockgate::testing::ExampleRedis`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use lockgate::{Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Queue, Worker};
use metrics_exporter_prometheus::PrometheusBuilder;
use serde::{Deserialize, Serialize};
use tower::ServiceBuilder;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    id: u32,
    account: String,
}

fn account(job: &Job<Order>) -> String {
    job.account.clone()
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("prometheus failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), BoxError> {
    let addr: SocketAddr = std::env::var("METRICS_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:9464".into())
        .parse()?;
    let run_for = Duration::from_millis(match std::env::var("RUN_FOR_MS") {
        Ok(ms) => ms.parse()?,
        Err(_) => 3000,
    });
    // First: instruments are registered when workers and layers start.
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()?;
    println!("serving metrics at http://{addr}/metrics");

    let redis = lockgate::testing::ExampleRedis::from_env("prometheus")?;
    println!("using {redis}");
    let client = redis.client();
    let conn = client.get_connection_manager().await?;
    let queue: Queue<Order> =
        Queue::new(conn.clone(), "prometheus-orders")?.prefix(redis.prefix())?;

    let ms = Duration::from_millis;
    let locker = Locker::new(conn)
        .prefix(redis.prefix())?
        .ttl(Duration::from_secs(5))?;
    let layer = LockLayer::new(locker, account).on_conflict(
        OnConflict::retry(Backoff::exponential(ms(2), ms(10))?.max_elapsed(ms(30)))
            .then_defer(queue.clone(), ms(50)),
    );
    let service =
        ServiceBuilder::new()
            .layer(layer)
            .service_fn(move |order: Job<Order>| async move {
                // Some work, and now and then a failure the worker retries.
                tokio::time::sleep(ms(5 + u64::from(order.id % 10))).await;
                if order.id.is_multiple_of(17) && order.attempt() == 1 {
                    return Err::<(), BoxError>("the payment service timed out".into());
                }
                Ok(())
            });
    let worker = Worker::new(client, queue.clone(), service)
        .concurrency(8)?
        .retry_backoff(Backoff::exponential(ms(20), ms(100))?)
        .sample_every(Some(ms(250)))?;

    // Orders keep coming, on five accounts.
    let producer = {
        let queue = queue.clone();
        tokio::spawn(async move {
            for wave in 0u32.. {
                let orders: Vec<Order> = (0..20)
                    .map(|i| Order {
                        id: wave * 20 + i,
                        account: format!("account-{}", i % 5),
                    })
                    .collect();
                if queue.push_many(&orders).await.is_err() {
                    return;
                }
                tokio::time::sleep(ms(100)).await;
            }
        })
    };
    worker.run_until(tokio::time::sleep(run_for)).await?;
    producer.abort();

    // What a scrape sees now.
    let scraped = scrape(addr)?;
    println!("lockgate's metrics after {run_for:?}:");
    for line in scraped.lines() {
        let counter = line.starts_with("lockgate_") && !line.contains("_bucket");
        if counter && !line.contains("quantile") {
            println!("  {line}");
        }
    }
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}

/// `GET /metrics`, over a plain TCP connection.
fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}
