//! Two tasks contend for the lock on one key.
//!
//! The first takes the lock and works for a moment; the second is told the
//! key is busy and for how long, waits until the lock is released (or its TTL
//! runs out), then takes it with a higher fencing token.
//!
//! ```text
//! cargo run --example quickstart --features test-util
//! REDIS_URL=redis://my-redis:6379/ cargo run --example quickstart --features test-util
//! ```
//!
//! Redis comes from `REDIS_URL` when set, else from `127.0.0.1:6379` when a
//! server answers there, else a throwaway `redis-server` is started.

use std::sync::Arc;
use std::time::Duration;

use lockgate::{Acquisition, Lease, Locker};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::{Notify, oneshot};
use tokio::time::sleep;

const KEY: &str = "account-42";

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("quickstart failed: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // Keep `server` alive until the end: a throwaway server dies with it.
    let (client, server) = lockgate::testing::local_or_throwaway()?;
    let address = client.get_connection_info().addr().to_string();
    match (&server, std::env::var("REDIS_URL")) {
        (Some(_), _) => println!("using a throwaway redis-server at {address}"),
        (None, Ok(_)) => println!("using REDIS_URL: {address}"),
        (None, Err(_)) => println!("using the local Redis at {address}"),
    }

    // A ConnectionManager reconnects by itself. Two retries keep this
    // example from waiting long when Redis is unreachable.
    let config = ConnectionManagerConfig::new().set_number_of_retries(2);
    let conn = ConnectionManager::new_with_config(client, config)
        .await
        .map_err(|e| format!("could not connect to Redis at {address}: {e}"))?;
    let locker = Locker::new(conn).ttl(Duration::from_secs(2))?;

    let released = Arc::new(Notify::new());
    let (holding_tx, holding_rx) = oneshot::channel();

    let first = tokio::spawn({
        let (locker, released) = (locker.clone(), released.clone());
        async move {
            let lease = acquire(&locker, "first", &released).await?;
            let _ = holding_tx.send(());
            println!("[first] working for 500 ms ...");
            sleep(Duration::from_millis(500)).await;
            let still_mine = locker.release(&lease).await?;
            println!("[first] released the lock (still ours: {still_mine})");
            released.notify_one();
            Ok::<u64, lockgate::Error>(lease.fence())
        }
    });

    let second = tokio::spawn({
        let (locker, released) = (locker.clone(), released.clone());
        async move {
            // Start only once the first task holds the lock.
            let _ = holding_rx.await;
            let lease = acquire(&locker, "second", &released).await?;
            locker.release(&lease).await?;
            println!("[second] released the lock");
            Ok::<u64, lockgate::Error>(lease.fence())
        }
    });

    let first_fence = first.await??;
    let second_fence = second.await??;
    println!("fences: first {first_fence} < second {second_fence}");
    Ok(())
}

/// Takes the lock on [`KEY`], waiting while someone else holds it: until the
/// holder's TTL would run out (`retry_after`) or until it says it released.
async fn acquire(
    locker: &Locker<ConnectionManager>,
    who: &str,
    released: &Notify,
) -> lockgate::Result<Lease> {
    loop {
        match locker.acquire(KEY).await? {
            Acquisition::Acquired(lease) => {
                println!("[{who}] acquired `{KEY}`, fence {}", lease.fence());
                return Ok(lease);
            }
            Acquisition::Contended(busy) => {
                println!(
                    "[{who}] `{}` is held by someone else; retry after {:?}",
                    busy.key(),
                    busy.retry_after()
                );
                // `retry_after` is zero when unknown: never spin on it.
                let wait = busy.retry_after().max(Duration::from_millis(50));
                tokio::select! {
                    () = sleep(wait) => {
                        println!("[{who}] waited out the holder's TTL, retrying");
                    }
                    () = released.notified() => {
                        println!("[{who}] the holder released, retrying");
                    }
                }
            }
        }
    }
}
