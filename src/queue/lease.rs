//! Renewing the leases of claimed messages: in one call per batch of
//! messages without a key (per shard), and all at once for keyed ones (one
//! script each, sent together over the multiplexed connection), so that a
//! failing shard or partition holds up none of the others.

use std::time::Duration;

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::scripts::{self, Query};
use super::{Claim, ClaimToken, MAX_BATCH, Queue, by_shard, check_lease, token};
use crate::error::{Error, Result};
use crate::lock::millis;

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
        let keyed: Vec<(usize, &ClaimToken)> = (jobs.iter().copied().enumerate())
            .filter(|(_, job)| job.held.is_some())
            .collect();
        let conn = self.keyed();
        for batch in keyed.chunks(MAX_BATCH) {
            let calls = batch.iter().map(|(_, job)| {
                let held = job.held.as_ref().expect("filtered on held");
                conn.extend(held, (&job.id, job.claim), lease)
            });
            let answers = futures_util::future::join_all(calls).await;
            for ((n, _), answer) in batch.iter().zip(answers) {
                match answer {
                    Ok(held) => renewed.held[*n] = Some(held),
                    Err(error) => renewed.errors.push(error),
                }
            }
        }
        renewed
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
