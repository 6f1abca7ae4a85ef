//! The [`Lock`] service and the life of one locked call.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tower::Service;

use super::contend::{Contention, Next};
use super::context::HeldLock;
use super::error::LockLost;
use super::future::ResponseFuture;
use super::strategy::GiveUp;
use super::{LockKey, LockLayer, OnLost, message_id};
use crate::BoxError;
use crate::lock::{Lease, Locker, Released, Ticket};
use crate::outcome::Outcome;
use crate::telemetry::LockInstruments;
use futures_util::future::BoxFuture;

/// Runs the inner service while holding a per-key lock. Made by
/// [`LockLayer`](super::LockLayer).
pub struct Lock<S, C, F, D> {
    inner: S,
    /// The layer that made it (locker, key function, strategy), shared by
    /// all clones.
    config: Arc<LockLayer<C, F, D>>,
}

impl<S: Clone, C, F, D> Clone for Lock<S, C, F, D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, C, F, D: std::fmt::Debug> std::fmt::Debug for Lock<S, C, F, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lock")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish()
    }
}

impl<S, C, F, D> Lock<S, C, F, D> {
    pub(crate) fn new(inner: S, config: Arc<LockLayer<C, F, D>>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, C, F, D, Req, K> Service<Req> for Lock<S, C, F, D>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: Send + 'static,
    F: Fn(&Req) -> K + Send + Sync + 'static,
    K: LockKey,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    D: GiveUp<Req>,
{
    type Response = Outcome<S::Response>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The ready service goes into the future; a clone stays for the next
        // poll_ready (tower's filter idiom).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let key = (self.config.key_fn)(&req).into_lock_key_and_permits();
        let config = self.config.clone();
        // The id a consumer gave the message (`with_message_id`) belongs to
        // the first layer its request passes, taken here in `call`: calls a
        // handler makes from its future must not push under it. A layer
        // that does not defer hands it on to the layers it wraps, and only
        // to them.
        let id = message_id::take();
        ResponseFuture::new(Box::pin(async move {
            match key {
                None => call_ready(inner, req, id).await,
                Some((key, permits)) => {
                    let permits = permits.or(config.permits);
                    locked_call(config, inner, key, permits, req, id).await
                }
            }
        }))
    }
}

/// Calls an already ready service for a message that needs no lock,
/// handing the message's `id` on to the layers it wraps.
pub(super) async fn call_ready<S, Req>(
    mut inner: S,
    req: Req,
    id: Option<String>,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    let call = message_id::provide(id, || inner.call(req));
    call.await.map(Outcome::Done).map_err(Into::into)
}

/// Acquire (waiting as configured), call while holding, release.
async fn locked_call<S, C, F, D, Req>(
    config: Arc<LockLayer<C, F, D>>,
    inner: S,
    key: String,
    permits: Option<u32>,
    req: Req,
    id: Option<String>,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req> + Send + 'static,
    S::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    D: GiveUp<Req>,
{
    let locker = &config.locker;
    if let Some(held) = claimed_with_lock(locker, &key, permits) {
        return call_holding(&config, inner, held, req, id).await;
    }
    let instruments = config.instruments.get_or_init(LockInstruments::register);
    let ticket = match permits {
        Some(permits) => locker.permit_ticket(key, permits)?,
        None => locker.ticket(key)?,
    };
    let retry = (config.on_conflict.retry, &config.wake);
    let mut contention = Contention::new(locker, retry, ticket);
    // Held to the end of the call: the next local caller waits for it.
    let _turn = match contention.local_turn(&config.local).await? {
        Ok(turn) => turn,
        Err(busy) => return give_up(&config, instruments, req, id, busy).await,
    };
    let lease = loop {
        let busy = match contention.try_once().await? {
            Ok(lease) => break lease,
            Err(busy) => busy,
        };
        match Box::pin(contention.wait(&busy)).await {
            Next::Try => {}
            Next::Handed(lease) => break lease,
            Next::GiveUp => {
                let retry_after = busy.retry_after();
                tracing::debug!(key = %busy.key(), ?retry_after, "lock busy; giving up");
                contention.leave();
                return give_up(&config, instruments, req, id, busy).await;
            }
        }
    };
    let guard = contention.acquired(instruments);
    tracing::debug!(key = %lease.ticket().key(), "lock acquired");
    let held = HeldLock::new(lease.ticket().clone(), fence_issuer(&config));
    // The message's id, if this layer took it and did not need it, goes on
    // to the layers inside: one of them may defer the message.
    let call = held.clone().scope(call_ready(inner, req, id));
    hold(&config, call, lease, held, guard, &instruments.lost).await
}

/// The strategy's last step for a call whose key stayed busy: fail, or
/// defer (answered `Outcome::Deferred`).
async fn give_up<C, F, D, Req, R>(
    config: &LockLayer<C, F, D>,
    instruments: &LockInstruments,
    req: Req,
    id: Option<String>,
    busy: crate::Contended,
) -> Result<Outcome<R>, BoxError>
where
    D: GiveUp<Req>,
{
    let give_up = message_id::provide(id, || config.on_conflict.then.give_up(req, busy));
    let (id, due) = instruments.gave_up(Box::pin(give_up).await)?;
    Ok(Outcome::Deferred { id, due })
}

/// Issues the fences of [`HeldLock::fence`].
fn fence_issuer<C, F, D>(config: &LockLayer<C, F, D>) -> super::context::IssueFence
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let locker = || super::context::fence_issuer(config.locker.clone());
    config.issue_fence.get_or_init(locker).clone()
}

/// The worker's hold of the lock on `key` (one of its `permits`), when this
/// call runs in the handler of a keyed message claimed with that very lock
/// (see [`HeldLock::claim_hold`]).
fn claimed_with_lock<C>(locker: &Locker<C>, key: &str, permits: Option<u32>) -> Option<HeldLock>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let held = HeldLock::claim_hold()?;
    let same = held.key() == key && held.permits() == permits;
    (same && held.lock_key() == locker.held_key(key, permits)).then_some(held)
}

