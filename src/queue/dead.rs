//! Dead letters: listed a page at a time by cursor, re-driven one by one
//! or all at once.
//!
//! A page starts after a [`DeadCursor`], the (burial time, id) of the last
//! letter of the page before, and each dead set (a shard's, a keyed
//! partition's) is read from there: `dead.lua` finds the cursor's place by
//! rank (`O(log n)`) and reads the page's letters (`O(limit)`), however
//! many letters lie before it. A page at offset 100,000 of a million read
//! every letter before it and blocked the server half a second (issue 38).

use std::fmt;
use std::str::FromStr;
use std::time::UNIX_EPOCH;

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::keyed::DeadSet;
use super::scripts::{self, Query};
use super::{MAX_BATCH, Queue, check_count, named};
use crate::error::{Error, Result};
use crate::queue::DeadLetter;

/// Dead sets [`Queue::dead_letters`] reads at once (their requests
/// pipelined on the connection, not one round trip after another).
const DEAD_SETS_AT_ONCE: usize = 64;

/// Where a page of dead letters starts: after the letter buried at
/// `buried_ms` with id `id`, in the order letters are listed (burial time,
/// then id byte-wise, a keyed letter's id being `<key>\0<id>`). Printed
/// and parsed as `<buried ms>-<id>` (what the CLI's `dead --after` and the
/// dashboard's "next page" link carry), with `\` written `\\` and NUL
/// `\0`.
///
/// A cursor stays valid while letters come and go: a page after it lists
/// the letters that follow its place, whether or not its own letter is
/// still dead.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeadCursor {
    /// The burial time, in ms since the epoch (the dead set's score).
    buried_ms: i64,
    /// The letter's id (a keyed letter's: `<key>\0<id>`).
    id: String,
}

impl DeadCursor {
    /// The place right after `letter`.
    pub fn after(letter: &DeadLetter) -> Self {
        let buried_ms = (letter.buried_at.duration_since(UNIX_EPOCH))
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        Self {
            buried_ms,
            id: letter.stored.clone(),
        }
    }

    /// The place after the letter buried at `buried_ms` (ms since the
    /// epoch) with id `id` (a keyed letter's: `<key>\0<id>`).
    pub fn new(buried_ms: i64, id: impl Into<String>) -> Self {
        Self {
            buried_ms,
            id: id.into(),
        }
    }
}

impl fmt::Display for DeadCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-", self.buried_ms)?;
        for c in self.id.chars() {
            match c {
                '\\' => f.write_str("\\\\")?,
                '\0' => f.write_str("\\0")?,
                c => fmt::Write::write_char(f, c)?,
            }
        }
        Ok(())
    }
}

impl FromStr for DeadCursor {
    type Err = Error;

    /// Parses `<buried ms>-<id>` (the id may hold `-` itself; `\\` and
    /// `\0` stand for a backslash and a NUL).
    fn from_str(text: &str) -> Result<Self> {
        let bad = || {
            Error::config(format_args!(
                "a dead-letter cursor is `<buried ms>-<id>`, got `{text}`"
            ))
        };
        let (ms, escaped) = text.split_once('-').ok_or_else(bad)?;
        if ms.is_empty() || !ms.bytes().all(|b| b.is_ascii_digit()) || escaped.is_empty() {
            return Err(bad());
        }
        let mut id = String::with_capacity(escaped.len());
        let mut chars = escaped.chars();
        while let Some(c) = chars.next() {
            id.push(match c {
                '\\' => match chars.next() {
                    Some('\\') => '\\',
                    Some('0') => '\0',
                    _ => return Err(bad()),
                },
                c => c,
            });
        }
        Ok(Self::new(ms.parse().map_err(|_| bad())?, id))
    }
}

