//! The [`Lock`] service and the life of one locked call.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tower::Service;

use super::context::HeldLock;
use super::error::LockLost;
use super::future::ResponseFuture;
use super::strategy::GiveUp;
use super::{Config, LockKey, OnLost};
use crate::BoxError;
use crate::lock::wake::Woken;
use crate::lock::{Acquisition, Lease, Line, Locker, Released, Ticket};
use crate::outcome::Outcome;
use crate::queue::Handoff;
use futures_util::future::BoxFuture;

/// Runs the inner service while holding a per-key lock. Made by
/// [`LockLayer`](super::LockLayer).
pub struct Lock<S, C, F, D> {
    /// The wrapped service.
    inner: S,
    /// Locker, key function and strategy, shared by all clones.
    config: Arc<Config<C, F, D>>,
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
    pub(crate) fn new(inner: S, config: Arc<Config<C, F, D>>) -> Self {
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
        // A worker's running job belongs to the first lock layer its request
        // passes, taken here in `call` (see `RunningJob`): calls a handler
        // makes from its future through other layers must not be mistaken
        // for it. A layer that needs no lock for this request hands it on to
        // the layers it wraps, and only to them.
        let running = Handoff::take();
        ResponseFuture::new(Box::pin(async move {
            match key {
                None => call_ready(inner, req, running).await,
                Some((key, permits)) => {
                    let permits = permits.or(config.permits);
                    locked_call(config, inner, key, permits, req, running).await
                }
            }
        }))
    }
}

/// Calls an already ready service for a message that needs no lock,
/// handing `running` on to the layers it wraps.
async fn call_ready<S, Req>(
    mut inner: S,
    req: Req,
    running: Handoff,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    let call = running.provide(|| inner.call(req));
    call.await.map(Outcome::Done).map_err(Into::into)
}

