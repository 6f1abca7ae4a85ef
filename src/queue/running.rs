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
//! The worker offers the claim for the whole of the call: while it calls
//! the service, and while it polls the future the call returned, on the
//! worker's task. During `call`, the first `LockLayer` (or
//! `RateLimitLayer`) that needs a lock for the request takes it (the request
//! passing through `map_request` and the like). From the future, where a
//! middleware that calls its inner service later (an `async` wrapper,
//! `and_then`, `ServiceExt::oneshot` in a `service_fn`) and a handler's own
//! calls both come from, a layer takes it only once the job's payload was
//! taken out of it ([`Job::into_payload`](crate::Job::into_payload), as
//! `map_request(|job: Job<T>| job.into_payload())` does): that request is
//! the job. A handler that forwards a copy of its payload (or any other
//! message) through a `LockLayer` keeps its job, and the forwarded message
//! is pushed as the new message it is. Once taken, the slot is empty. A
//! layer that took it and did not need it (it does not defer into the job's
//! queue), or that needs no lock for this request, hands it on to the
//! layers it wraps, but only while it calls them (synchronously): never to
//! the handler's own calls.
//!
//! What the claim cannot reach: a service that calls its inner service on
//! another task (tower's `Buffer`), a layer behind a middleware that calls
//! later and clones the payload instead of taking it out, and a layer
//! wrapped by another lock layer through a middleware that calls later. A
//! deferral there pushes a copy under a new id (its counts start again,
//! fields the payload type does not know are lost) and the worker
//! acknowledges the original; when no layer took its claim, the worker
//! counts it as [`copied`](crate::worker::MetricsSnapshot::copied), with a
//! warning. A `LockLayer` whose request is the `Job<T>` itself needs none of
//! this: the job carries its claim.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::job::Job;
use super::{Claim, ClaimToken, QueueKeys};

tokio::task_local! {
    /// The claim of the job a [`Worker`](crate::Worker) is running, until
    /// the first `LockLayer` on the way takes it: that layer reschedules the
    /// job in place when it defers into the job's own queue, instead of
    /// pushing a copy. Layers further down (a handler's own calls through
    /// another `LockLayer`) find the slot empty and treat their requests as
    /// the new messages they are.
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
        // Held for one `Option::take`: nothing can poison it.
        let mut job = self.shared.job.lock().unwrap_or_else(|e| e.into_inner());
        job.take()
    }

    /// Takes the claim whatever the request (the worker, once the call is
    /// over: `Some` means no layer took it).
    pub(crate) fn take_back(&self) -> Option<RunningJob> {
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
