//! The contention path of one locked call, as a type.
//!
//! [`Contention`] holds what a call learns while its key is busy: its
//! tries, its retry budget, its subscription to the key's releases and its
//! place in the key's line of waiters. Each step is a method: wait behind
//! this process's earlier callers ([`local_turn`](Contention::local_turn)),
//! try once on Redis ([`try_once`](Contention::try_once)), wait for the next
//! try ([`wait`](Contention::wait)), and either hand the lock to the call
//! ([`acquired`](Contention::acquired)) or leave ([`leave`](Contention::leave)).
//! `locked_call` (service.rs) drives them; the strategy's last step (fail
//! or defer) is its own type (`strategy.rs`).

use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::Wake;
use super::local::{LocalQueues, Turn};
use super::service::ReleaseGuard;
use crate::backoff::Backoff;
use crate::lock::wake::{Watch, Woken};
use crate::lock::{Acquisition, Contended, Lease, Line, Locker, Ticket};
use crate::telemetry::LockInstruments;

/// What a call does after finding its key busy.
pub(super) enum Next {
    /// Try again on Redis.
    Try,
    /// A release handed the lock to this call.
    Handed(Lease),
    /// The budget is spent (or there is none): the strategy gives up.
    GiveUp,
}

/// One call's contention for its key (see [the module](self)).
pub(super) struct Contention<'a, C: ConnectionLike + Clone + Send + Sync + 'static> {
    locker: &'a Locker<C>,
    /// The retry policy; `None` gives up at the first busy answer.
    retry: Option<Backoff>,
    /// What wakes a waiting call (asked only once the key is busy: a
    /// locker's listener opens on its first waiter).
    wake: &'a Wake,
    /// When the call started; read only under `retry` (a clock read is not
    /// free on the hot path).
    started: Option<Instant>,
    /// The end of the retry budget: one budget for the whole call, from its
    /// start (the local wait, the tries and their round trips, the waits).
    deadline: Option<Instant>,
    /// Tries made on Redis, and those the local wait stands for.
    tries: u32,
    /// Whether the key was busy (in Redis, or behind this process's
    /// earlier callers), for the metrics.
    contended: bool,
    /// The attempt: its ticket, and the guard that releases it if the call
    /// is dropped while a try may have taken the lock. Armed before the
    /// first try.
    ticket: Arc<Ticket>,
    guard: ReleaseGuard<'a, C>,
    /// The call's subscription to the key's releases, made when the key is
    /// first found busy (under `retry` with a listener).
    watch: Option<Watch>,
    /// When the call first asked to join the key's line of waiters (see
    /// `src/lock/release.lua`): it must leave the line if it gives up, and
    /// a lock handed to it soon after needs no round trip to be taken.
    joined: Option<Instant>,
}