/// Acquire (retrying as configured), call while holding, release.
async fn locked_call<S, C, F, D, Req>(
    config: Arc<Config<C, F, D>>,
    inner: S,
    key: String,
    permits: Option<u32>,
    req: Req,
    running: Handoff,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req> + Send + 'static,
    S::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    D: GiveUp<Req>,
{
    let locker = &config.locker;
    if let Some(token) = claimed_with_lock(&running, locker, &key, permits) {
        return call_holding(config, inner, (key, permits), token, req, running).await;
    }
    let instruments = config
        .instruments
        .get_or_init(crate::telemetry::LockInstruments::register);
    let retry = config.on_conflict.retry;
    // One budget for the whole call, from its start: the wait in the local
    // queue, the tries and their round trips, and the waits between them.
    // (Read only under `retry`: a clock read is not free on the hot path.)
    let started = retry.map(|_| Instant::now());
    let deadline = retry
        .and_then(|b| b.budget())
        .zip(started)
        .and_then(|(b, started)| started.checked_add(b));
    let mut tries: u32 = 0;
    // Whether the call found its key busy (in Redis, or behind this
    // process's earlier callers), for the metrics.
    let mut contended = false;
    let ticket = match permits {
        Some(permits) => locker.permit_ticket(key, permits)?,
        None => locker.ticket(key)?,
    };
    let key = ticket.key();
    // Under `retry`, wait behind this process's earlier calls for the key
    // (FIFO), within the retry budget; only the head asks Redis.
    let _turn = match retry {
        None => None,
        Some(backoff) => {
            // Keyed by the Redis key: a key's lock and its permits are
            // separate, and a key with n permits lets n callers through.
            let turn = config.local.turn(ticket.lock_key(), permits.unwrap_or(1));
            let turn = match deadline {
                None => Box::pin(turn).await,
                // Boxed, as every path of a busy key below: they keep the
                // future of an uncontended call small.
                Some(deadline) => match Box::pin(tokio::time::timeout_at(deadline, turn)).await {
                    Ok(turn) => turn,
                    Err(_) => {
                        tracing::debug!(%key, "lock busy in this process for the whole retry budget; giving up");
                        let retry_after = Box::pin(locker.remaining_ticket(&ticket)).await?;
                        let busy = crate::Contended::new(key.to_owned(), retry_after)
                            .with_permits(ticket.permits());
                        let give_up =
                            running.provide(|| config.on_conflict.then.give_up(req, busy));
                        let gave_up = Box::pin(give_up).await;
                        let (id, due) = instruments.gave_up(gave_up)?;
                        return Ok(Outcome::Deferred { id, due });
                    }
                },
            };
            // Waiting behind local callers stands for the tries they made
            // meanwhile: it uses up the tries whose backoff waits it covers
            // (at least one), so that queue and tries together stay within
            // the waits `max_attempts` allows. One try is always left: the
            // key was just handed over, it is likely free.
            contended |= turn.waited();
            if turn.waited() {
                let covered =
                    backoff.tries_covered(started.map_or(Duration::ZERO, |s| s.elapsed()));
                let left_one = backoff.attempts_limit().map_or(u32::MAX, |n| n - 1);
                tries = covered.min(left_one);
            }
            Some(turn)
        }
    };
    // Armed before the first acquire is sent: if this future is dropped
    // while an acquire is in flight, the lock may be ours without our
    // knowing, and the guard releases it (a no-op if it is not).
    let mut guard = ReleaseGuard {
        locker,
        ticket: Some(ticket.clone()),
    };
    // Under `retry` with a release listener: this call's subscription to
    // the key's releases, made when the key is first found busy.
    let mut watch: Option<crate::lock::Watch> = None;
    // When this call first asked to join the key's line of waiters (see
    // `src/lock/release.lua`): it must leave the line if it gives up, and a
    // lock handed to it soon after needs no round trip to be taken.
    let mut joined: Option<Instant> = None;
    let lease = loop {
        tries = tries.saturating_add(1);
        let Some(ticket) = guard.ticket.clone() else {
            return Err(crate::Error::reply("acquiring a lock", "ticket missing").into());
        };
        // The first try is the plain `SET NX PX`; a busy key (and
        // every later try) runs the contend script, which tries again and
        // reads how long the holder still has.
        // A waiter that listens joins the key's line, so that the release
        // hands it on. One
        // that cannot hear releases now (the listener reconnects) does not
        // join, but leaves the line if it takes the lock.
        let line = match watch.as_ref().is_some_and(|w| w.is_ready()) {
            true => Line::Join,
            false if joined.is_some() => Line::Leave,
            false => Line::Outside,
        };
        if line == Line::Join && joined.is_none() {
            joined = Some(Instant::now());
        }
        let acquisition = match tries {
            1 => match locker.try_set(&ticket).await? {
                Some(acquired) => acquired,
                None => locker.contend(&ticket, line).await?,
            },
            _ => locker.contend(&ticket, line).await?,
        };
        let busy = match acquisition {
            Acquisition::Acquired(lease) if !lease.is_expired() => break lease,
            Acquisition::Acquired(_) => {
                // The reply came after the lease it grants had run out (a
                // slow or paused server, a long stall): another process may
                // hold the key by now, so the handler must not start. The
                // try counts as a failed one, as if the key had been busy:
                // the handler has not run, so the strategy's answer (retry,
                // fail with `Contended`, defer) fits, and no error is
                // charged to a message that never reached its handler.
                tracing::warn!(%key, "lock acquired after its lease had run out; releasing it");
                if let Err(error) = locker.release_ticket(&ticket).await {
                    // Maybe still ours. Its token is retired: a release of it
                    // that lands late must never meet a lock this call takes
                    // again, so the next try gets a fresh ticket, and the old
                    // one is released in the background (the guard's drop).
                    tracing::warn!(%key, %error, "could not release a lock acquired too late; releasing it in the background");
                    drop(ReleaseGuard {
                        locker,
                        ticket: guard.ticket.replace(locker.retoken(&ticket)),
                    });
                    // The new token waits anew: listened for, and in line,
                    // under its own name (the old one leaves the line with
                    // its background release).
                    watch = None;
                    joined = None;
                }
                crate::Contended::new(key.to_owned(), Duration::ZERO).with_permits(ticket.permits())
            }
            Acquisition::Contended(busy) => busy,
        };
        contended = true;
        if let (Some(backoff), Some(listener)) =
            (retry, retry.and_then(|_| config.wake.listener(locker)))
        {
            // Woken by the release: waits are bounded by the budget's time
            // (what `max_attempts` waits would take, or `max_elapsed`), not
            // by counting wake-ups, which a hot key hands out by the dozen.
            let within = deadline.is_none_or(|d| Instant::now() < d);
            if within {
                match watch.as_mut() {
                    None => {
                        // Listen first, then mark the lock (next try): a
                        // release in between cannot be missed.
                        let mut new = listener.watch(ticket.lock_key(), ticket.token());
                        let ready = Box::pin(new.ready(deadline)).await;
                        watch = Some(new);
                        if ready {
                            continue;
                        }
                    }
                    Some(listening) if listening.is_ready() => {
                        // Until the release, or the holder's lease runs out
                        // (it died), within the budget.
                        let holder_left = match busy.retry_after() {
                            Duration::ZERO => backoff.delay(tries.saturating_sub(1)),
                            left => left + Duration::from_millis(1),
                        };
                        let until = Instant::now() + holder_left;
                        let until = deadline.map_or(until, |d| until.min(d));
                        tracing::trace!(%key, tries, ?holder_left, "lock busy; waiting for its release");
                        let handed = Box::pin(wait_for_turn(listening, until, deadline)).await;
                        if let Some(lease) = joined
                            .filter(|_| handed)
                            .and_then(|joined| locker.handed(&ticket, joined))
                        {
                            break lease;
                        }
                        continue;
                    }
                    Some(_) => {}
                }
                // The listener's connection is down: poll with backoff
                // meanwhile, within the same time budget.
                let delay = backoff.delay(tries.saturating_sub(1));
                let until = Instant::now() + delay;
                Box::pin(tokio::time::sleep_until(
                    deadline.map_or(until, |d| until.min(d)),
                ))
                .await;
                continue;
            }
        } else if let Some(delay) = retry
            .zip(started)
            .and_then(|(b, started)| b.next(tries, started.elapsed()))
        {
            // Everything since the call started counts against `max_elapsed`.
            tracing::trace!(%key, tries, ?delay, "lock busy; retrying");
            Box::pin(tokio::time::sleep(delay)).await;
            continue;
        }
        // Not ours (a ticket whose release failed was handed to a
        // background release above): nothing to release, but a call that
        // joined the key's line of waiters leaves it (in the background),
        // and hands the lock on if a release handed it to this call
        // meanwhile.
        if let Some(ticket) = guard.ticket.take().filter(|_| joined.is_some()) {
            let locker = locker.clone();
            tokio::spawn(async move { locker.release_ticket(&ticket).await });
        }
        tracing::debug!(%key, tries, retry_after = ?busy.retry_after(), "lock busy; giving up");
        let give_up = running.provide(|| config.on_conflict.then.give_up(req, busy));
        let gave_up = Box::pin(give_up).await;
        let (id, due) = instruments.gave_up(gave_up)?;
        return Ok(Outcome::Deferred { id, due });
    };
    drop(watch);
    instruments.acquired.increment(1);
    if contended {
        instruments.acquired_after_wait.increment(1);
        if let Some(started) = started {
            instruments.wait.record(started.elapsed().as_secs_f64());
        }
    }
    tracing::debug!(%key, "lock acquired");
    let held = HeldLock::new(lease.ticket().clone(), fence_issuer(&config));
    // The running job, if this layer took it and did not need it, goes on to
    // the layers inside: one of them may defer the job in place.
    let mut inner = inner;
    let call = held.clone().scope(async move {
        let call = running.provide(|| inner.call(req));
        call.await.map_err(Into::<BoxError>::into)
    });
    hold(
        locker,
        config.on_lost,
        call,
        lease,
        held,
        guard,
        &instruments.lost,
    )
    .await
}

/// Issues the fences of [`HeldLock::fence`].
fn fence_issuer<C, F, D>(config: &Config<C, F, D>) -> super::context::IssueFence
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let locker = &config.locker;
    config
        .issue_fence
        .get_or_init(|| {
            let locker = locker.clone();
            Arc::new(move |ticket| {
                let locker = locker.clone();
                Box::pin(async move { locker.fence_ticket(&ticket).await })
            })
        })
        .clone()
}

