//! Reading a queue without changing it: counts ([`Queue::stats`]), its
//! keys' loads, a look at its next messages, its activity, its lifecycle
//! events and its completed messages.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redis::Value;
use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::scripts::{self, Query};
use super::{
    Connector, Event, EventsFrom, MAX_BATCH, MAX_KEYS_READ, Queue, check_count, events,
    from_unix_ms, job,
};
use crate::error::{Error, Result};
use crate::lock::millis;

/// What [`Queue::peek`] saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Peek {
    /// The next waiting messages, soonest due first; `at` is the due time.
    pub waiting: Vec<Peeked>,
    /// Active messages, soonest lease end first; `at` is the lease's end.
    pub active: Vec<Peeked>,
}

/// A message seen by [`Queue::peek`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Peeked {
    /// The message id.
    pub id: String,
    /// When it is due (waiting) or when its lease ends (active).
    pub at: SystemTime,
    /// Its priority (0: none).
    pub priority: u8,
    /// Failed attempts so far.
    pub failures: u32,
    /// Deferrals so far.
    pub deferrals: u32,
    /// Its payload as stored (JSON); empty when its record is gone.
    pub payload: Vec<u8>,
    /// Its key, for a message pushed with one ([`PushOptions::key`](super::PushOptions::key)).
    pub key: Option<String>,
}

impl Peeked {
    pub(super) fn new(id: String, at: SystemTime, priority: u8, record: Option<Vec<u8>>) -> Self {
        let record = record.unwrap_or_default();
        let r = job::split_or_raw(&record);
        Self {
            id,
            at,
            priority,
            failures: r.failures,
            deferrals: r.deferrals,
            payload: r.payload.to_vec(),
            key: None,
        }
    }
}

/// What [`Queue::activity`] read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Activity {
    /// The queue's counts.
    pub stats: Stats,
    /// Whether the queue has an events stream (its handles record events).
    pub recorded: bool,
    /// The width of one bucket.
    pub bucket: Duration,
    /// Messages done per bucket, oldest first.
    pub done: Vec<u64>,
    /// Messages that failed (retried or dead) per bucket, oldest first.
    pub failed: Vec<u64>,
}

/// A completed message kept by [`Queue::keep_completed`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Completed {
    /// The message id.
    pub id: String,
    /// The attempt that completed it.
    pub attempt: u32,
    /// When it was acknowledged (server clock).
    pub completed_at: SystemTime,
    /// Its payload, as stored (JSON).
    pub payload: Vec<u8>,
}

/// A key of a keyed queue, as [`Queue::key_stats`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyLoad {
    /// The key.
    pub key: String,
    /// Its messages in line, waiting for their turn.
    pub waiting: u64,
    /// Its messages at work (1 at most for a key with a lock; up to its
    /// permits for one with permits).
    pub at_work: u64,
    /// How long the first message in its line has waited since it was
    /// pushed; `None` when its line is empty.
    pub oldest_waiting: Option<Duration>,
}

/// A keyed queue's busy keys and longest lines ([`Queue::key_stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyStats {
    /// Keys with messages at work, most at work first, then longest line.
    pub busy: Vec<KeyLoad>,
    /// Keys with messages in line, longest line first, then oldest head.
    pub backlogs: Vec<KeyLoad>,
    /// How many keys have messages in line, or a lock at work (a key
    /// with permits whose line is empty is not counted).
    pub keys: usize,
}

