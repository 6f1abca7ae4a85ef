//! A lock for code outside a tower stack: [`Locker::lock`] waits for a key
//! and returns a [`LockGuard`] that holds it, renewed, until it is
//! released or dropped; [`Locker::with_lock`] runs a future holding one.
//!
//! The guard holds its lock the way a [`LockLayer`] call does, because it
//! *is* one: a task of its own calls a `LockLayer` (waiting in the key's
//! line under `retry`, woken by the holder's release) whose inner call
//! lasts until the guard ends it. So waiting, the renewal watchdog, the
//! lost-lock signal, fences and the release are the layer's, tested once.
//!
//! ```no_run
//! # async fn demo(locker: lockgate::Locker<redis::aio::ConnectionManager>) -> lockgate::Result<()> {
//! use std::time::Duration;
//!
//! let guard = locker.lock("account-42", Duration::from_secs(5)).await?;
//! let fence = guard.fence().await?; // hand it to the storage you write
//! // ... work on account 42 ...
//! assert!(guard.release().await?, "the lock was held throughout");
//! # let _ = fence;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::{Layer, ServiceExt};

use super::{HeldLock, LockLayer, LockLost, OnConflict};
use crate::BoxError;
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::lock::{Contended, Locker};
use crate::outcome::Outcome;

/// The request of a guard's holding call.
struct Hold;

/// What the holding call's inner service needs: where to send the held
/// lock, and what ends the hold. Taken by its one call.
type Ends = Arc<Mutex<Option<(oneshot::Sender<HeldLock>, oneshot::Receiver<()>)>>>;

/// The holding task's answer: the layer's.
type Held = std::result::Result<Outcome<()>, BoxError>;

/// A key's lock, held until [`release`](Self::release) or drop (see
/// [`Locker::lock`]).
///
/// While held, the lock is renewed every third of the locker's TTL (the
/// `LockLayer`'s watchdog); when a renewal finds it gone, or the lease runs
/// out unconfirmed, it counts as lost ([`lost`](Self::lost) completes).
/// Dropping the guard releases the lock in the background, on the task
/// that holds it. In a runtime that is shutting down that task is
/// cancelled with the rest, and the release goes out only if the runtime
/// still runs it; otherwise the lock expires after its TTL, as any lock of
/// a dead process does.
#[derive(Debug)]
pub struct LockGuard {
    /// The lock as the holding call sees it: key, fence, lost.
    held: HeldLock,
    /// Ends the holding call (sent, or dropped with the guard).
    end: Option<oneshot::Sender<()>>,
    /// The holding call: it releases the lock when its inner call ends.
    task: Option<JoinHandle<Held>>,
}

impl LockGuard {
    /// The user's key.
    pub fn key(&self) -> &str {
        self.held.key()
    }

    /// The fencing token (see [`HeldLock::fence`]).
    pub async fn fence(&self) -> Result<u64> {
        self.held.fence().await
    }

    /// Whether the lock counts as lost (see [`HeldLock::lost`]).
    pub fn is_lost(&self) -> bool {
        self.held.is_lost()
    }

    /// Completes when the lock counts as lost: select on it to stop work
    /// that must not go on without the lock.
    pub async fn lost(&self) {
        self.held.lost().await
    }

    /// The lock as a [`HeldLock`], for code that takes one.
    pub fn held_lock(&self) -> &HeldLock {
        &self.held
    }

