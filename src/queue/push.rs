//! Pushing messages: their options, the receipt, and the batches that go
//! a script call per shard or keyed partition.

use std::borrow::Borrow;
use std::time::{Duration, SystemTime};

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::scripts::{self, Query};
use super::{MAX_BATCH, Queue, QueueKeys, from_unix_ms, in_groups, job, keyed, unix_ms};
use crate::error::{Error, Result};
use crate::lock::millis;

/// When a pushed message becomes due, and under which id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushOptions {
    /// Caller-chosen id; a fresh sortable id when `None`.
    id: Option<String>,
    /// When the message is due; now when `None`.
    when: Option<When>,
    /// Its priority: 0 (none) to [`MAX_PRIORITY`].
    priority: u8,
    /// Its key: claimed only with the key's lock, after the key's earlier
    /// messages.
    key: Option<String>,
    /// The key's permits, when it has more than its lock.
    permits: Option<u32>,
    /// The key's rate limit, when it has one.
    rate: Option<crate::lock::rate::Rate>,
}

/// The highest priority a message can have ([`PushOptions::priority`]).
pub const MAX_PRIORITY: u8 = 9;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// This long after the server's now.
    After(Duration),
    /// At this wall-clock time.
    At(SystemTime),
}

impl PushOptions {
    /// Due now, with a generated id.
    pub fn new() -> Self {
        Self::default()
    }

    /// Uses `id` as the message id. Pushing an id that exists already (in
    /// any state) changes nothing and reports the existing message: this is
    /// how to de-duplicate. A keyed message's id is unique within its
    /// [`key`](Self::key): the same id under another key is another
    /// message. Ids must not be empty.
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Due `delay` after the moment the server receives the push.
    pub fn after(mut self, delay: Duration) -> Self {
        self.when = Some(When::After(delay));
        self
    }

    /// Due at `at` (a time in the past is due at once).
    pub fn at(mut self, at: SystemTime) -> Self {
        self.when = Some(When::At(at));
        self
    }

    /// Claimed before due messages of lower priorities: 1 to
    /// [`MAX_PRIORITY`] (9), higher first; 0, the default, is none (claimed
    /// last). Kept on retries, deferrals, recovery and re-drives. Pushing
    /// fails with [`Error::Config`] above 9. See docs/queue.md, "The queue".
    pub fn priority(mut self, priority: u8) -> Self {
        self.priority = priority;
        self
    }

    /// Gives the message a key: it is claimed only together with the lock
    /// [`Locker::lock_key`](crate::Locker::lock_key) names, which its
    /// handler then holds ([`HeldLock::current`](crate::HeldLock::current)),
    /// so no two messages of a key run at once and they start in push
    /// order. Keys must be non-empty and free of NUL; a keyed message has
    /// no priority (else [`Error::Config`]). See docs/keyed.md, "Keyed
    /// messages".
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Lets `n` messages of the key run at once, each claimed with one of
    /// the key's permits, those
    /// [`Locker::acquire_permit`](crate::Locker::acquire_permit) takes. Give
    /// every message of a key the same `n` (the last push sets it). Needs
    /// [`key`](Self::key); `n` from 1 to
    /// [`MAX_PERMITS`](crate::lock::permits::MAX_PERMITS), else pushing fails
    /// with [`Error::Config`]. `permits(1)` is one permit, not the key's
    /// lock (as with [`LockLayer::permits`](crate::LockLayer::permits)).
    /// See docs/keyed.md, "Keyed messages" (n at a time per key).
    pub fn permits(mut self, n: u32) -> Self {
        self.permits = Some(n);
        self
    }

    /// Claims the key's messages only when its rate limit admits them, in
    /// the log [`Locker::admit`](crate::Locker::admit) counts in; every
    /// claim that starts a message counts (a retry too). Give every message
    /// of a key the same rate (the last push sets it). Needs
    /// [`key`](Self::key), else pushing fails with [`Error::Config`]. See
    /// docs/keyed.md, "Keyed messages" (at most r per period per key).
    pub fn rate(mut self, rate: crate::lock::rate::Rate) -> Self {
        self.rate = Some(rate);
        self
    }

