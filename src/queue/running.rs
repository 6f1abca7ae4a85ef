//! The claim of the job a [`Worker`](crate::Worker) is running, handed to
//! the first [`LockLayer`](crate::LockLayer) its request passes, so that a
//! layer over the payload alone (`map_request(|job: Job<T>|
//! job.into_payload())`) can defer the job in place: same id, counts and
//! stored bytes, identified by the claim, never by comparing payloads. From
//! the call's future a layer takes it only once the payload was taken out
//! of the job, so a handler's own calls never take it. The README's "How
//! in-place deferral finds the job" has the whole of it.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::job::Job;
use super::{Claim, ClaimToken, QueueKeys};

tokio::task_local! {
    /// The claim of the job a worker is running, until the first
    /// `LockLayer` on the way takes it; layers further down (a handler's
    /// own calls) find it empty and push their requests as new messages.
    static RUNNING: Slot;

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

    /// Calls `f` with what this handoff holds available to [`Handoff::take`]
    /// while `f` runs (not while the future it returns is polled: that is
    /// where a handler makes calls of its own).
    pub(crate) fn provide<R>(self, f: impl FnOnce() -> R) -> R {
        let Self { job, id } = self;
        RUNNING.sync_scope(Slot::new(job), || {
            MESSAGE_ID.sync_scope(RefCell::new(id), f)
        })
    }
}

/// Where a worker offers the claim it is running, for the whole call (see
/// the module's documentation). Shared by the worker, the job (which says
/// when its payload is taken out) and the task-local, so that the worker
/// learns afterwards whether a layer took it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Slot {
    shared: Arc<Offer>,
    /// Offered while the worker's future is polled, where a handler's own
    /// calls come from too: there only a request that is the job's own
    /// payload (taken out with `Job::into_payload`) may take the claim.
    from_future: bool,
}

#[derive(Debug, Default)]
struct Offer {
    /// The claim, until a layer takes it.
    job: Mutex<Option<RunningJob>>,
    /// The job's payload was taken out (`Job::into_payload`): it travels on
    /// as a request of its own, and is the job.
    payload_out: AtomicBool,
}

impl Slot {
    pub(crate) fn new(job: Option<RunningJob>) -> Self {
        Self {
            shared: Arc::new(Offer {
                job: Mutex::new(job),
                payload_out: AtomicBool::new(false),
            }),
            from_future: false,
        }
    }

    /// Calls `f` with this slot offered to [`RunningJob::take`].
    pub(crate) fn provide<R>(&self, f: impl FnOnce() -> R) -> R {
        RUNNING.sync_scope(self.clone(), f)
    }

    /// Offers this slot to [`RunningJob::take`] while `call` is polled, to
    /// the job's own payload only (see [`Slot::from_future`]).
    pub(crate) fn scope<F: Future>(&self, call: F) -> impl Future<Output = F::Output> + use<F> {
        let slot = Self {
            shared: self.shared.clone(),
            from_future: true,
        };
        RUNNING.scope(slot, call)
    }

    /// Notes that the job's payload was taken out (`Job::into_payload`).
    pub(crate) fn hand_over_payload(&self) {
        self.shared.payload_out.store(true, Ordering::Release);
    }

    /// Takes what the slot holds: `None` once a layer took it, and, from
    /// the worker's future, while the job's payload was not taken out (the
    /// request is then another message: a handler forwarding a copy).
    pub(crate) fn take(&self) -> Option<RunningJob> {
        if self.from_future && !self.shared.payload_out.load(Ordering::Acquire) {
            return None;
        }
        self.take_back()
    }

    /// Takes the claim whatever the request (the worker, once the call is
    /// over: `Some` means no layer took it).
    pub(crate) fn take_back(&self) -> Option<RunningJob> {
        // Held for one `Option::take`: nothing can poison it.
        let mut job = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
        job.take()
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
        RUNNING.try_with(Slot::take).ok().flatten()
    }
}