/// Calls the inner service under the lock a worker claimed a keyed message
/// with: the lock is held already, renewed with the message's lease and let
/// go by its settlement. The worker's [`HeldLock`] for it is the one the
/// handler sees, marked lost when a renewal finds the claim gone; `OnLost`
/// applies to it as to the layer's own locks.
async fn call_holding<S, C, F, D, Req>(
    config: &LockLayer<C, F, D>,
    inner: S,
    held: HeldLock,
    req: Req,
    id: Option<String>,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req> + Send + 'static,
    S::Error: Into<BoxError>,
{
    let call = held.clone().scope(call_ready(inner, req, id));
    let result = match config.on_lost {
        OnLost::Cancel => tokio::select! {
            biased;
            result = call => Some(result),
            () = held.lost() => None,
        },
        OnLost::Report => Some(call.await),
    };
    match result {
        Some(result) if !held.is_lost() => result,
        completed => Err(lock_lost(&held, completed.is_some())),
    }
}

/// Runs the call while renewing the lease; releases it afterwards, or
/// (through the guard) when the future is dropped or the handler panics.
///
/// The watchdog keeps the lease's conservative expiry: the time the last
/// confirmed acquire or renewal was *sent*, plus the TTL. It renews when a
/// third of the TTL has passed since then, and when that expiry passes
/// without a confirmed renewal the lock counts as lost, even while a
/// renewal is still in flight (a hung connection, a partition): another
/// process may hold the key by then. Renewal runs beside the call, as its
/// own branch: a slow renewal never holds back a handler that has finished.
async fn hold<C, F, D, R>(
    config: &LockLayer<C, F, D>,
    call: impl Future<Output = Result<Outcome<R>, BoxError>>,
    lease: Lease,
    held: HeldLock,
    mut guard: ReleaseGuard<'_, C>,
    lost: &metrics::Counter,
) -> Result<Outcome<R>, BoxError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let (locker, on_lost) = (&config.locker, config.on_lost);
    tokio::pin!(call);
    // A lease whose renewal is due already (one handed over by a release,
    // which lasts the hand-off time: see `Locker::handed`) is renewed to a
    // whole TTL at once, on a task of its own, so that the renewal goes out
    // even while the handler holds this thread.
    let ttl = locker.lease_ttl();
    let early = (lease.expires_at() <= Instant::now() + (ttl - ttl / 3)).then(|| {
        let renewal = tokio::spawn(renew(locker, lease.ticket(), ttl));
        Box::pin(async move {
            renewal.await.unwrap_or_else(|_| {
                let failed = redis::RedisError::from((redis::ErrorKind::Io, "renewal task failed"));
                (
                    Err(crate::Error::redis("renewing a handed lock")(failed)),
                    Instant::now(),
                )
            })
        }) as BoxFuture<'static, (crate::Result<bool>, Instant)>
    });
    // A handler that finishes without waiting needs no renewal timer: the
    // renewal loop (boxed, to keep this future small) starts only if it
    // waits.
    let first = std::future::poll_fn(|cx| Poll::Ready(call.as_mut().poll(cx))).await;
    let (result, expires_at, confirmed_lost) = match first {
        Poll::Ready(result) => (Some(result), lease.expires_at(), false),
        Poll::Pending => Box::pin(renew_while(locker, on_lost, call, &lease, &held, early)).await,
    };
    match result {
        Some(result) if !held.is_lost() => {
            // A release that finds the lock gone means it ran out while the
            // handler held the thread (no renewal could run): the handler
            // worked without it for a while, which the caller must know.
            if guard.release(Some(expires_at)).await == Some(false) {
                held.mark_lost();
                lost.increment(1);
                return Err(lock_lost(&held, true));
            }
            result
        }
        completed => {
            lost.increment(1);
            if confirmed_lost {
                // Redis said it is not ours: a release would be refused.
                guard.ticket = None;
            }
            // Otherwise the lock may still be ours on the server (a renewal
            // whose reply was lost ran, or is still queued): the guard's drop
            // releases it in the background (token-checked, a no-op if it
            // is gone), so that a hung connection does not delay the report.
            drop(guard);
            Err(lock_lost(&held, completed.is_some()))
        }
    }
}