    /// The limits argument of the keyed push script: `<permits>` and
    /// `/<rate>`, each when given.
    fn limits_arg(&self) -> String {
        let permits = self.permits.map_or(String::new(), |n| n.to_string());
        match &self.rate {
            Some(rate) => format!("{permits}/{}", rate.spec()),
            None => permits,
        }
    }

    /// The `when` argument of the push script: the due time, and a priority
    /// as `/<priority>`.
    fn when_arg(&self) -> String {
        let when = match self.when {
            None => "0".to_owned(),
            Some(When::After(d)) => millis(d).to_string(),
            Some(When::At(t)) => format!("@{}", unix_ms(t)),
        };
        match self.priority {
            0 => when,
            p => format!("{when}/{p}"),
        }
    }
}

/// Refuses options no message can be pushed with.
fn check_push(options: &PushOptions) -> Result<()> {
    if options.priority > MAX_PRIORITY {
        return Err(Error::config(format_args!(
            "message priority must be 0..={MAX_PRIORITY}, got {}",
            options.priority
        )));
    }
    if options.id.as_ref().is_some_and(String::is_empty) {
        return Err(Error::InvalidKey("message id must not be empty".into()));
    }
    match &options.key {
        Some(key) if key.is_empty() || key.contains('\0') => Err(Error::InvalidKey(
            "a message key must be non-empty and free of NUL".into(),
        )),
        Some(_) if options.priority > 0 => Err(Error::config(
            "a keyed message has no priority: a key's messages start in push order",
        )),
        None if options.permits.is_some() || options.rate.is_some() => Err(Error::config(
            "permits and rate limits are a key's: give the message a key too",
        )),
        _ => options
            .permits
            .map_or(Ok(0), crate::lock::permits::check_permits)
            .map(drop),
    }
}

/// A message ready to push: its id, the push script's `when`, its payload,
/// and its key with the keyed push script's `limits`.
type Encoded = (String, String, Vec<u8>, Option<(String, String)>);