impl<'a, C: ConnectionLike + Clone + Send + Sync + 'static> Contention<'a, C> {
    pub(super) fn new(
        locker: &'a Locker<C>,
        (retry, wake): (Option<Backoff>, &'a Wake),
        ticket: Arc<Ticket>,
    ) -> Self {
        let started = retry.map(|_| Instant::now());
        let deadline = retry
            .and_then(|b| b.budget())
            .zip(started)
            .and_then(|(b, started)| started.checked_add(b));
        Self {
            locker,
            retry,
            wake,
            started,
            deadline,
            tries: 0,
            contended: false,
            ticket,
            guard: ReleaseGuard {
                locker,
                ticket: None,
            },
            watch: None,
            joined: None,
        }
    }

    /// Under `retry`, waits behind this process's earlier calls for the key
    /// (a FIFO, `local`: only its head asks Redis), within the budget.
    /// `Err` with the holder's remaining lease when the budget ran out
    /// first. Then arms the release guard: the tries may take the lock.
    pub(super) async fn local_turn(
        &mut self,
        local: &Arc<LocalQueues>,
    ) -> crate::Result<Result<Option<Turn>, Contended>> {
        let Some(backoff) = self.retry else {
            self.guard.ticket = Some(self.ticket.clone());
            return Ok(Ok(None));
        };
        let ticket = &self.ticket;
        // Keyed by the Redis key: a key's lock and its permits are
        // separate, and a key with n permits lets n callers through.
        let turn = local.turn(ticket.lock_key(), ticket.permits().unwrap_or(1));
        let turn = match self.deadline {
            None => Box::pin(turn).await,
            // Boxed, as every path of a busy key: they keep the future of an
            // uncontended call small.
            Some(deadline) => match Box::pin(tokio::time::timeout_at(deadline, turn)).await {
                Ok(turn) => turn,
                Err(_) => {
                    let key = ticket.key();
                    tracing::debug!(%key, "lock busy in this process for the whole retry budget; giving up");
                    let retry_after = Box::pin(self.locker.remaining_ticket(ticket)).await?;
                    let busy = Contended::new(key.to_owned(), retry_after);
                    return Ok(Err(busy.with_permits(ticket.permits())));
                }
            },
        };
        // Waiting behind local callers stands for the tries they made
        // meanwhile: it uses up the tries whose backoff waits it covers (at
        // least one), so that queue and tries together stay within the
        // waits `max_attempts` allows. One try is always left: the key was
        // just handed over, it is likely free.
        if turn.waited() {
            self.contended = true;
            let waited = self.started.map_or(Duration::ZERO, |s| s.elapsed());
            let left_one = backoff.max_attempts.map_or(u32::MAX, |n| n - 1);
            self.tries = backoff.tries_covered(waited).min(left_one);
        }
        self.guard.ticket = Some(self.ticket.clone());
        Ok(Ok(Some(turn)))
    }

    /// One try on Redis: the plain `SET NX PX` first, the contend script
    /// for every later try (it tries again and reads how long the holder
    /// still has). A waiter that listens joins the key's line, so that the
    /// release hands it on; one that cannot hear releases now (its listener
    /// reconnects) does not join, but leaves the line if it takes the lock.
    pub(super) async fn try_once(&mut self) -> crate::Result<Result<Lease, Contended>> {
        self.tries = self.tries.saturating_add(1);
        let Some(ticket) = self.guard.ticket.clone() else {
            return Err(crate::Error::reply("acquiring a lock", "ticket missing"));
        };
        let line = match self.watch.as_ref().is_some_and(|w| w.is_ready()) {
            true => Line::Join,
            false if self.joined.is_some() => Line::Leave,
            false => Line::Outside,
        };
        if line == Line::Join && self.joined.is_none() {
            self.joined = Some(Instant::now());
        }
        let locker = self.locker;
        let acquisition = match self.tries {
            1 => match locker.try_set(&ticket).await? {
                Some(acquired) => acquired,
                None => locker.contend(&ticket, line).await?,
            },
            _ => locker.contend(&ticket, line).await?,
        };
        self.contended |= !matches!(&acquisition, Acquisition::Acquired(l) if !l.is_expired());
        Ok(match acquisition {
            Acquisition::Acquired(lease) if !lease.is_expired() => Ok(lease),
            Acquisition::Acquired(_) => Err(self.acquired_too_late(&ticket).await),
            Acquisition::Contended(busy) => Err(busy),
        })
    }

    /// The reply came after the lease it grants had run out (a slow or
    /// paused server, a long stall): another process may hold the key by
    /// now, so the handler must not start. The try counts as a failed one,
    /// as if the key had been busy: the handler has not run, so the
    /// strategy's answer (retry, fail with `Contended`, defer) fits, and no
    /// error is charged to a message that never reached its handler.
    async fn acquired_too_late(&mut self, ticket: &Arc<Ticket>) -> Contended {
        let (locker, key) = (self.locker, ticket.key());
        tracing::warn!(%key, "lock acquired after its lease had run out; releasing it");
        if let Err(error) = locker.release_ticket(ticket).await {
            // Maybe still ours. Its token is retired: a release of it that
            // lands late must never meet a lock this call takes again, so
            // the next try gets a fresh ticket, and the old one is released
            // in the background (the guard's drop).
            tracing::warn!(%key, %error, "could not release a lock acquired too late; releasing it in the background");
            drop(ReleaseGuard {
                locker,
                ticket: self.guard.ticket.replace(locker.retoken(ticket)),
            });
            // The new token waits anew: listened for, and in line, under
            // its own name (the old one leaves the line with its release).
            self.watch = None;
            self.joined = None;
        }
        Contended::new(key.to_owned(), Duration::ZERO).with_permits(ticket.permits())
    }

    /// Waits for the next try after `busy`: woken by the release when a
    /// listener is at hand, else by the backoff.
    pub(super) async fn wait(&mut self, busy: &Contended) -> Next {
        let Some(backoff) = self.retry else {
            return Next::GiveUp;
        };
        if let Some(listener) = self.wake.listener(self.locker) {
            return self.wait_woken(backoff, &listener, busy).await;
        }
        // Everything since the call started counts against `max_elapsed`.
        let waited = self.started.map(|s| s.elapsed());
        let Some(delay) = waited.and_then(|waited| backoff.next(self.tries, waited)) else {
            return Next::GiveUp;
        };
        tracing::trace!(key = %busy.key(), tries = self.tries, ?delay, "lock busy; retrying");
        tokio::time::sleep(delay).await;
        Next::Try
    }

    /// Waits for the release, or the holder's lease to run out (it died),
    /// within the budget. Waits are bounded by the budget's time (what
    /// `max_attempts` waits would take, or `max_elapsed`), not by counting
    /// wake-ups, which a hot key hands out by the dozen.
    async fn wait_woken(
        &mut self,
        backoff: Backoff,
        listener: &crate::ReleaseListener,
        busy: &Contended,
    ) -> Next {
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Next::GiveUp;
        }
        let Some(ticket) = self.guard.ticket.clone() else {
            return Next::GiveUp;
        };
        match self.watch.as_mut() {
            None => {
                // Listen first, then mark the lock (next try): a release in
                // between cannot be missed.
                let mut new = listener.watch(ticket.lock_key(), ticket.token());
                let ready = new.ready(self.deadline).await;
                self.watch = Some(new);
                if ready {
                    return Next::Try;
                }
            }
            Some(listening) if listening.is_ready() => {
                let holder_left = match busy.retry_after() {
                    Duration::ZERO => backoff.delay(self.tries.saturating_sub(1)),
                    left => left + Duration::from_millis(1),
                };
                let until = Instant::now() + holder_left;
                let until = self.deadline.map_or(until, |d| until.min(d));
                tracing::trace!(key = %ticket.key(), tries = self.tries, ?holder_left, "lock busy; waiting for its release");
                let handed = wait_for_turn(listening, until, self.deadline).await;
                let lease = self.joined.filter(|_| handed);
                return match lease.and_then(|joined| self.locker.handed(&ticket, joined)) {
                    Some(lease) => Next::Handed(lease),
                    None => Next::Try,
                };
            }
            Some(_) => {}
        }
        // The listener's connection is down: poll with backoff meanwhile,
        // within the same time budget.
        let until = Instant::now() + backoff.delay(self.tries.saturating_sub(1));
        tokio::time::sleep_until(self.deadline.map_or(until, |d| until.min(d))).await;
        Next::Try
    }

    /// Gives up: nothing of ours to release (a ticket whose release failed
    /// went to a background release), but a call that joined the key's line
    /// leaves it, in the background, and hands the lock on if a release
    /// handed it to this call meanwhile.
    pub(super) fn leave(mut self) {
        if let Some(ticket) = self.guard.ticket.take().filter(|_| self.joined.is_some()) {
            let locker = self.locker.clone();
            tokio::spawn(async move { locker.release_ticket(&ticket).await });
        }
    }

    /// The lock is the call's: counts the acquisition (and the wait, if the
    /// key was busy) and hands over the guard that releases it.
    pub(super) fn acquired(self, instruments: &LockInstruments) -> ReleaseGuard<'a, C> {
        instruments.acquired.increment(1);
        if self.contended {
            instruments.acquired_after_wait.increment(1);
            if let Some(started) = self.started {
                instruments.wait.record(started.elapsed().as_secs_f64());
            }
        }
        self.guard
    }
}

/// Sleeps until a release hands the lock to this waiter (true) or to nobody
/// (then every waiter tries again), or until `until`. A lock handed to
/// another waiter is theirs for the hand-off time: if they do not take it
/// by then (they died or gave up), the lock expires, and this waiter tries
/// again.
async fn wait_for_turn(
    listening: &mut Watch,
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