fn lock_lost(held: &HeldLock, completed: bool) -> BoxError {
    let (key, fence) = (held.key().to_owned(), held.issued_fence());
    LockLost {
        key,
        fence,
        completed,
    }
    .into()
}

/// Renews the lease while the handler's `call` runs (see [`hold`]); returns
/// its result (`None` when it was cancelled because the lock was lost), the
/// lease's conservative expiry, and whether Redis said the lock is not ours
/// any more.
async fn renew_while<C, R>(
    locker: &Locker<C>,
    on_lost: OnLost,
    mut call: std::pin::Pin<&mut impl Future<Output = Result<R, BoxError>>>,
    lease: &Lease,
    held: &HeldLock,
    renewal: Option<BoxFuture<'static, (crate::Result<bool>, Instant)>>,
) -> (Option<Result<R, BoxError>>, Instant, bool)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let ttl = locker.lease_ttl();
    let mut lease_clock = LeaseClock::new(ttl, lease.expires_at());
    let mut renewal = renewal;
    // Set when Redis said the lock is not ours any more (a renewal answered
    // `false`): only then is there nothing to release.
    let mut confirmed_lost = false;
    let result = loop {
        tokio::select! {
            biased;
            result = &mut call => break Some(result),
            (renewed, sent) = async {
                match renewal.as_mut() {
                    Some(renewal) => renewal.await,
                    None => std::future::pending().await,
                }
            }, if renewal.is_some() => {
                renewal = None;
                confirmed_lost |= lease_clock.answered(renewed, sent, held);
                if held.is_lost() && on_lost == OnLost::Cancel {
                    break None;
                }
            }
            () = tokio::time::sleep_until(lease_clock.expires_at), if !held.is_lost() => {
                // The local deadline: no renewal was confirmed in time.
                tracing::warn!(key = %held.key(), fence = ?held.issued_fence(), renewing = renewal.is_some(), "lock lease ran out without a confirmed renewal; the lock counts as lost");
                // A late answer would change nothing: lost is final.
                renewal = None;
                held.mark_lost();
                if on_lost == OnLost::Cancel {
                    break None;
                }
            }
            () = tokio::time::sleep_until(lease_clock.renew_at), if renewal.is_none() && !held.is_lost() => {
                renewal = Some(Box::pin(renew(locker, lease.ticket(), ttl)));
            }
        }
    };
    (result, lease_clock.expires_at, confirmed_lost)
}

/// Renews `ticket`'s lock to `ttl`; answers with the time the request was
/// sent, taken before it leaves: the lease's conservative start.
fn renew<C>(
    locker: &Locker<C>,
    ticket: &Arc<Ticket>,
    ttl: Duration,
) -> impl Future<Output = (crate::Result<bool>, Instant)> + Send + 'static
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let (locker, ticket) = (locker.clone(), ticket.clone());
    async move {
        let sent = Instant::now();
        (locker.extend_ticket(&ticket, ttl).await, sent)
    }
}

/// When a held lock's lease runs out by this process's clock, and when to
/// renew it: once a third of it is used.
struct LeaseClock {
    ttl: Duration,
    expires_at: Instant,
    renew_at: Instant,
}

