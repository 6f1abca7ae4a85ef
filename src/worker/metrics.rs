//! Counters of what a worker did; also recorded through the `metrics`
//! facade (see [`crate::telemetry`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use crate::telemetry::QueueInstruments;

/// A handle on a [`Worker`](super::Worker)'s counters. Cloning shares them.
#[derive(Clone, Default)]
pub struct Metrics(Arc<Counters>);

#[derive(Default)]
struct Counters {
    /// The facade's instruments, registered when the worker starts.
    instruments: OnceLock<QueueInstruments>,
    /// Indexed by [`Count`].
    counts: [AtomicU64; Count::RedisErrors as usize + 1],
}

/// One of the counters (see [`MetricsSnapshot`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    Claimed,
    Done,
    Retried,
    Deferred,
    Dead,
    LostLeases,
    Unconfirmed,
    Recovered,
    RedisErrors,
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
    /// Messages deferred because their lock was busy: rescheduled in place
    /// (a `LockLayer` over the `Job`), or pushed as a new message (a layer
    /// over the payload, or deferring into another queue) and the original
    /// acknowledged.
    pub deferred: u64,
    /// Messages moved to the dead letters (failed for the last time, too
    /// many deferrals, or undecodable).
    pub dead: u64,
    /// Messages whose lease ran out while this worker held them (the server
    /// confirmed the claim was no longer this worker's): they are, or were,
    /// handled again.
    pub lost_leases: u64,
    /// Settlements (retry, dead letter) whose first attempt failed in
    /// transport and whose resend the server refused: the earlier attempt
    /// may have been applied (its reply was lost), or the lease ran out in
    /// between. Not counted as lost leases (an ack in that situation is
    /// decided by what the server holds: see docs/worker.md, "The worker").
    pub unconfirmed: u64,
    /// Messages of dead workers recovered (requeued or buried) by this one.
    pub recovered: u64,
    /// Redis errors met (each followed by a pause or a retry).
    pub redis_errors: u64,
}

impl Metrics {
    /// Reads all counters.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let c = |count: Count| self.0.counts[count as usize].load(Relaxed);
        MetricsSnapshot {
            claimed: c(Count::Claimed),
            done: c(Count::Done),
            retried: c(Count::Retried),
            deferred: c(Count::Deferred),
            dead: c(Count::Dead),
            lost_leases: c(Count::LostLeases),
            unconfirmed: c(Count::Unconfirmed),
            recovered: c(Count::Recovered),
            redis_errors: c(Count::RedisErrors),
        }
    }

    /// Registers the facade's instruments for `queue` (once: a worker's
    /// handle may be shared by workers of the same queue).
    pub(crate) fn register(&self, queue: &str) {
        self.0
            .instruments
            .get_or_init(|| QueueInstruments::register(queue));
    }

    pub(crate) fn instruments(&self) -> Option<&QueueInstruments> {
        self.0.instruments.get()
    }

    pub(crate) fn count(&self, count: Count) {
        self.add(count, 1);
    }

    /// Adds `n` to a counter, and to its instrument if it has one.
    pub(crate) fn add(&self, count: Count, n: u64) {
        self.0.counts[count as usize].fetch_add(n, Relaxed);
        let Some(i) = self.instruments() else { return };
        let instrument = match count {
            Count::Claimed => &i.claimed,
            Count::Done => &i.done,
            Count::Retried => &i.retried,
            Count::Deferred => &i.deferred,
            Count::Dead => &i.dead,
            Count::LostLeases => &i.lost_leases,
            Count::Recovered => &i.recovered,
            Count::RedisErrors => &i.redis_errors,
            Count::Unconfirmed => return,
        };
        instrument.increment(n);
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Metrics").field(&self.snapshot()).finish()
    }
}
