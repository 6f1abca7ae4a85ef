//! The claimed job a [`Worker`](crate::Worker) is running, made available
//! to the first [`LockLayer`](crate::LockLayer) its request passes.

use std::cell::RefCell;
use std::sync::Arc;

use super::job::Job;
use super::{Claim, QueueKeys};

tokio::task_local! {
    /// The claimed job a [`Worker`](crate::Worker) is running the service
    /// for, until the first `LockLayer` on the way takes it: that layer may
    /// reschedule the job in place when it defers the plain payload, instead
    /// of pushing a copy. Layers further down (a handler's own calls through
    /// another `LockLayer`) find the slot empty and treat their requests as
    /// the new messages they are.
    static RUNNING: RefCell<Option<RunningJob>>;
}

/// What a deferral needs to know of the job the worker is running.
#[derive(Debug, Clone)]
pub(crate) struct RunningJob {
    /// The queue it was claimed from.
    pub(crate) queue: Arc<QueueKeys>,
    /// Its claim.
    pub(crate) token: super::ClaimToken,
    /// Deferrals before this delivery.
    pub(crate) deferrals: u32,
    /// Its payload as stored: a deferred request is this job only if it
    /// encodes to the same bytes.
    pub(crate) raw: Arc<[u8]>,
}

impl RunningJob {
    pub(crate) fn of<T>(job: &Job<T>) -> Self {
        Self {
            queue: job.queue_keys().clone(),
            token: job.claim_ref().to_token(),
            deferrals: job.deferrals(),
            raw: job.raw().clone(),
        }
    }

    /// Whether `encoded` is this job's payload.
    pub(crate) fn is(&self, encoded: &[u8]) -> bool {
        *self.raw == *encoded
    }

    /// Takes the job the current task's worker is running, if no one took
    /// it before.
    pub(crate) fn take() -> Option<Self> {
        RUNNING
            .try_with(|slot| slot.borrow_mut().take())
            .ok()
            .flatten()
    }

    /// Runs `f` (a future) with `self` available to [`RunningJob::take`].
    pub(crate) async fn scope<F: std::future::Future>(self, f: F) -> F::Output {
        RUNNING.scope(RefCell::new(Some(self)), f).await
    }

    /// Calls `f` with `job` (if any) available to [`RunningJob::take`].
    pub(crate) fn provide<R>(job: Option<Self>, f: impl FnOnce() -> R) -> R {
        RUNNING.sync_scope(RefCell::new(job), f)
    }
}