impl LeaseClock {
    fn new(ttl: Duration, expires_at: Instant) -> Self {
        let mut clock = Self {
            ttl,
            expires_at,
            renew_at: expires_at,
        };
        clock.expire_at(expires_at);
        clock
    }

    fn expire_at(&mut self, expires_at: Instant) {
        self.expires_at = expires_at;
        let ahead = self.ttl - self.ttl / 3;
        self.renew_at = expires_at.checked_sub(ahead).unwrap_or(expires_at);
    }

    /// Takes in a renewal's answer (sent at `sent`); returns whether Redis
    /// said the lock is not ours any more.
    fn answered(&mut self, renewed: crate::Result<bool>, sent: Instant, held: &HeldLock) -> bool {
        match renewed {
            Ok(true) => {
                // The server ran it at `sent` or later: its TTL runs out no
                // earlier than this. (If that is past already, the deadline
                // branch fires next.)
                self.expire_at(sent + self.ttl);
                false
            }
            Ok(false) => {
                tracing::warn!(key = %held.key(), fence = ?held.issued_fence(), "lock lost while the handler ran");
                held.mark_lost();
                true
            }
            Err(crate::Error::NotReplicated { released: true, .. }) => {
                // A durable locker gave the lock up itself: too few replicas
                // confirmed the renewal, so it was released (fail-closed).
                // Free in Redis now.
                tracing::warn!(key = %held.key(), fence = ?held.issued_fence(), "lock released: too few replicas confirmed its renewal");
                held.mark_lost();
                true
            }
            Err(error) => {
                // Not a verdict: the renewal may have run or not. Try again
                // soon, well before the lease runs out; the deadline decides
                // when it is lost.
                tracing::warn!(key = %held.key(), %error, "could not renew lock; will retry");
                let left = self.expires_at.saturating_duration_since(Instant::now());
                self.renew_at = Instant::now() + (left / 4).max(Duration::from_millis(1));
                false
            }
        }
    }
}

/// Releases the lock when dropped without [`release`](Self::release): the
/// response future was dropped (cancellation), or the handler panicked.
/// Borrows the layer's locker; only a release left to the runtime clones it.
pub(super) struct ReleaseGuard<'a, C: ConnectionLike + Clone + Send + Sync + 'static> {
    pub(super) locker: &'a Locker<C>,
    /// The attempt to release; `None` once released or known not held.
    pub(super) ticket: Option<Arc<Ticket>>,
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> ReleaseGuard<'_, C> {
    /// Releases the lock: `Some(true)` if it was still ours, `Some(false)`
    /// if it had expired or was taken, `None` if Redis could not be asked.
    /// A lock found gone counts as ours when its reply came before
    /// `deadline`, the lease's conservative expiry: only our own release (a
    /// resend whose first copy ran) or a deletion by hand removes it earlier.
    async fn release(&mut self, deadline: Option<Instant>) -> Option<bool> {
        let ticket = self.ticket.as_ref()?;
        let released = release_logged(self.locker, ticket, deadline).await;
        // Disarmed only now: if this future is dropped while the release is
        // in flight, the guard's drop sends it again (a no-op if it landed).
        self.ticket = None;
        released
    }
}

/// Releases `ticket`'s lock and logs what the release found (see
/// [`ReleaseGuard::release`]).
async fn release_logged<C: ConnectionLike + Clone + Send + Sync + 'static>(
    locker: &Locker<C>,
    ticket: &Ticket,
    deadline: Option<Instant>,
) -> Option<bool> {
    let released = locker
        .release_ticket(ticket)
        .await
        .map(|released| match released {
            Released::Now => true,
            // Read after the reply rather than before the request (saving
            // a clock read on every release): later, so stricter.
            Released::Gone => deadline.is_some_and(|deadline| Instant::now() < deadline),
            Released::Other => false,
        });
    let key = ticket.key();
    match &released {
        Ok(true) => tracing::debug!(%key, "lock released"),
        Ok(false) => tracing::warn!(%key, "lock had expired before it was released"),
        Err(error) => {
            tracing::warn!(%key, %error, "could not release lock; it expires with its TTL")
        }
    }
    released.ok()
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Drop for ReleaseGuard<'_, C> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        // Dropping cannot await; hand the release to the runtime. Without
        // one (the runtime is shutting down), the lock expires with its TTL.
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let locker = self.locker.clone();
            handle.spawn(async move {
                let _ = release_logged(&locker, &ticket, None).await;
            });
        }
    }
}