/// The receipt of a push.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pushed {
    /// The message id.
    pub id: String,
    /// When the message is due: `None` if the id existed already and that
    /// message is not scheduled (it is being processed, or dead).
    pub due: Option<SystemTime>,
    /// `false` when a message with this id existed already and nothing was
    /// added.
    pub created: bool,
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Adds a message, due now.
    pub async fn push(&self, msg: impl Borrow<T>) -> Result<Pushed> {
        self.push_with(msg, PushOptions::new()).await
    }

    /// Adds a message due `delay` from now (by the server's clock).
    pub async fn push_after(&self, msg: impl Borrow<T>, delay: Duration) -> Result<Pushed> {
        self.push_with(msg, PushOptions::new().after(delay)).await
    }

    /// Adds a message due at `at` (by the wall clock; a past time is due now).
    pub async fn push_at(&self, msg: impl Borrow<T>, at: SystemTime) -> Result<Pushed> {
        self.push_with(msg, PushOptions::new().at(at)).await
    }

    /// Adds a message with a chosen id and due time.
    pub async fn push_with(&self, msg: impl Borrow<T>, options: PushOptions) -> Result<Pushed> {
        let pushed = self.push_many_with([(msg, options)]).await?.pop();
        pushed.ok_or_else(|| Error::reply("pushing a message", "empty reply"))
    }

    /// Adds many messages, all due now, in one round trip per
    /// [`MAX_BATCH`] messages. Each batch is atomic.
    pub async fn push_many<I>(&self, msgs: I) -> Result<Vec<Pushed>>
    where
        I: IntoIterator,
        I::Item: Borrow<T>,
    {
        self.push_many_with(msgs.into_iter().map(|m| (m, PushOptions::new())))
            .await
    }

    /// Adds many messages with their own ids and due times, in one round trip
    /// per [`MAX_BATCH`] messages. Each batch is atomic.
    pub async fn push_many_with<I, M>(&self, msgs: I) -> Result<Vec<Pushed>>
    where
        I: IntoIterator<Item = (M, PushOptions)>,
        M: Borrow<T>,
    {
        // Encode everything first, so that a message that cannot be encoded
        // fails the call before anything was written.
        let mut encoded = Vec::new();
        for (msg, options) in msgs {
            let payload = serde_json::to_vec(msg.borrow()).map_err(Error::Encode)?;
            check_push(&options)?;
            let (id, when) = (options.id.clone(), options.when_arg());
            let key = options.key.clone().map(|key| (key, options.limits_arg()));
            encoded.push((id.unwrap_or_else(job::new_id), when, payload, key));
        }
        let count = encoded.len();
        if count > 0 {
            self.register().await;
        }
        let (keyed, plain): (Vec<_>, Vec<_>) = encoded
            .into_iter()
            .enumerate()
            .partition(|(_, (.., key))| key.is_some());
        let (plain, keyed) =
            futures_util::future::join(self.push_plain(plain), self.push_keyed(keyed)).await;
        let mut receipts = Vec::with_capacity(count);
        receipts.extend(plain?);
        receipts.extend(keyed?);
        receipts.sort_unstable_by_key(|(n, _)| *n);
        Ok(receipts.into_iter().map(|(_, pushed)| pushed).collect())
    }

    /// Pushes unkeyed messages (with their place in the caller's list), in
    /// one script call per shard and [`MAX_BATCH`] messages, together as
    /// `waves` lets them, then marks the shards pushed to (also when
    /// another push failed).
    async fn push_plain(&self, plain: Vec<(usize, Encoded)>) -> Result<Vec<(usize, Pushed)>> {
        if plain.is_empty() {
            return Ok(Vec::new());
        }
        let shards = self.layout().await?;
        let mut by_shard = std::collections::BTreeMap::<usize, Vec<_>>::new();
        for message in plain {
            by_shard
                .entry(shards.of(&message.1.0))
                .or_default()
                .push(message);
        }
        let batches: Vec<(usize, &[(usize, Encoded)])> = (by_shard.iter())
            .flat_map(|(shard, plain)| plain.chunks(MAX_BATCH).map(move |batch| (*shard, batch)))
            .collect();
        let mut answers = Vec::with_capacity(batches.len());
        for wave in waves(&batches) {
            let calls = wave
                .iter()
                .map(|(shard, batch)| self.push_batch(&shards.keys[*shard], batch));
            let pushed = in_groups(calls.collect()).await;
            answers.extend(wave.iter().map(|(shard, _)| *shard).zip(pushed));
        }
        let (mut receipts, mut marks, mut failed) = (Vec::new(), Vec::new(), None);
        for (shard, answer) in answers {
            match answer {
                Ok((pushed, due)) => {
                    receipts.extend(pushed);
                    marks.extend(due.map(|due| (shard, due)));
                }
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        self.mark_shards(&marks).await?;
        failed.map_or(Ok(receipts), Err)
    }

    /// Pushes keyed messages (with their place in the caller's list),
    /// [`MAX_BATCH`] messages at a time (see `waves`), each partition's in
    /// their order: on one server, where every key's line is in the
    /// queue's one partition, in one script call; on a cluster, where a
    /// script reaches one slot, one call per partition (a slot of the keys'
    /// locks), the calls going out together (see `in_groups`). A batch
    /// over many keys costs a round trip, not one per partition.
    async fn push_keyed(&self, keyed: Vec<(usize, Encoded)>) -> Result<Vec<(usize, Pushed)>> {
        let mut by_partition = std::collections::BTreeMap::<u16, Vec<_>>::new();
        let layout = self.keyed().layout().await?;
        for (n, (id, when, payload, key)) in &keyed {
            let Some((key, limits)) = key else { continue };
            let pushing = keyed::Pushing {
                key,
                limits,
                id,
                when,
                payload,
            };
            let slot = self.keyed().partition_slot(key, layout);
            by_partition.entry(slot).or_default().push((*n, pushing));
        }
        let batches: Vec<(u16, &[(usize, keyed::Pushing<'_>)])> = (by_partition.iter())
            .flat_map(|(slot, all)| all.chunks(MAX_BATCH).map(move |batch| (*slot, batch)))
            .collect();
        let per_call = match layout {
            keyed::Layout::Cluster => 1,
            keyed::Layout::Server => MAX_BATCH,
        };
        let (keyed_side, mut answers) = (self.keyed(), Vec::with_capacity(batches.len()));
        for wave in waves(&batches) {
            let calls: Vec<_> = wave.chunks(per_call).collect();
            let pushed = in_groups(calls.iter().map(|call| keyed_side.push(call)).collect());
            answers.extend(calls.into_iter().zip(pushed.await));
        }
        let mut receipts = Vec::with_capacity(keyed.len());
        let (mut pushed_to, mut failed) = (Vec::new(), None);
        for (call, pushed) in answers {
            match pushed {
                Ok(pushed) => {
                    pushed_to.extend(call.iter().map(|(slot, _)| *slot));
                    let messages = call.iter().flat_map(|(_, batch)| batch.iter());
                    for ((n, m), (created, due)) in messages.zip(pushed) {
                        receipts.push((*n, receipt(m.id, created, due)));
                    }
                }
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        // The partitions pushed to have work, also when another push failed.
        let attempted = || format!("pushing keyed messages to queue `{}`", self.name());
        pushed_to.sort_unstable();
        pushed_to.dedup();
        for slots in pushed_to.chunks(MAX_BATCH) {
            self.keyed().mark_all_ready(slots, attempted).await?;
        }
        failed.map_or(Ok(receipts), Err)
    }

    /// Pushes unkeyed messages (at most [`MAX_BATCH`], with their place in
    /// the caller's list) to the shard of keys `k` in one script call; also
    /// returns the first due time of those waiting.
    async fn push_batch(
        &self,
        k: &QueueKeys,
        batch: &[(usize, Encoded)],
    ) -> Result<(Vec<(usize, Pushed)>, Option<i64>)> {
        let mut call = scripts::PUSH.prepare_invoke();
        call.key(&[&k.data, &k.schedule, &k.bell, &k.prioritized]);
        if let Some(cap) = self.recording.events {
            call.key(&k.events).arg(cap);
        }
        for (_, (id, when, payload, _)) in batch {
            call.arg(id).arg(when).arg(payload);
        }
        let attempted = || format!("pushing to queue `{}`", self.name());
        let reply: Vec<(i64, i64)> = call.query_on(&self.conn, attempted).await?;
        if reply.len() != batch.len() {
            let detail = format_args!("{} receipts for {} messages", reply.len(), batch.len());
            return Err(Error::reply(attempted(), detail));
        }
        // A message there already is marked too: this may be the retry of a
        // push whose mark was lost.
        let first_due = reply.iter().map(|r| r.1).filter(|due| *due >= 0).min();
        let receipts = batch.iter().zip(reply);
        let receipts = receipts
            .map(|((n, (id, ..)), (created, due))| (*n, receipt(id, created == 1, due)))
            .collect();
        Ok((receipts, first_due))
    }
}

/// A push's receipt from the script's answer (`due` -1: not scheduled).
fn receipt(id: &str, created: bool, due: i64) -> Pushed {
    let due = (due >= 0).then(|| from_unix_ms(due));
    let id = id.to_owned();
    Pushed { id, due, created }
}

fn waves<'b, P, B>(calls: &'b [(P, &[B])]) -> impl Iterator<Item = &'b [(P, &'b [B])]> {
    let mut rest = calls;
    std::iter::from_fn(move || {
        let mut total = 0;
        let end = (rest.iter())
            .position(|(_, batch)| {
                total += batch.len();
                total > MAX_BATCH
            })
            .unwrap_or(rest.len())
            .max(1)
            .min(rest.len());
        let (wave, after) = rest.split_at(end);
        rest = after;
        (!wave.is_empty()).then_some(wave)
    })
}