    /// Releases the lock now; `Ok(true)` when it was held until then,
    /// `Ok(false)` when it had been lost (expired, or taken).
    pub async fn release(mut self) -> Result<bool> {
        drop(self.end.take());
        let Some(task) = self.task.take() else {
            return Ok(false);
        };
        match task.await {
            Ok(Ok(_)) => Ok(true),
            Ok(Err(error)) if error.is::<LockLost>() => Ok(false),
            Ok(Err(error)) => Err(into_error(error, self.held.key())),
            Err(_) => Ok(!self.held.is_lost()),
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        // The holding task goes on by itself: its inner call returns, and
        // the layer releases the lock.
        drop(self.end.take());
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Locker<C> {
    /// Waits for `key`'s lock, at most `wait`, and holds it until the
    /// returned guard is released or dropped: renewed while held, with
    /// its fence and its lost signal (see [`LockGuard`]). The wait is the
    /// `LockLayer`'s under `retry`: in the key's line, woken by the
    /// holder's release (a locker made with [`Locker::connect`] hears
    /// releases; one made with `new` polls with backoff).
    ///
    /// Errors with [`Error::Contended`] when the key stayed busy for the
    /// whole `wait` (zero tries once), and with the Redis error when the
    /// server could not be asked.
    pub async fn lock(&self, key: impl Into<String>, wait: Duration) -> Result<LockGuard> {
        let key = key.into();
        let layer = self.holding_layer(key.clone(), wait)?;
        let (held_tx, held_rx) = oneshot::channel();
        let (end_tx, end_rx) = oneshot::channel();
        let ends: Ends = Arc::new(Mutex::new(Some((held_tx, end_rx))));
        let service = layer.layer(tower::service_fn(move |_: Hold| hold(ends.clone())));
        let task = tokio::spawn(service.oneshot(Hold));
        match held_rx.await {
            Ok(held) => Ok(LockGuard {
                held,
                end: Some(end_tx),
                task: Some(task),
            }),
            // The call ended without the lock: busy for the whole wait, or
            // an error.
            Err(_) => match task.await {
                Ok(Err(error)) => Err(into_error(error, &key)),
                _ => Err(Error::reply(
                    format_args!("locking `{key}`"),
                    "the holding call ended without the lock",
                )),
            },
        }
    }

    /// Runs `work` holding `key`'s lock (waiting for it at most `wait`, as
    /// [`lock`](Self::lock) does), and releases it when `work` ends;
    /// [`HeldLock::current`] gives the lock inside. Errors with
    /// [`Error::LockLost`] when the lock was lost while `work` ran (its
    /// output is then dropped: it may have raced the next holder).
    pub async fn with_lock<F: Future>(
        &self,
        key: impl Into<String>,
        wait: Duration,
        work: F,
    ) -> Result<F::Output> {
        let guard = self.lock(key, wait).await?;
        let output = guard.held.clone().scope(work).await;
        let key = guard.key().to_owned();
        match guard.release().await? {
            true => Ok(output),
            false => Err(Error::LockLost { key }),
        }
    }

    /// The `LockLayer` a guard's holding call goes through: `key`'s lock,
    /// retried in the key's line for `wait`, then failing.
    fn holding_layer(
        &self,
        key: String,
        wait: Duration,
    ) -> Result<LockLayer<C, impl Fn(&Hold) -> String + use<C>, crate::layer::Fail>> {
        if key.is_empty() {
            return Err(Error::InvalidKey("a lock key must not be empty".into()));
        }
        let backoff = Backoff::exponential(Duration::from_millis(10), Duration::from_millis(500))?
            .unlimited_attempts()
            .max_elapsed(wait);
        let retry = OnConflict::retry(backoff).then_fail();
        Ok(LockLayer::new(self.clone(), move |_: &Hold| key.clone()).on_conflict(retry))
    }
}

/// The holding call's inner service: hands the lock to the guard, then
/// lasts until the guard ends it.
async fn hold(ends: Ends) -> std::result::Result<(), BoxError> {
    let taken = ends.lock().unwrap_or_else(|e| e.into_inner()).take();
    let (Some((held_tx, end_rx)), Some(held)) = (taken, HeldLock::current()) else {
        return Ok(());
    };
    if held_tx.send(held).is_ok() {
        let _ = end_rx.await;
    }
    Ok(())
}

/// The crate's error for what the holding call failed with.
fn into_error(error: BoxError, key: &str) -> Error {
    let error = match error.downcast::<Contended>() {
        Ok(busy) => return Error::Contended(*busy),
        Err(error) => error,
    };
    let error = match error.downcast::<Error>() {
        Ok(error) => return *error,
        Err(error) => error,
    };
    match error.downcast::<LockLost>() {
        Ok(_) => Error::LockLost {
            key: key.to_owned(),
        },
        Err(error) => Error::reply(format_args!("locking `{key}`"), error),
    }
}