/// A page of dead letters ([`Queue::dead_letters`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadPage {
    /// The letters, oldest first (then by id).
    pub letters: Vec<DeadLetter>,
    /// Where the next page starts; `None` when this page is the last.
    pub next: Option<DeadCursor>,
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Lists a page of up to `limit` dead letters, oldest first (then by
    /// id), starting after `after` (`None`: the first page). Pass the
    /// page's [`next`](DeadPage::next) to read the one after it. A page
    /// costs one script per dead set (each shard's, each keyed partition's
    /// with dead letters), each `O(log n + limit)` whatever the page's
    /// depth. On a Redis Cluster the keyed partitions read are those whose
    /// counts, as the queue's handles copy them (see
    /// [`flush_counts`](Self::flush_counts)), hold dead letters: a letter
    /// another live handle buried shows once its copy lands, normally
    /// within 500 ms. Letters re-driven
    /// or trimmed meanwhile do not shift later pages; a letter buried
    /// meanwhile shows on the page of its place (after the pages read if
    /// it is the newest). A `limit` of 0 reads nothing and gives `after`
    /// back as `next`. Errors when `limit` exceeds [`MAX_BATCH`].
    pub async fn dead_letters(&self, after: Option<&DeadCursor>, limit: usize) -> Result<DeadPage> {
        check_count("a dead-letter page", limit, 0..=MAX_BATCH)?;
        if limit == 0 {
            let next = after.cloned();
            return Ok(DeadPage {
                letters: Vec::new(),
                next,
            });
        }
        // Each set's next `limit` letters and one more (whether a next page
        // exists), merged in list order; the sets read many at once (on a
        // cluster a keyed queue has one per partition).
        use futures_util::{StreamExt, TryStreamExt};
        let sets = self.dead_sets_listed().await?;
        let each =
            (sets.into_iter()).map(|set| async move { self.dead_in(&set, after, limit + 1).await });
        let each: Vec<Vec<DeadLetter>> = futures_util::stream::iter(each)
            .buffered(DEAD_SETS_AT_ONCE)
            .try_collect()
            .await?;
        let mut letters: Vec<DeadLetter> = each.into_iter().flatten().collect();
        letters.sort_by_cached_key(DeadCursor::after);
        let more = letters.len() > limit;
        letters.truncate(limit);
        let next = more
            .then(|| letters.last().map(DeadCursor::after))
            .flatten();
        Ok(DeadPage { letters, next })
    }

    /// Up to `limit` dead letters of one set after `after`, in list order.
    async fn dead_in(
        &self,
        set: &DeadSet,
        after: Option<&DeadCursor>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>> {
        let attempted = || format!("listing dead letters of queue `{}`", self.name());
        type Letters = Vec<(String, f64, Option<Vec<u8>>, Option<String>)>;
        let (ms, id) = after.map_or((String::new(), ""), |c| (c.buried_ms.to_string(), &c.id));
        let reply: Letters = scripts::DEAD
            .key(&named(&set.base, ["data", "dead", "errors"]))
            .arg(ms)
            .arg(id)
            .arg(limit)
            .query_on(&self.conn, attempted)
            .await?;
        let keyed = set.partition.is_some();
        Ok(reply
            .into_iter()
            .map(|letter| DeadLetter::new(keyed, letter))
            .collect())
    }

    /// Re-drives the dead letters with id `id`: the one without a key, and
    /// those of keyed messages under any key (a keyed message's id is
    /// unique within its key; each keyed partition's dead set is scanned
    /// for the id). Each comes back due now, attempts, deferrals and stalls
    /// reset. Returns whether one was dead.
    pub async fn requeue_dead(&self, id: &str) -> Result<bool> {
        if id.is_empty() {
            return Err(Error::InvalidKey("message id must not be empty".into()));
        }
        let mut found = false;
        for set in self.dead_sets().await? {
            let stored = match set.partition {
                None => vec![id.to_owned()],
                Some(_) => {
                    let [dead] = named(&set.base, ["dead"]);
                    self.keyed().scan_for(&dead, "ZSCAN", id).await?
                }
            };
            for stored in stored {
                found |= self.requeue_dead_batch(&set, &stored, None).await?.0 == 1;
            }
        }
        self.flush_counts().await?;
        Ok(found)
    }

    /// Re-drives the dead letters buried up to the moment this call started
    /// (by the server's clock), in batches of [`MAX_BATCH`]; returns how
    /// many. Letters buried again while it runs (a poison message that fails
    /// at once) are left dead, so the call ends.
    pub async fn requeue_all_dead(&self) -> Result<usize> {
        let mut total = 0;
        for set in self.dead_sets().await? {
            let mut cutoff = None;
            loop {
                let (requeued, examined, started) =
                    self.requeue_dead_batch(&set, "", cutoff).await?;
                cutoff = Some(started);
                total += requeued;
                if examined < MAX_BATCH {
                    break;
                }
            }
        }
        self.flush_counts().await?;
        Ok(total)
    }

    async fn requeue_dead_batch(
        &self,
        set: &DeadSet,
        id: &str,
        cutoff: Option<i64>,
    ) -> Result<(usize, usize, i64)> {
        let events = match set.partition {
            None => self.events_arg(),
            Some(_) => String::new(),
        };
        let attempted = || format!("re-driving dead letters of queue `{}`", self.name());
        let mut script = scripts::REQUEUE_DEAD.prepare_invoke();
        script
            .key(&named(&set.base, ["data", "schedule", "dead", "errors"]))
            .key(&named(&set.base, ["bell", "prioritized", "events"]));
        if let Some((_, keyof_and_counts)) = &set.partition {
            script.key(keyof_and_counts);
        }
        type Redriven = (usize, usize, i64, Vec<(String, u32)>, Vec<String>);
        let reply = script
            .arg(id)
            .arg(MAX_BATCH)
            .arg(cutoff.map(|c| c.to_string()).unwrap_or_default())
            .arg(events)
            .query_on(&self.conn, attempted)
            .await;
        if let Some((slot, _)) = &set.partition {
            self.keyed().changed([*slot]);
        }
        let (requeued, examined, started, redriven, keys): Redriven = reply?;
        match (&set.partition, requeued > 0) {
            (Some((slot, _)), true) => self.keyed().redriven(*slot, redriven, keys).await?,
            (None, true) => self.mark_shard_after(set.shard, 0).await,
            _ => {}
        }
        Ok((requeued, examined, started))
    }

    /// Every shard's dead-letter keys, then those of the keyed partitions
    /// with dead letters (on a cluster, as their copied counts say: see
    /// [`flush_counts`](Self::flush_counts)).
    async fn dead_sets_listed(&self) -> Result<Vec<DeadSet>> {
        let mut sets = self.shard_dead_sets().await?;
        sets.extend(self.keyed().listed_dead_sets().await?);
        Ok(sets)
    }

    /// Every shard's dead-letter keys.
    async fn shard_dead_sets(&self) -> Result<Vec<DeadSet>> {
        let shards = self.layout().await?.keys.iter().enumerate();
        Ok(shards
            .map(|(shard, k)| DeadSet {
                base: k.base.clone(),
                partition: None,
                shard,
            })
            .collect())
    }

    /// Every shard's dead-letter keys, then every keyed partition's.
    async fn dead_sets(&self) -> Result<Vec<DeadSet>> {
        let mut sets = self.shard_dead_sets().await?;
        sets.extend(self.keyed().dead_sets().await?);
        Ok(sets)
    }
}