/// A snapshot of a queue's size, read at one instant (on a Redis Cluster,
/// a keyed queue's part from copies, see [`Queue::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Scheduled messages that are due.
    pub due: u64,
    /// Scheduled messages that are not due yet.
    pub later: u64,
    /// Messages claimed by workers.
    pub active: u64,
    /// Dead letters.
    pub dead: u64,
    /// How long the oldest due message has been due.
    pub oldest_due_age: Option<Duration>,
    /// How long until the next message that is not due yet becomes due.
    pub next_due_in: Option<Duration>,
    /// How many keys have keyed messages in line, or a lock at work (as
    /// [`KeyStats::keys`]).
    pub keys: u64,
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Counts the queue's messages in each state: a few commands, however
    /// many messages and keys. On a Redis Cluster a keyed queue's counts
    /// are the copies the queue's handles write of its partitions' (see
    /// [`flush_counts`](Self::flush_counts)): this handle's changes are
    /// written first, other live handles' are normally at most about
    /// 500 ms behind.
    pub async fn stats(&self) -> Result<Stats> {
        let attempted = || format!("reading stats of queue `{}`", self.name());
        let reply = self.summed_stats(None, attempted).await?;
        self.with_keyed(&reply, attempted).await
    }

    /// On a Redis Cluster, writes the counts of the keyed partitions this
    /// handle changed to the queue's slot, where [`stats`](Self::stats)
    /// reads them, and waits for those its clones are writing. A handle
    /// writes them on its own within about 500 ms of a change, and `stats`,
    /// `purge`, `remove`, the dead letters' re-drives and a worker's end
    /// write them first; a producer that exits right after pushing keyed
    /// messages calls it before it does, so that `stats` elsewhere counts
    /// its last pushes at once (else when a worker next claims from their
    /// partitions, or at the recovery sweep over every partition, once per
    /// 5 minutes). Nothing to do on one server, whose scripts keep the
    /// queue's counts themselves (docs/keyed.md).
    pub async fn flush_counts(&self) -> Result<()> {
        self.keyed().settle_copies().await
    }

    /// The queue's [`Stats`] as a handle of it read them at most `max_age`
    /// ago, kept in the queue's slot (`<prefix>:{<queue>}:sampled`, for
    /// `max_age`) for its other handles; else read now ([`stats`]) and
    /// kept. Meant for gauges that many processes sample: a worker's
    /// [`sample_every`] reads through it, so that a pool of workers reads
    /// the counts about once per period between them, not once each. The ages in a kept reading are
    /// moved on by how long it was kept. A reading it cannot keep (the
    /// user may not `SET`) is returned all the same. Errors when
    /// `max_age` is under 1 ms.
    ///
    /// [`stats`]: Self::stats
    /// [`sample_every`]: crate::Worker::sample_every
    pub async fn recent_stats(&self, max_age: Duration) -> Result<Stats> {
        let kept_for = millis(max_age);
        if kept_for == 0 {
            return Err(Error::config(format_args!(
                "recent_stats: max_age must be at least 1 ms, got {max_age:?}"
            )));
        }
        let attempted = || format!("reading stats of queue `{}`", self.name());
        let key = format!("{}:sampled", self.keys.base);
        let (kept, left): (Option<String>, i64) = redis::pipe()
            .get(&key)
            .pttl(&key)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        if let Some(stats) = kept.and_then(|kept| kept_stats(&kept, left, kept_for)) {
            return Ok(stats);
        }
        let stats = self.stats().await?;
        let mut set = redis::cmd("SET");
        set.arg(&key)
            .arg(sampled(&stats, kept_for))
            .arg("PX")
            .arg(kept_for);
        // A reader that may not write (an ACL without `SET`) still reads.
        if let Err(error) = set.query_on::<(), _>(&self.conn, attempted).await {
            tracing::debug!(queue = %self.name(), %error, "could not keep a reading of the stats for the queue's other handles");
        }
        Ok(stats)
    }

    /// The stats script's reply (with activity buckets of `(window, width,
    /// buckets)` when given) summed over the shards.
    async fn summed_stats(
        &self,
        buckets: Option<(u64, u64, u32)>,
        attempted: impl Fn() -> String + Copy,
    ) -> Result<Vec<i64>> {
        let replies = self.shard_replies(buckets, attempted).await?;
        sum_replies(replies, attempted)
    }

    /// The stats script's reply of each shard.
    async fn shard_replies(
        &self,
        buckets: Option<(u64, u64, u32)>,
        attempted: impl Fn() -> String + Copy,
    ) -> Result<Vec<Vec<i64>>> {
        let mut replies = Vec::new();
        for k in &self.layout().await?.keys {
            let mut call = scripts::STATS.prepare_invoke();
            call.key(&[&k.schedule, &k.active, &k.dead, &k.prioritized]);
            if let Some((window, width, n)) = buckets {
                call.key(&[&k.events, &k.activity])
                    .arg(window)
                    .arg(width)
                    .arg(n);
            }
            replies.push(call.query_on(&self.conn, attempted).await?);
        }
        Ok(replies)
    }

    /// The queue's counts, as [`stats`](Self::stats) gives them, and those
    /// of each shard's messages without a key, shard 0 first (keyed
    /// messages live in their keys' partitions, counted in the queue's
    /// alone), from one reading of each shard. See [`shards`](Self::shards).
    pub async fn stats_by_shard(&self) -> Result<(Stats, Vec<Stats>)> {
        let attempted = || format!("reading stats of queue `{}`", self.name());
        let replies = self.shard_replies(None, attempted).await?;
        let each = (replies.iter())
            .map(|reply| plain_stats(reply, attempted))
            .collect::<Result<Vec<_>>>()?;
        let reply = sum_replies(replies, attempted)?;
        Ok((self.with_keyed(&reply, attempted).await?, each))
    }

    /// The queue's `Stats`: the stats script's counts (due, later, active,
    /// dead) and times (oldest due, now, next due; -1 for none), and its
    /// keyed ones.
    async fn with_keyed(&self, reply: &[i64], attempted: impl Fn() -> String) -> Result<Stats> {
        let &[_, _, _, _, oldest, now, next_due, ..] = reply else {
            return plain_stats(reply, attempted);
        };
        // A keyed message is due once its key is ready for it.
        let (keyed, ready) = self.keyed().counts(now).await?;
        let [due, later, active, dead] = [0, 1, 2, 3].map(|i| count(reply[i]) + keyed[i]);
        let oldest = match (oldest, ready) {
            (-1, Some(ready)) => ready,
            (oldest, Some(ready)) => oldest.min(ready),
            (oldest, None) => oldest,
        };
        Ok(Stats {
            due,
            later,
            active,
            dead,
            oldest_due_age: (oldest >= 0).then(|| span(now - oldest)),
            next_due_in: (next_due >= 0).then(|| span(next_due - now)),
            keys: keyed[4],
        })
    }

    /// The `top` keyed messages' keys with the most messages at work, and
    /// the `top` with the longest lines, among the keys read: on one server,
    /// where every key's line is in the queue's one partition, the first
    /// `32 × top` keys of each kind (ready first, at work soonest to end;
    /// at most [`MAX_KEYS_READ`], `top` at least); on a Redis Cluster, a
    /// partition per slot of the keys' locks, the first 128 partitions of
    /// the queue's index (those due, then those due soonest) and of its
    /// leases index (those whose leases end soonest, where the keys at
    /// work are), at most `top` keys of each kind in each. A script per partition read. Its work is
    /// bounded by `top`, not by the keys: above that, the picks are the
    /// longest among those read, not always over all keys.
    /// [`KeyStats::keys`] counts every key, from counts the scripts keep
    /// (on a Redis Cluster, as [`stats`](Self::stats) reads them). For
    /// dashboards, not for a hot path.
    pub async fn key_stats(&self, top: usize) -> Result<KeyStats> {
        let (loads, keys) = self.keyed().loads(top.clamp(1, MAX_KEYS_READ)).await?;
        let keys = usize::try_from(keys).unwrap_or(usize::MAX);
        let pick = |keep: fn(&KeyLoad) -> bool, order: fn(&KeyLoad) -> (u64, u64, Duration)| {
            let mut picked: Vec<KeyLoad> = loads.iter().filter(|l| keep(l)).cloned().collect();
            picked.sort_by_key(|l| std::cmp::Reverse(order(l)));
            picked.truncate(top);
            picked
        };
        Ok(KeyStats {
            busy: pick(
                |l| l.at_work > 0,
                |l| (l.at_work, l.waiting, l.oldest_waiting.unwrap_or_default()),
            ),
            backlogs: pick(
                |l| l.waiting > 0,
                |l| (l.waiting, 0, l.oldest_waiting.unwrap_or_default()),
            ),
            keys,
        })
    }

    /// The queue's stats and, per bucket of `window / buckets` (oldest
    /// first, the last one ending now), the messages done and failed
    /// (retried or dead). Counted per second of the server's clock while
    /// the queue's handles [record events](Self::record_events), kept for
    /// the last hour (older seconds read as zero): a bucket narrower than a
    /// second holds whole seconds. One script per shard, which reads one
    /// count per second of the window, never the events themselves. For
    /// dashboards.
    pub async fn activity(&self, window: Duration, buckets: u32) -> Result<Activity> {
        let buckets = buckets.clamp(1, 1000);
        let width = (millis(window) / u64::from(buckets)).max(1);
        let attempted = || format!("reading the activity of queue `{}`", self.name());
        let spans = (width * u64::from(buckets), width, buckets);
        let reply = self.summed_stats(Some(spans), attempted).await?;
        let n = buckets as usize;
        if reply.len() != 8 + 2 * n {
            let detail = format_args!("{} values", reply.len());
            return Err(Error::reply(attempted(), detail));
        }
        Ok(Activity {
            stats: self.with_keyed(&reply, attempted).await?,
            recorded: reply[7] == 1,
            bucket: Duration::from_millis(width),
            done: reply[8..8 + n].iter().copied().map(count).collect(),
            failed: reply[8 + n..].iter().copied().map(count).collect(),
        })
    }

    /// Follows the queue's [lifecycle events](Self::record_events) from
    /// `from`, on a connection of its own opened through `connector`. It
    /// reconnects after connection losses and resumes after the last entry
    /// it delivered; it ends, with the error, on one that waiting does not
    /// cure ([`Error::is_denied`]). `EventsFrom::Now` is resolved before
    /// this returns. One stream entry ([`Event::entry`]) holds the events of
    /// one script call: store it for [`EventsFrom::After`] once every event
    /// of it is handled. See docs/queue.md, "Lifecycle events".
    pub async fn events<K: Connector>(
        &self,
        connector: K,
        from: EventsFrom,
    ) -> Result<impl futures_util::Stream<Item = Result<Event>> + Send + 'static> {
        let last = match from {
            EventsFrom::Now => self.last_event_entry().await?,
            EventsFrom::Beginning => None,
            EventsFrom::After(id) if !events::is_entry_id(&id) => {
                return Err(Error::config(format_args!(
                    "`{id}` is not a stream entry id (`<ms>-<seq>`)"
                )));
            }
            EventsFrom::After(id) => Some(id),
        };
        let last = last.unwrap_or_else(|| "0-0".into());
        // One follower per shard's stream, merged as they come.
        let connector = Arc::new(connector);
        let streams = (self.layout().await?.keys.iter()).map(|k| {
            Box::pin(events::follow(
                connector.clone(),
                k.events.clone(),
                last.clone(),
            ))
        });
        Ok(futures_util::stream::select_all(streams))
    }

    /// Looks at the next `limit` (at most [`MAX_BATCH`]) waiting messages,
    /// soonest due first, and the first `limit` active ones, soonest lease
    /// end first. Changes nothing. Keyed messages are listed with their
    /// key: each key's first in line, at the time its key may be claimed
    /// from, and delayed ones at their due time (one script per partition
    /// read: on a Redis Cluster, the first 128 partitions of the queue's
    /// index and of its leases index, so that its cost does not grow with
    /// the keys; exact while at most 128 partitions hold messages, fewer
    /// on a sharded queue, whose shards have entries in the index too).
    pub async fn peek(&self, limit: usize) -> Result<Peek> {
        let limit = limit.clamp(1, MAX_BATCH);
        let attempted = || format!("looking into queue `{}`", self.name());
        type Waiting = Vec<(String, f64, u8, Option<Vec<u8>>)>;
        type Active = Vec<(String, f64, Option<Vec<u8>>)>;
        let at = |ms: f64| from_unix_ms(ms as i64);
        let (mut waiting, mut active) = (Vec::new(), Vec::new());
        for k in &self.layout().await?.keys {
            let (w, a): (Waiting, Active) = scripts::PEEK
                .key(&[&k.data, &k.schedule, &k.prioritized, &k.active])
                .arg(limit)
                .query_on(&self.conn, attempted)
                .await?;
            waiting.extend(
                (w.into_iter())
                    .map(|(id, due, priority, record)| Peeked::new(id, at(due), priority, record)),
            );
            active.extend(a.into_iter().map(|(id, deadline, record)| {
                let priority = job::split_or_raw(record.as_deref().unwrap_or_default()).priority;
                Peeked::new(id, at(deadline), priority, record)
            }));
        }
        self.keyed().peek(limit, &mut waiting, &mut active).await?;
        waiting.sort_by_key(|w| w.at);
        waiting.truncate(limit);
        active.sort_by_key(|a| a.at);
        active.truncate(limit);
        Ok(Peek { waiting, active })
    }

    /// Reads, without blocking, the events of up to `limit` (at most
    /// [`MAX_BATCH`]) stream entries after the entry `after` (`"0-0"`: from
    /// the beginning; see [`last_event_entry`](Self::last_event_entry)).
    pub async fn events_after(&self, after: &str, limit: usize) -> Result<Vec<Event>> {
        let attempted = || format!("reading the events of queue `{}`", self.name());
        let (after, limit) = (format!("({after}"), limit.clamp(1, MAX_BATCH));
        // Each shard's first `limit` entries, the first `limit` of them all.
        let mut entries = Vec::new();
        for k in &self.layout().await?.keys {
            let range = stream_range("XRANGE", &k.events, &after, "+", limit);
            let reply: Value = range.query_on(&self.conn, attempted).await?;
            entries.extend(events::entries(reply));
        }
        entries.sort_by_key(|(entry, _)| events::entry_order(entry));
        entries.truncate(limit);
        Ok(entries
            .into_iter()
            .flat_map(|(entry, fields)| events::decode(&entry, fields))
            .collect())
    }

    /// The newest entry of the events stream, if any: where
    /// [`events_after`](Self::events_after) starts to see only what comes.
    pub async fn last_event_entry(&self) -> Result<Option<String>> {
        let attempted = || format!("reading the events of queue `{}`", self.name());
        let mut last = None;
        for k in &self.layout().await?.keys {
            let range = stream_range("XREVRANGE", &k.events, "+", "-", 1);
            let reply: Value = range.query_on(&self.conn, attempted).await?;
            let entry = events::entries(reply).into_iter().next().map(|(id, _)| id);
            let order = |e: &Option<String>| e.as_deref().map(events::entry_order);
            last = std::cmp::max_by_key(last, entry, order);
        }
        Ok(last)
    }

    /// The most recent completed messages kept by
    /// [`keep_completed`](Self::keep_completed), newest first, at most
    /// `limit` (at most [`MAX_BATCH`]).
    pub async fn completed(&self, limit: usize) -> Result<Vec<Completed>> {
        check_count("a page of completed messages", limit, 0..=MAX_BATCH)?;
        let attempted = || format!("listing completed messages of queue `{}`", self.name());
        let mut reply: Vec<(String, HashMap<String, Vec<u8>>)> = Vec::new();
        for k in &self.layout().await?.keys {
            let range = stream_range("XREVRANGE", &k.completed, "+", "-", limit);
            let entries: Vec<_> = range.query_on(&self.conn, attempted).await?;
            reply.extend(entries);
        }
        // Newest first over every shard.
        reply.sort_by_key(|(entry, _)| std::cmp::Reverse(events::entry_order(entry)));
        reply.truncate(limit);
        reply
            .into_iter()
            .map(|(entry, mut fields)| {
                let ms: Option<u64> = entry.split('-').next().and_then(|ms| ms.parse().ok());
                let attempt: Option<u32> =
                    (fields.get("attempt")).and_then(|a| std::str::from_utf8(a).ok()?.parse().ok());
                match (fields.remove("id"), attempt, ms, fields.remove("payload")) {
                    (Some(id), Some(attempt), Some(ms), Some(payload)) => Ok(Completed {
                        id: String::from_utf8_lossy(&id).into_owned(),
                        attempt,
                        completed_at: UNIX_EPOCH + Duration::from_millis(ms),
                        payload,
                    }),
                    _ => Err(Error::reply(attempted(), format_args!("entry {entry}"))),
                }
            })
            .collect()
    }
}

