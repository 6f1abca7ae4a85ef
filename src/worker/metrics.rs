//! Counters of what a worker did; also recorded through the `metrics`
//! facade (see [`crate::telemetry`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use crate::telemetry::QueueInstruments;

/// A handle on a [`Worker`](super::Worker)'s counters. Cloning shares them.
#[derive(Debug, Clone, Default)]
pub struct Metrics(Arc<Counters>);

#[derive(Default)]
struct Counters {
    /// The facade's instruments, registered when the worker starts.
    instruments: OnceLock<QueueInstruments>,
    claimed: AtomicU64,
    done: AtomicU64,
    retried: AtomicU64,
    deferred: AtomicU64,
    copied: AtomicU64,
    dead: AtomicU64,
    lost_leases: AtomicU64,
    unconfirmed: AtomicU64,
    recovered: AtomicU64,
    redis_errors: AtomicU64,
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Messages claimed.
    pub claimed: u64,
    /// Messages handled successfully and acknowledged.
    pub done: u64,
    /// Failed messages scheduled for another attempt.
    pub retried: u64,
    /// Messages deferred because their lock was busy.
    pub deferred: u64,
    /// Deferred messages that were pushed as a copy under a new id (their
    /// counts starting again) because no `LockLayer` on the worker's task
    /// took the claim: the deferral ran on another task, behind tower's
    /// `Buffer` for example (see the [`layer`](crate::layer) docs). Counted
    /// in `deferred` too. Zero in a pipeline that defers in place.
    pub copied: u64,
    /// Messages moved to the dead letters (failed for the last time, too
    /// many deferrals, or undecodable).
    pub dead: u64,
    /// Messages whose lease ran out while this worker held them: the
    /// server confirmed that the claim was no longer this worker's (the
    /// message went back to the schedule, or to another worker), so the
    /// message is (or was) handled again.
    pub lost_leases: u64,
    /// Settlements (retry, dead letter) whose first attempt failed in
    /// transport and whose resend the server refused: the earlier attempt
    /// may have been applied (its reply was lost), or the lease ran out in
    /// between. Not counted as lost leases. An ack in that situation is
    /// decided by what the server holds (the message is gone: done, unless
    /// the outage outlasted the lease and another worker completed it; still
    /// there under another claim: a lost lease).
    pub unconfirmed: u64,
    /// Messages of dead workers recovered (requeued or buried) by this one.
    pub recovered: u64,
    /// Redis errors met (each followed by a pause or a retry).
    pub redis_errors: u64,
}

impl Metrics {
    /// Reads all counters.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let c = &self.0;
        MetricsSnapshot {
            claimed: c.claimed.load(Relaxed),
            done: c.done.load(Relaxed),
            retried: c.retried.load(Relaxed),
            deferred: c.deferred.load(Relaxed),
            copied: c.copied.load(Relaxed),
            dead: c.dead.load(Relaxed),
            lost_leases: c.lost_leases.load(Relaxed),
            unconfirmed: c.unconfirmed.load(Relaxed),
            recovered: c.recovered.load(Relaxed),
            redis_errors: c.redis_errors.load(Relaxed),
        }
    }

    /// Registers the facade's instruments for `queue` (once: a worker's
    /// handle may be shared by workers of the same queue).
    pub(crate) fn register(&self, queue: &str) {
        self.0
            .instruments
            .get_or_init(|| QueueInstruments::register(queue));
    }

    /// The facade's instruments, once registered.
    pub(crate) fn instruments(&self) -> Option<&QueueInstruments> {
        self.0.instruments.get()
    }

    fn record(&self, f: impl FnOnce(&QueueInstruments)) {
        if let Some(instruments) = self.0.instruments.get() {
            f(instruments);
        }
    }

    pub(crate) fn add_claimed(&self, n: u64) {
        self.0.claimed.fetch_add(n, Relaxed);
        self.record(|i| i.claimed.increment(n));
    }
    pub(crate) fn count_done(&self) {
        self.0.done.fetch_add(1, Relaxed);
        self.record(|i| i.done.increment(1));
    }
    pub(crate) fn count_retried(&self) {
        self.0.retried.fetch_add(1, Relaxed);
        self.record(|i| i.retried.increment(1));
    }
    pub(crate) fn count_deferred(&self) {
        self.0.deferred.fetch_add(1, Relaxed);
        self.record(|i| i.deferred.increment(1));
    }
    pub(crate) fn count_copied(&self) {
        self.0.copied.fetch_add(1, Relaxed);
    }
    pub(crate) fn add_dead(&self, n: u64) {
        self.0.dead.fetch_add(n, Relaxed);
        self.record(|i| i.dead.increment(n));
    }
    pub(crate) fn count_lost_lease(&self) {
        self.0.lost_leases.fetch_add(1, Relaxed);
        self.record(|i| i.lost_leases.increment(1));
    }
    pub(crate) fn count_unconfirmed(&self) {
        self.0.unconfirmed.fetch_add(1, Relaxed);
    }
    pub(crate) fn add_recovered(&self, n: u64) {
        self.0.recovered.fetch_add(n, Relaxed);
        self.record(|i| i.recovered.increment(n));
    }
    pub(crate) fn count_error(&self) {
        self.0.redis_errors.fetch_add(1, Relaxed);
        self.record(|i| i.redis_errors.increment(1));
    }
}

impl std::fmt::Debug for Counters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counters")
            .field("claimed", &self.claimed)
            .field("done", &self.done)
            .field("dead", &self.dead)
            .finish_non_exhaustive()
    }
}
