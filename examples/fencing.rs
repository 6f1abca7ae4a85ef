//! Fencing tokens keep a stalled lock holder from overwriting newer work.
//!
//! A lock with a TTL cannot stop a holder that pauses (a GC pause, a swapped
//! out process, a long network stall) past its TTL: when it wakes up it still
//! believes it holds the lock. Every lockgate lease carries a fencing token
//! that strictly increases per key; a storage that remembers the highest
//! fence it has seen and refuses lower ones turns the late write into a
//! harmless rejection.
//!
//! The story:
//!
//! 1. A takes the lock on `account-7` (200 ms TTL) and reads the balance.
//! 2. A stalls for longer than its TTL. (A takes the lock with the `Locker`
//!    directly: inside a `LockLayer` the watchdog would keep renewing it
//!    through an ordinary await. A real stop-the-world pause stops the
//!    watchdog too, which is what this simulates.)
//! 3. B's message arrives through a `LockLayer` (200 ms TTL, retry with
//!    backoff, `OnLost::Report`). B gets the lock once A's lease expired,
//!    reads its fence with `HeldLock::current()`, and writes: accepted.
//! 4. A wakes up and writes with its old fence: the store refuses it.
//!
//! ```text
//! cargo run --example fencing --features test-util
//! ```
//!
//! Redis is a throwaway `redis-server` started here, unless `REDIS_URL`
//! names one; there, every key goes under a prefix made for the run, which
//! the run deletes at the end (`lockgate::testing::ExampleRedis`): nothing
//! else on a server the example did not start is touched.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lockgate::{
    Acquisition, Backoff, BoxError, HeldLock, LockLayer, Locker, OnConflict, OnLost, Outcome,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::oneshot;
use tokio::time::sleep;
use tower::{ServiceBuilder, ServiceExt};

const KEY: &str = "account-7";

/// A toy storage that refuses writes fenced lower than the highest fence it
/// has accepted.
#[derive(Debug, Default)]
struct Store {
    state: Mutex<(u64, i64)>, // (highest fence seen, balance)
}

impl Store {
    fn read(&self) -> i64 {
        self.state.lock().unwrap().1
    }

    fn write(&self, fence: u64, balance: i64) -> Result<(), String> {
        let mut state = self.state.lock().unwrap();
        if fence < state.0 {
            return Err(format!(
                "refused: fence {fence} is older than fence {} already seen",
                state.0
            ));
        }
        *state = (fence, balance);
        Ok(())
    }
}

/// A deposit for an account.
#[derive(Debug, Clone)]
struct Deposit {
    account: String,
    amount: i64,
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("fencing failed: {e}");
        std::process::exit(1);
    }
}

/// A: takes the lock directly, stalls past its TTL (and, to keep the story
/// in order, until B has written), then tries its late write.
async fn stall_and_write_late(
    locker: Locker<ConnectionManager>,
    store: Arc<Store>,
    ttl: Duration,
    b_done: oneshot::Receiver<()>,
) -> Result<(), BoxError> {
    let lease = match locker.acquire(KEY).await? {
        Acquisition::Acquired(lease) => lease,
        Acquisition::Contended(busy) => return Err(BoxError::from(busy)),
    };
    // The fence is issued while A holds the lock (on first use).
    let fence = locker.fence(&lease).await?;
    let balance = store.read() + 100;
    println!("[A] holds `{KEY}` with fence {fence} (TTL {ttl:?}); computed balance {balance}");
    println!("[A] ... stalls (think: a long GC pause) ...");
    let (_, _) = tokio::join!(sleep(ttl + Duration::from_millis(100)), b_done);
    println!(
        "[A] wakes up; its lease expired {:?} ago, but A does not know",
        tokio::time::Instant::now().saturating_duration_since(lease.expires_at())
    );
    match store.write(fence, balance) {
        Ok(()) => println!("[A] late write accepted (this must not happen!)"),
        Err(refused) => println!("[A] late write {refused}"),
    }
    let released = match locker.release(&lease).await? {
        true => "released",
        false => "refused, the lock is not A's any more",
    };
    println!("[A] release: {released}");
    Ok(())
}

async fn run() -> Result<(), BoxError> {
    let ms = Duration::from_millis;
    let redis = lockgate::testing::ExampleRedis::from_env("fencing")?;
    println!("using {redis}");
    let address = redis.client().get_connection_info().addr().to_string();
    let config = ConnectionManagerConfig::new().set_number_of_retries(2);
    let conn = ConnectionManager::new_with_config(redis.client(), config)
        .await
        .map_err(|e| format!("could not connect to Redis at {address}: {e}"))?;
    let store = Arc::new(Store::default());
    let ttl = ms(200);

    // B's side: deposits go through a LockLayer.
    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(
                Locker::new(conn.clone()).prefix(redis.prefix())?.ttl(ttl)?,
                |d: &Deposit| d.account.clone(),
            )
            .on_conflict(OnConflict::retry(
                Backoff::exponential(ms(10), ms(50))?
                    .unlimited_attempts()
                    .max_elapsed(Duration::from_secs(5)),
            ))
            .on_lost(OnLost::Report),
        )
        .service_fn({
            let store = store.clone();
            move |deposit: Deposit| {
                let store = store.clone();
                async move {
                    let lock = HeldLock::current().ok_or("called outside a LockLayer")?;
                    let balance = store.read() + deposit.amount;
                    let fence = lock.fence().await?;
                    println!(
                        "[B] holds `{}` with fence {fence}; writes balance {balance}",
                        lock.key(),
                    );
                    store.write(fence, balance)?;
                    println!("[B] write accepted");
                    Ok::<_, BoxError>(balance)
                }
            }
        });

    // A: takes the lock directly and then stalls past its TTL.
    let locker = Locker::new(conn.clone()).prefix(redis.prefix())?.ttl(ttl)?;
    let (b_done_tx, b_done_rx) = oneshot::channel::<()>();
    let a = tokio::spawn(stall_and_write_late(locker, store.clone(), ttl, b_done_rx));

    // B's deposit arrives while A holds the lock.
    sleep(ms(20)).await;
    println!("[B] deposit of 50 arrives; `{KEY}` is held by A, retrying with backoff");
    let outcome = service
        .oneshot(Deposit {
            account: KEY.to_owned(),
            amount: 50,
        })
        .await?;
    let _ = b_done_tx.send(());
    match outcome {
        Outcome::Done(balance) => println!("[B] done: balance {balance}"),
        Outcome::Deferred { id, .. } => println!("[B] deferred as {id}"),
    }
    a.await??;
    println!("final balance in the store: {}", store.read());
    redis.clean_up().await?; // this run's keys, on a server of yours
    Ok(())
}
