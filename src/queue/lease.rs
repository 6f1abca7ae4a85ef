//! Renewing the leases of claimed messages: in one call per batch of
//! messages without a key (per shard), and for keyed ones in calls of many
//! partitions on one server (of one slot on a cluster), sent together over
//! the multiplexed connection, so that a failing shard or slot holds up
//! none of the others.

use std::collections::BTreeMap;
use std::time::Duration;

use futures_util::StreamExt;

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::keyed::{Held, Keyed, Layout};
use super::scripts::{self, Query};
use super::{Claim, ClaimToken, MAX_BATCH, Queue, by_shard, check_lease, token};
use crate::error::{Error, Result};
use crate::lock::millis;

/// How many keyed messages one renewal call renews at most, on one server:
/// a few commands each, a millisecond or two of the server's time a call.
const EXTEND_BLOCKS: usize = 256;

/// Keyed renewal calls in flight at once (on a cluster, a call per slot).
const CALLS_AT_ONCE: usize = 64;

/// What a renewal found, per message: `Some(held)` when the server
/// answered, `None` when its call failed (its error is among `errors`).
#[derive(Debug, Default)]
pub(crate) struct Renewed {
    pub(crate) held: Vec<Option<bool>>,
    pub(crate) errors: Vec<Error>,
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Renews the leases of claimed messages to run `lease` from now, in one
    /// round trip per [`MAX_BATCH`] messages without a key; keyed messages'
    /// renewals are sent together. Returns, per message, whether its claim
    /// was still held; every message is tried, and the first error is
    /// returned when any call failed.
    pub async fn extend<'a, J, I>(&self, jobs: I, lease: Duration) -> Result<Vec<bool>>
    where
        J: Claim + 'a,
        I: IntoIterator<Item = &'a J>,
    {
        check_lease(lease)?;
        let jobs: Vec<&ClaimToken> = jobs.into_iter().map(token).collect();
        let renewed = self.renew(&jobs, lease).await;
        match renewed.errors.into_iter().next() {
            Some(error) => Err(error),
            None => Ok(renewed.held.into_iter().map(|h| h == Some(true)).collect()),
        }
    }

    /// Renews `jobs`' leases; a call that fails leaves its messages `None`
    /// and the others renewed.
    pub(crate) async fn renew(&self, jobs: &[&ClaimToken], lease: Duration) -> Renewed {
        let mut renewed = Renewed {
            held: vec![None; jobs.len()],
            errors: Vec::new(),
        };
        for (shard, plain) in by_shard(jobs) {
            for batch in plain.chunks(MAX_BATCH) {
                match self.renew_plain(shard, batch, lease).await {
                    Ok(held) => {
                        for ((n, _), held) in batch.iter().zip(held) {
                            renewed.held[*n] = Some(held);
                        }
                    }
                    Err(error) => renewed.errors.push(error),
                }
            }
        }
        self.renew_keyed(jobs, lease, &mut renewed).await;
        renewed
    }

    /// Renews `jobs`' keyed messages into `renewed` (see [`keyed_calls`]),
    /// all calls at once.
    async fn renew_keyed(&self, jobs: &[&ClaimToken], lease: Duration, renewed: &mut Renewed) {
        let keyed: Vec<(usize, Turn<'_>)> = (jobs.iter().enumerate())
            .filter_map(|(n, job)| Some((n, (&**job.held.as_ref()?, &job.id[..], job.claim))))
            .collect();
        if keyed.is_empty() {
            return;
        }
        let conn = &self.keyed();
        let groups = match conn.layout().await {
            Ok(layout) => keyed_calls(keyed, layout),
            Err(error) => return renewed.errors.push(error),
        };
        let calls: Vec<_> = (groups.iter())
            .map(|group| {
                let turns: Vec<Turn<'_>> = group.iter().map(|(_, turn)| *turn).collect();
                async move { extend_group(conn, &turns, lease).await }
            })
            .collect();
        // On a cluster a call per slot: a window of them at a time, lest
        // the last wait past a response timeout behind the first.
        let answers: Vec<Vec<Result<bool>>> = futures_util::stream::iter(calls)
            .buffered(CALLS_AT_ONCE)
            .collect()
            .await;
        for (group, answers) in groups.iter().zip(answers) {
            for ((n, _), answer) in group.iter().zip(answers) {
                match answer {
                    Ok(held) => renewed.held[*n] = Some(held),
                    Err(error) => renewed.errors.push(error),
                }
            }
        }
    }

    /// Renews one batch of shard `shard`'s messages without a key.
    async fn renew_plain(
        &self,
        shard: usize,
        batch: &[(usize, &ClaimToken)],
        lease: Duration,
    ) -> Result<Vec<bool>> {
        let attempted = || format!("extending leases in queue `{}`", self.name());
        let active = &self.shards.get(shard)?.active;
        let members: Vec<String> = batch.iter().map(|(_, j)| j.member()).collect();
        let held: Vec<i64> = scripts::EXTEND
            .key(active)
            .arg(millis(lease))
            .arg(&members)
            .query_on(&self.conn, attempted)
            .await?;
        if held.len() != batch.len() {
            let detail = format_args!("{} values for {} leases", held.len(), batch.len());
            return Err(Error::reply(attempted(), detail));
        }
        Ok(held.into_iter().map(|held| held == 1).collect())
    }
}

/// Renews `turns` in one call; if it fails, each alone, once: one
/// partition's failure (a damaged key, say) must not cost the others their
/// leases. Per turn, whether its claim was held.
async fn extend_group<C>(
    conn: &Keyed<'_, C>,
    turns: &[Turn<'_>],
    lease: Duration,
) -> Vec<Result<bool>>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match conn.extend(turns, lease).await {
        Ok(held) => held.into_iter().map(Ok).collect(),
        Err(error) if turns.len() == 1 => vec![Err(error)],
        Err(error) => {
            tracing::debug!(%error, messages = turns.len(), "a keyed renewal call failed; renewing its messages one by one");
            let alone = turns
                .iter()
                .map(|turn| conn.extend(std::slice::from_ref(turn), lease));
            let answers = futures_util::future::join_all(alone).await;
            let held = |answer: Result<Vec<bool>>| answer.map(|held| held.first() == Some(&true));
            answers.into_iter().map(held).collect()
        }
    }
}

/// A keyed message's renewal: its hold, its id and its claim.
type Turn<'a> = (&'a Held, &'a str, u64);

/// Keyed renewals grouped into script calls: on one server up to
/// [`EXTEND_BLOCKS`] messages a call, whatever their partitions; on a
/// cluster, where a script reaches one slot, a call per slot's messages.
fn keyed_calls(keyed: Vec<(usize, Turn<'_>)>, layout: Layout) -> Vec<Vec<(usize, Turn<'_>)>> {
    let mut by_slot: BTreeMap<u16, Vec<(usize, Turn<'_>)>> = BTreeMap::new();
    for (n, turn) in keyed {
        let slot = match layout {
            Layout::Server => 0,
            Layout::Cluster => turn.0.partition.slot,
        };
        by_slot.entry(slot).or_default().push((n, turn));
    }
    let chunks = |turns: Vec<_>| {
        turns
            .chunks(EXTEND_BLOCKS)
            .map(<[_]>::to_vec)
            .collect::<Vec<_>>()
    };
    by_slot.into_values().flat_map(chunks).collect()
}
