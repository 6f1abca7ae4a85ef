//! The worker's background tasks: lease renewal, recovery of expired
//! leases and the sweep for unindexed keyed partitions (each in turn with
//! the queue's other workers), depth sampling, and the warning about an
//! evicting server.

use std::sync::Arc;
use std::time::Duration;

use super::metrics::Count;
use super::{Conn, Metrics, Payload, Shared};
use crate::queue::{Connector, HEAL_EVERY, Queue};

/// Sets the queue's depth gauges every `every` (see `Worker::sample_every`),
/// and each shard's when `shards` (see `Worker::sample_shards`).
pub(super) async fn sample_depth<T: Payload, C: Conn>(
    queue: Queue<T, C>,
    metrics: Metrics,
    (every, shards): (Duration, bool),
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let stats = match shards {
            true => (queue.stats_by_shard().await).map(|(stats, each)| {
                crate::telemetry::shard_depth(queue.name(), &each);
                stats
            }),
            // One reading per period between the queue's workers.
            false => queue.recent_stats(every).await,
        };
        match stats {
            Ok(stats) => {
                if let Some(instruments) = metrics.instruments() {
                    let counts = [stats.due, stats.later, stats.active, stats.dead];
                    for (gauge, n) in instruments.depth.iter().zip(counts) {
                        gauge.set(n as f64);
                    }
                }
            }
            Err(error) => {
                metrics.count(Count::RedisErrors);
                tracing::debug!(%error, "could not sample the queue's depth");
            }
        }
    }
}

/// Renews the leases of in-flight messages every third of the lease.
pub(super) async fn renew_leases<T: Payload, C: Conn>(shared: Arc<Shared<T, C>>) {
    let mut ticks = tokio::time::interval(shared.config.lease / 3);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        shared.renew_in_flight().await;
    }
}

/// Recovers expired leases of dead workers every third of the lease, in
/// turn with the queue's other workers: one sweep per tick between them.
pub(super) async fn recover_expired<T: Payload, C: Conn>(shared: Arc<Shared<T, C>>) {
    let every = shared.config.lease / 3;
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let max_stalls = shared.config.max_stalls;
        match shared.queue.recover_in_turn(max_stalls, every).await {
            Ok(recovered) => {
                let n = recovered.requeued + recovered.buried;
                shared.metrics.add(Count::Recovered, n as u64);
                shared.metrics.add(Count::Dead, recovered.buried as u64);
            }
            Err(error) => {
                shared.metrics.count(Count::RedisErrors);
                tracing::warn!(%error, "could not recover expired leases");
            }
        }
    }
}

/// Looks for keyed partitions missing from the queue's index (a producer
/// stopped between its push and its index step), in turn with the queue's
/// other workers, at most every [`HEAL_EVERY`] (or the recovery's period,
/// when longer). The sweep's thousands of requests go over a connection of
/// its own, opened by the worker's connector: they never wait behind the
/// worker's claims and renewals, nor hold those up. A sweep that fails or
/// outlasts its period drops its connection; the next opens another.
pub(super) async fn heal_index<T: Payload, C: Conn, K: Connector>(
    shared: Arc<Shared<T, C>>,
    connector: K,
) {
    let every = shared.config.lease / 3;
    let period = every.max(HEAL_EVERY);
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut conn = None;
    loop {
        ticks.tick().await;
        let c = match conn.take() {
            Some(c) => c,
            None => match connector.connect().await {
                Ok(c) => c,
                Err(error) => {
                    tracing::warn!(%error, "could not connect to look for unindexed keyed partitions");
                    continue;
                }
            },
        };
        let sweep = tokio::time::timeout(period, shared.queue.heal_in_turn(&c, every)).await;
        match sweep {
            Ok(Ok(_)) => conn = Some(c),
            Ok(Err(error)) => {
                shared.metrics.count(Count::RedisErrors);
                tracing::warn!(%error, "could not look for unindexed keyed partitions");
            }
            Err(_) => tracing::warn!(
                "looking for unindexed keyed partitions took over {period:?}: given up until the next turn"
            ),
        }
    }
}

/// Warns when the server may evict keys: an evicted queue key loses messages.
pub(super) async fn warn_on_eviction<T: Payload, C: Conn>(queue: &Queue<T, C>) {
    match crate::lock::EvictionPolicy::read(&mut queue.connection().clone()).await {
        Ok(policy) if policy.may_evict_locks() => tracing::warn!(
            policy = policy.name(),
            "the server's maxmemory-policy is not `noeviction` and maxmemory is set: under memory pressure Redis may evict queue keys and lose messages"
        ),
        Ok(_) => {}
        Err(error) => tracing::debug!(%error, "could not read maxmemory-policy"),
    }
}