/// The token of the lock on `key` (one of its `permits`), when the
/// worker's running job is a keyed message claimed with that very lock.
fn claimed_with_lock<C>(
    running: &Handoff,
    locker: &crate::Locker<C>,
    key: &str,
    permits: Option<u32>,
) -> Option<crate::lock::Token>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let job = running.job.as_ref()?;
    let (held, token, limit) = job.token.held_lock()?;
    let same = held == key && (limit > 0).then_some(limit) == permits;
    (same && job.queue.prefix == locker.key_prefix()).then_some(token)
}

/// Calls the inner service for a keyed message the worker claimed with its
/// key's lock: the lock is held already, renewed with the message's lease
/// and let go by its settlement.
async fn call_holding<S, C, F, D, Req>(
    config: Arc<Config<C, F, D>>,
    mut inner: S,
    (key, permits): (String, Option<u32>),
    token: crate::lock::Token,
    req: Req,
    running: Handoff,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req> + Send + 'static,
    S::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let ticket = config.locker.held_ticket(key, token, permits);
    let held = HeldLock::new(ticket, fence_issuer(&config));
    let call = held.scope(async move { running.provide(|| inner.call(req)).await });
    call.await.map(Outcome::Done).map_err(Into::into)
}

/// Sleeps until a release hands the lock to this waiter (true) or to nobody
/// (then every waiter tries again), or until `until`. A lock handed to
/// another waiter is theirs for the hand-off time: if they do not take it
/// by then (they died or gave up), the lock expires, and this waiter tries
/// again.
async fn wait_for_turn(
    listening: &mut crate::lock::wake::Watch,
    mut until: Instant,
    deadline: Option<Instant>,
) -> bool {
    loop {
        tokio::select! {
            woken = listening.woken() => match woken {
                Woken::Mine => return true,
                Woken::Elsewhere => {
                    let handoff_ends = Instant::now() + crate::lock::HANDOFF + Duration::from_millis(1);
                    until = deadline.map_or(handoff_ends, |d| handoff_ends.min(d));
                }
                Woken::Anyone => return false,
            },
            () = tokio::time::sleep_until(until) => return false,
        }
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
async fn hold<C, R>(
    locker: &Locker<C>,
    on_lost: OnLost,
    call: impl Future<Output = Result<R, BoxError>>,
    lease: Lease,
    held: HeldLock,
    mut guard: ReleaseGuard<'_, C>,
    lost: &metrics::Counter,
) -> Result<Outcome<R>, BoxError>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    tokio::pin!(call);
    // A lease whose renewal is due already (one handed over by a release,
    // which lasts the hand-off time: see `Locker::handed`) is renewed to a
    // whole TTL at once, on a task of its own, so that the renewal goes out
    // even while the handler holds this thread.
    let ttl = locker.lease_ttl();
    let early = (lease.expires_at() <= Instant::now() + (ttl - ttl / 3)).then(|| {
        let (locker, ticket) = (locker.clone(), lease.ticket().clone());
        let renewal = tokio::spawn(async move {
            // Taken before the request leaves: conservative.
            let sent = Instant::now();
            (locker.extend_ticket(&ticket, ttl).await, sent)
        });
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
                return Err(LockLost {
                    key: held.key().to_owned(),
                    fence: held.issued_fence(),
                    completed: true,
                }
                .into());
            }
            result.map(Outcome::Done)
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
            Err(LockLost {
                key: held.key().to_owned(),
                fence: held.issued_fence(),
                completed: completed.is_some(),
            }
            .into())
        }
    }
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
                let (locker, ticket) = (locker.clone(), lease.ticket().clone());
                renewal = Some(Box::pin(async move {
                    // Taken before the request leaves: conservative.
                    let sent = Instant::now();
                    (locker.extend_ticket(&ticket, ttl).await, sent)
                }));
            }
        }
    };
    (result, lease_clock.expires_at, confirmed_lost)
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
        clock.renew_at = clock.renew_time();
        clock
    }

    fn renew_time(&self) -> Instant {
        let ahead = self.ttl - self.ttl / 3;
        self.expires_at
            .checked_sub(ahead)
            .unwrap_or(self.expires_at)
    }

    /// Takes in a renewal's answer (sent at `sent`); returns whether Redis
    /// said the lock is not ours any more.
    fn answered(&mut self, renewed: crate::Result<bool>, sent: Instant, held: &HeldLock) -> bool {
        match renewed {
            Ok(true) => {
                // The server ran it at `sent` or later: its TTL runs out no
                // earlier than this. (If that is past already, the deadline
                // branch fires next.)
                self.expires_at = sent + self.ttl;
                self.renew_at = self.renew_time();
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
struct ReleaseGuard<'a, C: ConnectionLike + Clone + Send + Sync + 'static> {
    locker: &'a Locker<C>,
    /// The attempt to release; `None` once released or known not held.
    ticket: Option<Arc<Ticket>>,
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
