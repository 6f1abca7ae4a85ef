//! The lock held by the current call, readable from inside the handler.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures_util::future::BoxFuture;
use tokio::sync::Notify;

use crate::lock::Ticket;

/// Issues the fence of a ticket (a `Locker::fence_ticket`, with the
/// locker's connection type erased).
pub(crate) type IssueFence =
    Arc<dyn Fn(Arc<Ticket>) -> BoxFuture<'static, crate::Result<u64>> + Send + Sync>;

tokio::task_local! {
    static CURRENT: HeldLock;
}

/// The lock a [`LockLayer`](crate::LockLayer) holds for the handler that is
/// running now: its key, its fencing token, and whether it was lost.
///
/// Read it from inside the handler with [`HeldLock::current`]:
///
/// ```no_run
/// # async fn store(_: &str, _: u64) {}
/// async fn handle(order: String) -> Result<(), lockgate::BoxError> {
///     let lock = lockgate::HeldLock::current().expect("called through a LockLayer");
///     // Hand the fence to the storage, which refuses fences older than the
///     // newest it has seen: a holder that paused past its TTL cannot
///     // overwrite the next holder's work.
///     store(&order, lock.fence().await?).await;
///     Ok(())
/// }
/// ```
#[derive(Clone)]
pub struct HeldLock(Arc<State>);

impl std::fmt::Debug for HeldLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldLock")
            .field("key", &self.key())
            .field("fence", &self.issued_fence())
            .field("lost", &self.is_lost())
            .finish()
    }
}

struct State {
    /// The user's key, with the lock's Redis key, token and fence.
    ticket: Arc<Ticket>,
    issue_fence: IssueFence,
    lost: AtomicBool,
    /// Wakes [`HeldLock::lost`] waiters.
    notify: Notify,
    /// Whether this is a [`Worker`](crate::Worker)'s hold of the lock its
    /// running keyed message was claimed with.
    claim: bool,
    /// The claim hold of the handler this lock was taken in, if any: a
    /// `LockLayer` further in on that lock finds it through this one.
    within_claim: Option<HeldLock>,
}

/// Issues fences with `locker` (see [`HeldLock::fence`]).
pub(crate) fn fence_issuer<C>(locker: crate::Locker<C>) -> IssueFence
where
    C: redis::aio::ConnectionLike + Clone + Send + Sync + 'static,
{
    Arc::new(move |ticket| {
        let locker = locker.clone();
        Box::pin(async move { locker.fence_ticket(&ticket).await })
    })
}

impl HeldLock {
    /// A `LockLayer`'s hold of `ticket`'s lock, taken within the claim hold
    /// current here, if any.
    pub(crate) fn new(ticket: Arc<Ticket>, issue_fence: IssueFence) -> Self {
        Self::with(ticket, issue_fence, false, Self::claim_hold())
    }

    /// A worker's hold of the lock a keyed message was claimed with (see
    /// [`claim_hold`](Self::claim_hold)).
    pub(crate) fn of_claim(ticket: Arc<Ticket>, issue_fence: IssueFence) -> Self {
        Self::with(ticket, issue_fence, true, None)
    }

    fn with(
        ticket: Arc<Ticket>,
        issue_fence: IssueFence,
        claim: bool,
        within_claim: Option<HeldLock>,
    ) -> Self {
        Self(Arc::new(State {
            ticket,
            issue_fence,
            lost: AtomicBool::new(false),
            notify: Notify::new(),
            claim,
            within_claim,
        }))
    }

    /// The worker's hold of the lock its running keyed message was claimed
    /// with, when called from that message's handler (through any number of
    /// `LockLayer`s on other keys): a `LockLayer` on that very lock calls
    /// through under it instead of contending with its own worker.
    pub(crate) fn claim_hold() -> Option<HeldLock> {
        let current = Self::current()?;
        match current.0.claim {
            true => Some(current),
            false => current.0.within_claim.clone(),
        }
    }

    /// The lock held for the current call, when called (directly or through
    /// futures it awaits) from a handler running under a `LockLayer`, or
    /// from a [`Worker`](crate::Worker)'s handler of a keyed message (the
    /// key's lock it was claimed with). `None` elsewhere, and for messages
    /// whose key function returned `None`.
    pub fn current() -> Option<HeldLock> {
        CURRENT.try_with(Clone::clone).ok()
    }

    /// The user's key.
    pub fn key(&self) -> &str {
        self.0.ticket.key()
    }

    /// When the call holds one of its key's permits (see
    /// [`LockLayer::permits`](crate::LockLayer::permits)): how many the key
    /// admits. `None` for a lock. The permit itself is told apart from the
    /// others by its [`fence`](Self::fence).
    pub fn permits(&self) -> Option<u32> {
        self.0.ticket.permits()
    }

    /// The fencing token: strictly greater than any earlier holder's (see
    /// [`Locker::fence`](crate::Locker::fence)). Issued on first use, which
    /// takes one round trip; later calls return it at once. Errors with
    /// [`Error::NotHeld`](crate::Error::NotHeld) when the lock was lost
    /// before a fence was issued.
    pub async fn fence(&self) -> crate::Result<u64> {
        match self.issued_fence() {
            Some(fence) => Ok(fence),
            // A keyed message's lock may be the key's next message's by
            // now, under the same token: only a lock still this call's
            // may issue.
            None if self.is_lost() => Err(crate::Error::NotHeld {
                key: self.key().to_owned(),
            }),
            None => (self.0.issue_fence)(self.0.ticket.clone()).await,
        }
    }

    /// The fencing token, if one was issued (by [`fence`](Self::fence)).
    pub fn issued_fence(&self) -> Option<u64> {
        self.0.ticket.issued_fence()
    }

    /// Whether the lock counts as lost (see [`lost`](Self::lost)).
    pub fn is_lost(&self) -> bool {
        self.0.lost.load(Ordering::Acquire)
    }

    /// Completes when the lock counts as lost: select on it to stop work
    /// that must not continue without the lock.
    ///
    /// The lock is lost when Redis answers a renewal that it is not this
    /// call's any more, or when the lease's conservative expiry passes
    /// without a confirmed renewal (docs/layer.md, "The LockLayer", renewal):
    /// from that moment another process may hold the key. A keyed
    /// message's lock (held by the [`Worker`](crate::Worker)) also counts as
    /// lost once the message's handler returned: a clone that outlives the
    /// call (a spawned task's) must not act for the key's next message,
    /// which may hold the lock under the same token. Lost is final.
    pub async fn lost(&self) {
        loop {
            let notified = self.0.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_lost() {
                return;
            }
            notified.await;
        }
    }

    /// The Redis key of the lock (or permits set) held.
    pub(crate) fn lock_key(&self) -> &str {
        self.0.ticket.lock_key()
    }

    pub(crate) fn mark_lost(&self) {
        self.0.lost.store(true, Ordering::Release);
        self.0.notify.notify_waiters();
    }

    pub(crate) async fn scope<F: Future>(self, f: F) -> F::Output {
        CURRENT.scope(self, f).await
    }
}