/// Stats script replies of the shards summed: counts and buckets added up,
/// the earliest times kept, the clock of shard 0.
fn sum_replies(replies: Vec<Vec<i64>>, attempted: impl Fn() -> String) -> Result<Vec<i64>> {
    let mut replies = replies.into_iter();
    let mut total = replies.next().unwrap_or_default();
    for reply in replies {
        if reply.len() != total.len() {
            let detail = format_args!("{} values", reply.len());
            return Err(Error::reply(attempted(), detail));
        }
        for (i, (sum, n)) in total.iter_mut().zip(reply).enumerate() {
            *sum = match i {
                // Times: the earliest of those there are (-1: none).
                4 | 6 if *sum < 0 || (0..*sum).contains(&n) => n,
                4 | 6 => *sum,
                5 => *sum,
                7 => (*sum).max(n),
                _ => *sum + n,
            };
        }
    }
    Ok(total)
}

/// The `Stats` of one stats script reply (counts: due, later, active, dead;
/// times: oldest due, now, next due; -1 for none).
fn plain_stats(reply: &[i64], attempted: impl Fn() -> String) -> Result<Stats> {
    let &[due, later, active, dead, oldest, now, next_due, ..] = reply else {
        let detail = format_args!("{} values", reply.len());
        return Err(Error::reply(attempted(), detail));
    };
    Ok(Stats {
        due: count(due),
        later: count(later),
        active: count(active),
        dead: count(dead),
        oldest_due_age: (oldest >= 0).then(|| span(now - oldest)),
        next_due_in: (next_due >= 0).then(|| span(next_due - now)),
        keys: 0,
    })
}

