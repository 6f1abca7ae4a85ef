//! The claim of the job a [`Worker`](crate::Worker) is running, handed to
//! the first [`LockLayer`](crate::LockLayer) its request passes.
//!
//! A handler often sees only the payload (`map_request(|job: Job<T>|
//! job.into_payload())` before the lock layer), so the layer cannot read the
//! claim off the request. The worker hands the claim over beside the request
//! instead, and the layer identifies "the running job" by that claim alone,
//! never by comparing payload bytes: a producer's JSON may differ byte-wise
//! from what `T` serializes to (spacing, field order, unknown fields,
//! escapes), and the job must still be deferred in place, under its own id,
//! with its counts and its stored bytes kept.
//!
//! The types say who may reschedule what: a [`RunningJob`] is made only by
//! the worker (from the [`Job`] it claimed), it is not `Clone`, and
//! [`RunningJob::take`] hands it out once per handler call, so exactly one
//! layer holds the right to reschedule that claim; a deferral uses it only
//! for a queue with the job's own keys (a `Defer` into another queue pushes
//! a new message).
//!
//! The worker offers it only while it *calls* the service (synchronously):
//! the first `LockLayer` whose `call` runs inside that call (the request
//! passing through `map_request` and similar layers) takes it. Calls a
//! handler makes from its future, through other `LockLayer`s, come later,
//! find nothing, and push their requests as the new messages they are. A
//! layer that calls its inner service only later, from its own future (a
//! `Buffer`, say), hides the claim: such a deferral pushes a copy under a
//! new id, and the worker acknowledges the original. The one case the claim
//! cannot tell apart: a service whose own `call` (not its future) first
//! calls another `LockLayer` that needs a lock, for another message, hands
//! the claim to that layer. Make such calls from the future. (A layer whose
//! key function returns `None` leaves the claim for the next one.)

use std::cell::RefCell;
use std::sync::Arc;

use super::job::Job;
use super::{Claim, ClaimToken, QueueKeys};

tokio::task_local! {
    /// The claim of the job a [`Worker`](crate::Worker) is calling the
    /// service for, until the first `LockLayer` on the way takes it: that
    /// layer reschedules the job in place when it defers into the job's own
    /// queue, instead of pushing a copy. Layers further down (a handler's
    /// own calls through another `LockLayer`) find the slot empty and treat
    /// their requests as the new messages they are.
    static RUNNING: RefCell<Option<RunningJob>>;

    /// The id a consumer gave the message it is calling the service for
    /// (see `layer::with_message_id`), until the first `LockLayer` on the
    /// way takes it: a deferral of that layer pushes the message under it.
    static MESSAGE_ID: RefCell<Option<String>>;
}

/// What the first lock or rate layer a request passes takes in its `call`:
/// the worker's running job, and the id a consumer gave the message. Handed
/// on to the layers inside when that layer did not need them.
#[derive(Debug, Default)]
pub(crate) struct Handoff {
    /// The claim a worker is running.
    pub(crate) job: Option<RunningJob>,
    /// The id to push the request under if it is deferred as a new message.
    pub(crate) id: Option<String>,
}

impl Handoff {
    /// Takes what the current call was handed.
    pub(crate) fn take() -> Self {
        Self {
            job: RunningJob::take(),
            id: take_message_id(),
        }
    }

    /// Calls `f` with what this handoff holds available to [`Handoff::take`].
    pub(crate) fn provide<R>(self, f: impl FnOnce() -> R) -> R {
        let Self { job, id } = self;
        RunningJob::provide(job, || MESSAGE_ID.sync_scope(RefCell::new(id), f))
    }
}

/// Calls `f` with `id` available to the first layer that takes it.
pub(crate) fn provide_message_id<R>(id: String, f: impl FnOnce() -> R) -> R {
    MESSAGE_ID.sync_scope(RefCell::new(Some(id)), f)
}

/// Takes the id the current call's message was given, if no one took it.
pub(crate) fn take_message_id() -> Option<String> {
    MESSAGE_ID
        .try_with(|slot| slot.borrow_mut().take())
        .ok()
        .flatten()
}

/// The right to reschedule the claim a worker is running: what an in-place
/// deferral needs to know of the job. Made only by the worker, taken once.
#[derive(Debug)]
pub(crate) struct RunningJob {
    /// The queue it was claimed from.
    pub(crate) queue: Arc<QueueKeys>,
    /// Its claim (id and claim number): the job's identity.
    pub(crate) token: ClaimToken,
    /// Deferrals before this delivery.
    pub(crate) deferrals: u32,
}

impl RunningJob {
    pub(crate) fn of<T>(job: &Job<T>) -> Self {
        Self {
            queue: job.queue_keys().clone(),
            token: job.claim_ref().to_token(),
            deferrals: job.deferrals(),
        }
    }

    /// Takes the job the current task's worker is running, if no one took
    /// it before.
    pub(crate) fn take() -> Option<Self> {
        RUNNING
            .try_with(|slot| slot.borrow_mut().take())
            .ok()
            .flatten()
    }

    /// Calls `f` with `job` (if any) available to [`RunningJob::take`].
    pub(crate) fn provide<R>(job: Option<Self>, f: impl FnOnce() -> R) -> R {
        RUNNING.sync_scope(RefCell::new(job), f)
    }
}
