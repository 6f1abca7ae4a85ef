//! Metrics through the [`metrics`] facade: lockgate records, the
//! application chooses the exporter (Prometheus, OpenTelemetry, StatsD…)
//! by installing a recorder. Without one, recording costs next to nothing.
//!
//! Instruments are registered when first needed (a worker's when it
//! starts, a layer's at its first call): install the recorder before that.
//! Labels are bounded: the queue's name, a strategy's outcome, a state;
//! never a lock key or a message id.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `lockgate_messages_claimed_total`, `_done_total`, `_retried_total`, `_deferred_total`, `_dead_total`, `_recovered_total` | counters | `queue` | what workers did with messages (a move into a key's line counts in `deferred`, stalled too often in `dead`) |
//! | `lockgate_leases_lost_total`, `lockgate_redis_errors_total` | counters | `queue` | claims that ran out while their handler ran; Redis errors a worker met |
//! | `lockgate_handler_duration_seconds` | histogram | `queue` | the service call, claim to outcome |
//! | `lockgate_due_lag_seconds` | histogram | `queue` | from a message's due time (server clock) to its handler's start (this host's clock) |
//! | `lockgate_queue_messages` | gauge | `queue`, `state` (`due`, `later`, `active`, `dead`) | sampled by each worker (`Worker::sample_every`) |
//! | `lockgate_queue_shard_messages` | gauge | `queue`, `shard`, `state` | each shard's messages without a key, when asked (`Worker::sample_shards`) |
//! | `lockgate_lock_acquired_total` | counter | — | locks and permits a `LockLayer` took |
//! | `lockgate_lock_contended_total` | counter | `outcome` (`acquired`, `failed`, `deferred`) | calls that found their key busy, by how they ended |
//! | `lockgate_lock_wait_seconds` | histogram | — | how long a call that found its key busy waited for it (`retry`) |
//! | `lockgate_locks_lost_total` | counter | — | locks lost while their handler ran |

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

/// A worker's instruments, for one queue.
pub(crate) struct QueueInstruments {
    pub(crate) claimed: Counter,
    pub(crate) done: Counter,
    pub(crate) retried: Counter,
    pub(crate) deferred: Counter,
    pub(crate) dead: Counter,
    pub(crate) lost_leases: Counter,
    pub(crate) recovered: Counter,
    pub(crate) redis_errors: Counter,
    pub(crate) handler: Histogram,
    pub(crate) due_lag: Histogram,
    /// Messages by state: due, later, active, dead.
    pub(crate) depth: [Gauge; 4],
}

impl QueueInstruments {
    pub(crate) fn register(queue: &str) -> Self {
        let queue: Arc<str> = Arc::from(queue);
        let q = || queue.clone();
        let state = |state: &'static str| gauge!("lockgate_queue_messages", "queue" => q(), "state" => state);
        Self {
            claimed: counter!("lockgate_messages_claimed_total", "queue" => q()),
            done: counter!("lockgate_messages_done_total", "queue" => q()),
            retried: counter!("lockgate_messages_retried_total", "queue" => q()),
            deferred: counter!("lockgate_messages_deferred_total", "queue" => q()),
            dead: counter!("lockgate_messages_dead_total", "queue" => q()),
            lost_leases: counter!("lockgate_leases_lost_total", "queue" => q()),
            recovered: counter!("lockgate_messages_recovered_total", "queue" => q()),
            redis_errors: counter!("lockgate_redis_errors_total", "queue" => q()),
            handler: histogram!("lockgate_handler_duration_seconds", "queue" => q()),
            due_lag: histogram!("lockgate_due_lag_seconds", "queue" => q()),
            depth: [state("due"), state("later"), state("active"), state("dead")],
        }
    }
}

/// Sets each shard's depth gauges (shard `i`: `each[i]`).
pub(crate) fn shard_depth(queue: &str, each: &[crate::queue::Stats]) {
    for (shard, stats) in each.iter().enumerate() {
        let counts = [stats.due, stats.later, stats.active, stats.dead];
        for (state, n) in ["due", "later", "active", "dead"].into_iter().zip(counts) {
            let labels = [
                ("queue", queue.to_owned()),
                ("shard", shard.to_string()),
                ("state", state.to_owned()),
            ];
            gauge!("lockgate_queue_shard_messages", &labels).set(n as f64);
        }
    }
}

/// A `LockLayer`'s instruments.
pub(crate) struct LockInstruments {
    pub(crate) acquired: Counter,
    pub(crate) acquired_after_wait: Counter,
    pub(crate) failed: Counter,
    pub(crate) deferred: Counter,
    pub(crate) wait: Histogram,
    pub(crate) lost: Counter,
}

impl LockInstruments {
    /// Counts a call that gave up on its busy key, by the strategy's
    /// answer, and passes the answer on.
    pub(crate) fn gave_up<T, E>(&self, answer: Result<T, E>) -> Result<T, E> {
        match &answer {
            Err(_) => self.failed.increment(1),
            Ok(_) => self.deferred.increment(1),
        }
        answer
    }

    pub(crate) fn register() -> Self {
        let contended =
            |outcome: &'static str| counter!("lockgate_lock_contended_total", "outcome" => outcome);
        Self {
            acquired: counter!("lockgate_lock_acquired_total"),
            acquired_after_wait: contended("acquired"),
            failed: contended("failed"),
            deferred: contended("deferred"),
            wait: histogram!("lockgate_lock_wait_seconds"),
            lost: counter!("lockgate_locks_lost_total"),
        }
    }
}
