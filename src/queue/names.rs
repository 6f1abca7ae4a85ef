//! The prefix's list of queues: each handle joins it before its first
//! push or claim, and [`queue_names`] reads it, never scanning the
//! keyspace.

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::scripts::Query;
use super::{QUEUE_KEYS, Queue, QueueKeys, named};
use crate::error::Result;

/// The names of the queues under `prefix` (`"lockgate"` by default) that
/// have any key in Redis, sorted: those of the prefix's list of queues
/// (`<prefix>:queues`, a set each handle adds its queue's name to before
/// its first push or claim) whose own keys exist. Two round trips whatever
/// the keys: one command per listed name, never a scan of the keyspace. On
/// a Redis Cluster, call it with the cluster connection.
///
/// A queue only a producer of another language pushes to (through
/// `scripts/push.lua`) is listed once a handle of this library claimed
/// from it or pushed to it; a name stays in the list after its queue is
/// gone (left out here while it holds nothing).
pub async fn queue_names<C>(conn: &C, prefix: &str) -> Result<Vec<String>>
where
    C: ConnectionLike + Clone + Send,
{
    crate::keys::check_prefix(prefix)?;
    let attempted = || format!("listing the queues under `{prefix}`");
    let mut listed: Vec<String> = redis::Cmd::smembers(registry(prefix))
        .query_on(conn, attempted)
        .await?;
    listed.sort();
    if listed.is_empty() {
        return Ok(listed);
    }
    // Each name's keys are in one slot (its tag): one EXISTS each, all in
    // flight together (not one pipeline: a cluster refuses one whose
    // commands go to several slots).
    let exists = listed.iter().map(|name| {
        let keys = QueueKeys::new(prefix, name);
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(&named(&keys.base, QUEUE_KEYS));
        async move { cmd.query_on::<u32, _>(conn, attempted).await }
    });
    let found = futures_util::future::try_join_all(exists).await?;
    let pairs = listed.into_iter().zip(found);
    Ok(pairs
        .filter(|(_, n)| *n > 0)
        .map(|(name, _)| name)
        .collect())
}

/// The set of the queue names under `prefix` (see [`queue_names`]).
fn registry(prefix: &str) -> String {
    format!("{prefix}:queues")
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Puts the queue's name in its prefix's list of queues (see
    /// [`queue_names`]), once per handle and its clones: before their first
    /// push or claim. Tried once: a failure (an ACL without `SADD`, say) is
    /// logged, and the push or claim goes on; the queue is listed once
    /// another handle put it there.
    pub(crate) async fn register(&self) {
        let add = || async {
            let attempted = || format!("listing queue `{}` under its prefix", self.name());
            let added = redis::Cmd::sadd(registry(&self.keys.prefix), &self.keys.name)
                .query_on::<(), _>(&self.conn, attempted)
                .await;
            if let Err(error) = added {
                tracing::warn!(queue = %self.name(), %error, "could not add the queue to its prefix's list of queues (`lockgate queues`); it works on unlisted");
            }
        };
        self.shards.registered.get_or_init(add).await;
    }
}