/// `stats` kept for `kept_for` ms: "<kept for>:<due>:<later>:<active>:<dead>:
/// <oldest due age ms, -1 none>:<next due in ms, -1 none>:<keys>".
fn sampled(stats: &Stats, kept_for: u64) -> String {
    let ms = |d: Option<Duration>| d.map_or(-1, |d| i64::try_from(millis(d)).unwrap_or(i64::MAX));
    format!(
        "{kept_for}:{}:{}:{}:{}:{}:{}:{}",
        stats.due,
        stats.later,
        stats.active,
        stats.dead,
        ms(stats.oldest_due_age),
        ms(stats.next_due_in),
        stats.keys
    )
}

/// A kept reading (see [`sampled`]) with `left` ms of its life left, if
/// it was read at most `max_age` ms ago; its ages moved on by its own.
fn kept_stats(kept: &str, left: i64, max_age: u64) -> Option<Stats> {
    let fields: Vec<i64> = kept
        .split(':')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    // (A reading of an older version, without its keys, is read again.)
    let &[kept_for, due, later, active, dead, oldest, next, keys] = fields.as_slice() else {
        return None;
    };
    let age = kept_for
        .checked_sub(left)
        .filter(|age| *age >= 0 && left >= 0)?;
    if u64::try_from(age).ok()? > max_age {
        return None;
    }
    let moved = |ms: i64, by: i64| (ms >= 0).then(|| span(ms.saturating_add(by)));
    Some(Stats {
        due: count(due),
        later: count(later),
        active: count(active),
        dead: count(dead),
        oldest_due_age: moved(oldest, age),
        next_due_in: moved(next, -age),
        keys: count(keys),
    })
}

/// A count from a script (none when negative).
fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// `XRANGE` (or `XREVRANGE`) of `key` from `start` to `end`, at most `count`.
fn stream_range(cmd: &str, key: &str, start: &str, end: &str, count: usize) -> redis::Cmd {
    let mut cmd = redis::cmd(cmd);
    cmd.arg(key).arg(start).arg(end).arg("COUNT").arg(count);
    cmd
}

/// `ms` milliseconds (none when negative).
pub(super) fn span(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
