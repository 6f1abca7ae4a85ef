//! The keyed side's calls that go over many partitions of the queue's
//! index: counts, key loads and a look at the next messages (on a
//! cluster, the first partitions of its indexes), recovery of expired
//! turns, removal by id, purge, the dead sets, and the sweep for
//! partitions missing from the index. Their requests go out many at once,
//! not one round trip after another.

use std::collections::HashSet;
use std::time::Duration;

use redis::Cmd;
use redis::aio::ConnectionLike;

use super::{
    COUNTS, DATA, DeadSet, INDEX_HEAL, KEY_LOADS, Keyed, LEASES, LEASES_DUE, LEASES_SETTLE, LINES,
    Layout, Log, MORE, OLDEST, PEEK, PURGE, Partition, RECOVER, REMOVE, lock, millis, own_id,
    split_stored,
};
use crate::error::{Error, Result};
use crate::keys::{SLOTS, slot_of};
use crate::queue::scripts::Query;
use crate::queue::{EventKind, KeyLoad, MAX_KEYS_READ, Peeked, from_unix_ms, span};
use crate::script::{Program, run};

/// Keys one script call of a sweep for unindexed partitions looks at, on
/// one server ([`Keyed::heal_index`]).
const HEAL_BATCH: usize = 1024;

/// `EXISTS` a sweep for unindexed partitions has in flight at once on a
/// cluster ([`Keyed::heal_index`]).
const HEAL_WINDOW: usize = 64;

/// Partitions a call that visits many partitions (stats on a cluster, a
/// look, a recovery sweep) has in flight at once.
const PARTITIONS_AT_ONCE: usize = 64;

/// Partitions whose keys [`Keyed::loads`] reads (`Queue::key_stats`):
/// the index's first, whatever the partitions in use.
pub(crate) const KEY_PARTITIONS: isize = 128;

/// How many keys of each kind [`Keyed::loads`] reads in all, per key asked
/// for (shared among the partitions read): one script over one partition
/// (every key's, on one server) reads this deep, about a millisecond of
/// the server's time for a top of 10, not a long blocking script.
const KEYS_READ_PER_TOP: usize = 32;

/// Partitions one call of a recovery sweep looks at, on one server
/// ([`Keyed::recover`]); each call ends at most 1,000 turns.
const RECOVER_BLOCKS: usize = 256;

/// Due partitions one read of the leases index names ([`Keyed::recover`]).
const DUE_AT_ONCE: usize = 4 * RECOVER_BLOCKS;

/// Reads of the leases index a sweep makes at most: every partition
/// (16,384) four times over.
const DUE_ROUNDS: usize = 4 * SLOTS as usize / DUE_AT_ONCE;

/// Which partitions a recovery sweep visits ([`Keyed::recover`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sweep {
    /// Those where a lease may have run out, by the leases index (on one
    /// server; on a cluster, every partition).
    Due,
    /// Every partition of the index: also those whose messages were leased
    /// by a version that kept no leases index.
    Full,
}

/// How long a sweep on a cluster may take to visit the partitions it read
/// as due (`lua/keyed_leases_due.lua`): a mark of a visit older than this
/// is due again (its sweep failed, or its process died, before it
/// settled). A visit is one script call per partition,
/// [`PARTITIONS_AT_ONCE`] at a time: a second or less, unless the server
/// is slow, when two sweeps visiting a partition is only work.
const VISIT_BOUND: Duration = Duration::from_secs(5);

/// What a recovery sweep did: messages back in line, buried, and per
/// partition visited its earliest lease deadline left (-1: none).
#[derive(Debug, Default)]
struct Swept {
    requeued: usize,
    buried: usize,
    left: Vec<(u16, i64)>,
}

impl Swept {
    fn absorb(mut self, other: Swept) -> Self {
        self.requeued += other.requeued;
        self.buried += other.buried;
        self.left.extend(other.left);
        self
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// The counts of keyed messages: [in line, delayed, at work, dead, and
    /// keys in line or at work with a lock (the ready sets' keys)], and
    /// since when the longest-ready key's head may be claimed (server ms,
    /// at `now` or before). The scripts keep them as they change the
    /// partitions (see `lua/keyed.lua`): on one server the queue's, read in
    /// one round trip of two commands whatever the keys; on a cluster each
    /// partition's, which the queue's handles copy into the queue's slot
    /// (see `mirror`), where they are read the same way, after this
    /// handle's own copies are written.
    pub(crate) async fn counts(&self, now: i64) -> Result<([u64; 5], Option<i64>)> {
        if self.layout().await? == Layout::Cluster {
            self.settle_copies().await?;
            self.first_copies().await?;
        }
        // On one server every partition names the queue's counts; on a
        // cluster the handles copy the partitions' there (see `mirror`).
        let partition = self.partition_in(0, Layout::Server);
        self.counts_in(&partition, now).await
    }

    /// The counts and the earliest ready time at or before `now` kept in
    /// `partition`'s `counts` and `oldest` (the queue's, on one server).
    async fn counts_in(&self, partition: &Partition, now: i64) -> Result<([u64; 5], Option<i64>)> {
        let attempted = || format!("reading stats of queue `{}`", self.keys.name);
        let k = &partition.keys;
        let (counts, first): ([Option<i64>; 5], Vec<(String, i64)>) = redis::pipe()
            .cmd("HMGET")
            .arg(&k[COUNTS])
            .arg(&["lines", "schedule", "active", "dead", "keys"])
            // Above 0: a key woken by a release or at work is not kept.
            .zrangebyscore_limit_withscores(&k[OLDEST], "(0", now, 0, 1)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        let counts = counts.map(|n| u64::try_from(n.unwrap_or(0)).unwrap_or(0));
        Ok((counts, first.first().map(|(_, since)| *since)))
    }

    /// The keys with messages in line or at work in the index's first
    /// [`KEY_PARTITIONS`] partitions (lowest entry first: those due, then
    /// those due soonest, among them those a claim just raised; on a
    /// cluster, and those of the leases index's first, where the keys at
    /// work are: see [`first_slots`](Self::first_slots)), with how
    /// many of each and how long the first in line has waited since its
    /// push; of each active and ready set at most its share of `most` ×
    /// [`KEYS_READ_PER_TOP`] (at most [`MAX_KEYS_READ`] in all, `most` at
    /// least). Also how many keys the partitions hold in line or at work,
    /// from the counts the scripts keep (see [`counts`](Self::counts)).
    /// Its work is bounded by `most` and [`KEY_PARTITIONS`], not by the
    /// keys.
    pub(crate) async fn loads(&self, most: usize) -> Result<(Vec<KeyLoad>, u64)> {
        use futures_util::{StreamExt, TryStreamExt};
        let attempted = || format!("reading the keys of queue `{}`", self.keys.name);
        let layout = self.layout().await?;
        let slots: Vec<u16> = match layout {
            Layout::Server => {
                Cmd::zrange(&self.keys.partitions, 0, KEY_PARTITIONS - 1)
                    .query_on(self.conn, attempted)
                    .await?
            }
            Layout::Cluster => self.first_slots().await?,
        };
        type Loads = (i64, Vec<(String, u64, u64, i64)>);
        // The index names shards too (past the slots): not partitions.
        let slots: Vec<u16> = slots.into_iter().filter(|slot| *slot < SLOTS).collect();
        let budget = (most * KEYS_READ_PER_TOP).min(MAX_KEYS_READ.max(most));
        let each = (budget / slots.len().max(1)).max(most).max(1);
        let read = slots.into_iter().map(|slot| {
            let mut cmd = self.partition_in(slot, layout).call(&KEY_LOADS, 0);
            cmd.arg(each);
            async move { self.run::<Loads>(&KEY_LOADS, &cmd, attempted).await }
        });
        let read = futures_util::stream::iter(read).buffered(PARTITIONS_AT_ONCE);
        // Any time will do: the earliest ready time is not used here.
        let count = async { self.counts(i64::MAX).await.map(|(counts, _)| counts[4]) };
        let (each, keys) =
            futures_util::future::join(read.try_collect::<Vec<Loads>>(), count).await;
        let (each, keys) = (each?, keys?);
        let mut loads = Vec::new();
        for (now, keys) in each {
            for (key, waiting, at_work, pushed) in keys {
                let oldest_waiting = (pushed >= 0).then(|| span(now - pushed));
                loads.push(KeyLoad {
                    key,
                    waiting,
                    at_work,
                    oldest_waiting,
                });
            }
        }
        Ok((loads, keys))
    }

    /// Deletes every partition in the index, keys' limits included, each
    /// in one script that takes its messages out of the counts (see
    /// `lua/keyed_purge.lua`), and forgets the candidates named. The claim
    /// and line counters stay (as the queue's claim counter does), so that
    /// a claim from before the purge never matches a message pushed after
    /// it.
    pub(crate) async fn purge(&self) -> Result<()> {
        let layout = self.layout().await?;
        for slot in self.slots().await? {
            let cmd = self.partition_in(slot, layout).call(&PURGE, 0);
            let attempted = || format!("purging queue `{}`", self.keys.name);
            let purged = self.run::<bool>(&PURGE, &cmd, attempted).await;
            self.changed([slot]);
            purged?;
        }
        lock(&self.state.candidates).clear();
        self.settle_copies().await
    }

    /// The dead-letter keys of every partition in the index.
    pub(crate) async fn dead_sets(&self) -> Result<Vec<DeadSet>> {
        let layout = self.layout().await?;
        let partitions = self.slots().await?.into_iter();
        Ok(partitions
            .map(|slot| self.partition_in(slot, layout).dead_set())
            .collect())
    }

    /// The dead-letter keys of the partitions a page of dead letters
    /// reads: every partition in the index on one server (one, and those of
    /// an older version's layout); on a cluster those whose copied counts
    /// hold dead letters (see `mirror`), not every partition.
    pub(crate) async fn listed_dead_sets(&self) -> Result<Vec<DeadSet>> {
        let layout = self.layout().await?;
        if layout == Layout::Server {
            return self.dead_sets().await;
        }
        let partitions = self.dead_slots().await?.into_iter();
        Ok(partitions
            .map(|slot| self.partition_in(slot, layout).dead_set())
            .collect())
    }

    /// Makes a partition whose dead letters were re-driven look for them,
    /// and records their `redriven` events (`pairs`: id, attempt; `keys`:
    /// each one's key).
    pub(crate) async fn redriven(
        &self,
        slot: u16,
        pairs: Vec<(String, u32)>,
        keys: Vec<String>,
    ) -> Result<()> {
        self.mark_after(slot).await;
        let mut log = Log::default();
        for ((stored, attempt), key) in pairs.iter().zip(&keys) {
            log.event(EventKind::Redriven, key, (&own_id(key, stored), *attempt));
        }
        self.record(log).await;
        Ok(())
    }

    /// Puts back in the index every partition that holds messages but is
    /// missing from it: a producer that ran the push script and never got
    /// to its index step (it died, its connection dropped, the server
    /// failed over in between) left it there unseen. The partitions are the
    /// truth, the index a hint. A partition's place is known from its slot
    /// alone (its tag), so the sweep asks each of the 16,384 whether its
    /// data exists, a cost that does not grow with the keys: on one server
    /// in 16 script calls of [`HEAL_BATCH`] keys; on a cluster, where a
    /// script sees one slot, one `EXISTS` per slot, [`HEAL_WINDOW`] at a
    /// time. The worker sweeps on a connection of its own (16,384 requests
    /// through the shared one, while slots moved or a master failed over,
    /// stalled every other request behind them). Returns how many it put
    /// back (due now; the bell rings).
    pub(crate) async fn heal_index(&self) -> Result<usize> {
        let attempted = || format!("looking for unindexed partitions of {}", self.keys.name);
        let indexed: HashSet<u16> = self.slots().await?.into_iter().collect();
        let slots: Vec<u16> = (0..SLOTS).filter(|slot| !indexed.contains(slot)).collect();
        let mut missing = Vec::new();
        let cluster = self.is_cluster().await?;
        let batch = if cluster { HEAL_WINDOW } else { HEAL_BATCH };
        for batch in slots.chunks(batch) {
            let found = match cluster {
                true => self.existing_one_by_one(batch).await,
                false => self.existing_at_once(batch).await,
            };
            missing.extend(found.map_err(Error::redis(attempted()))?);
        }
        if !missing.is_empty() {
            tracing::warn!(queue = %self.keys.name, partitions = missing.len(), "keyed partitions with messages were missing from the index (a producer stopped between its push and its mark); put back");
            self.mark_all_ready(&missing, attempted).await?;
        }
        Ok(missing.len())
    }

    /// The slots of `batch` whose partition holds messages, in one script
    /// call (one server only: the keys are in many slots).
    async fn existing_at_once(&self, batch: &[u16]) -> redis::RedisResult<Vec<u16>> {
        let mut cmd = INDEX_HEAL.call(batch.len());
        for slot in batch {
            cmd.arg(self.data_key(*slot));
        }
        let found: Vec<usize> = run(&INDEX_HEAL, &cmd, &mut self.conn.clone()).await?;
        Ok(found
            .into_iter()
            .filter_map(|i| batch.get(i.wrapping_sub(1)).copied())
            .collect())
    }

    /// The slots of `batch` whose partition holds messages, one `EXISTS`
    /// each, all in flight at once (a cluster routes each to its node).
    async fn existing_one_by_one(&self, batch: &[u16]) -> redis::RedisResult<Vec<u16>> {
        let found = futures_util::future::try_join_all(batch.iter().map(|slot| {
            let data = self.data_key(*slot);
            let mut conn = self.conn.clone();
            async move { Cmd::exists(data).query_async::<bool>(&mut conn).await }
        }))
        .await?;
        let slots = batch.iter().zip(found).filter(|(_, found)| *found);
        Ok(slots.map(|(slot, _)| *slot).collect())
    }

    /// The `data` hash of slot `slot`'s partition (its name is the same
    /// whatever the layout).
    fn data_key(&self, slot: u16) -> String {
        let partition = self.partition_in(slot, Layout::Server);
        partition.keys[DATA].clone()
    }

    /// On a Redis Cluster, the partitions a look at the next messages or
    /// at the keys reads: the first [`KEY_PARTITIONS`] of the queue's index
    /// (those due, then those due soonest) and the first of its leases
    /// index (those whose leases end soonest, see `lua/leases_settle.lua`),
    /// each once, in slot order. Two commands in one round trip, whatever
    /// the keys.
    async fn first_slots(&self) -> Result<Vec<u16>> {
        let attempted = || format!("looking into queue `{}`", self.keys.name);
        let (due, leased): (Vec<u16>, Vec<String>) = redis::pipe()
            .zrange(&self.keys.partitions, 0, KEY_PARTITIONS - 1)
            .zrange(self.leases_index(), 0, KEY_PARTITIONS - 1)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        let leased = leased.iter().map(|tag| slot_of(tag));
        let mut slots: Vec<u16> = due
            .into_iter()
            .filter(|slot| *slot < SLOTS)
            .chain(leased)
            .collect();
        slots.sort_unstable();
        slots.dedup();
        Ok(slots)
    }

    /// Every partition in the index.
    pub(super) async fn slots(&self) -> Result<Vec<u16>> {
        let attempted = || format!("listing the partitions of queue `{}`", self.keys.name);
        let slots: Vec<u16> = Cmd::zrange(&self.keys.partitions, 0, -1)
            .query_on(self.conn, attempted)
            .await?;
        Ok(slots.into_iter().filter(|slot| *slot < SLOTS).collect())
    }

    /// Ends the turns whose lease ran out; returns how many went back to
    /// the head of their line, and were buried. `Sweep::Due` visits only
    /// the partitions whose entry in the queue's leases index is due (see
    /// `lua/keyed.lua`): a quiet queue's sweep costs a few commands,
    /// whatever its keys. `Sweep::Full` visits every partition of the
    /// queue's index. On one server the scripts keep the leases index; on
    /// a Redis Cluster, where it is in another slot than theirs, a claim
    /// lowers it before and after it leases, and a sweep sets it after its
    /// visits (`lua/leases_settle.lua`); a visit whose sweep never settled
    /// is due again [`VISIT_BOUND`] later.
    pub(crate) async fn recover(&self, max_stalls: u32, sweep: Sweep) -> Result<(usize, usize)> {
        let layout = self.layout().await?;
        if sweep == Sweep::Full {
            let slots = self.slots().await?;
            let swept = self.recover_slots(&slots, layout, max_stalls).await?;
            self.settle_leases(layout, None, &swept.left).await?;
            if layout == Layout::Cluster {
                self.copy_all(&slots).await?;
            }
            return Ok((swept.requeued, swept.buried));
        }
        let mut total = (0, 0);
        // A visit moves a partition's entry past now (or removes it), so
        // the next read finds those beyond the limit; one with more expired
        // turns than a call ends stays due for the next round.
        for _ in 0..DUE_ROUNDS {
            let (marked, slots) = self.due_slots(layout).await?;
            let swept = self.recover_slots(&slots, layout, max_stalls).await?;
            self.settle_leases(layout, marked, &swept.left).await?;
            total = (total.0 + swept.requeued, total.1 + swept.buried);
            if slots.len() < DUE_AT_ONCE {
                break;
            }
        }
        Ok(total)
    }

    /// The slots of the partitions whose entry in the leases index is due
    /// (see `lua/keyed_leases_due.lua`), up to [`DUE_AT_ONCE`]; on a
    /// cluster, also those whose visit was marked longer than
    /// [`VISIT_BOUND`] ago, and this sweep's mark of its visits.
    async fn due_slots(&self, layout: Layout) -> Result<(Option<String>, Vec<u16>)> {
        let attempted = || format!("reading the leases index of queue `{}`", self.keys.name);
        let cluster = layout == Layout::Cluster;
        let mut cmd = LEASES_DUE.call(1 + usize::from(cluster));
        cmd.arg(self.leases_index());
        if cluster {
            cmd.arg(self.visiting());
        }
        cmd.arg(DUE_AT_ONCE);
        if cluster {
            let own = f64::from(rand::random::<u32>()) / 4_294_967_296.0;
            cmd.arg(millis(VISIT_BOUND)).arg(format!("{own:.6}"));
        }
        let mut tags: Vec<String> = self.run(&LEASES_DUE, &cmd, attempted).await?;
        let marked = match (cluster, tags.is_empty()) {
            (false, _) => None,
            (true, true) => return Err(Error::reply(attempted(), "no mark of the visits")),
            (true, false) => Some(tags.remove(0)),
        };
        Ok((marked, tags.iter().map(|tag| slot_of(tag)).collect()))
    }

    /// The partitions a due sweep on a cluster visits, marked with when
    /// (`<prefix>:{<queue>}:keyed:visiting`, see
    /// `lua/keyed_leases_due.lua`).
    fn visiting(&self) -> String {
        format!("{}:keyed:visiting", self.keys.base)
    }

    /// The queue's leases index (`<prefix>:{<queue>}:keyed:leases`).
    pub(crate) fn leases_index(&self) -> String {
        self.partition_in(0, Layout::Server).keys[LEASES].clone()
    }

    /// On a cluster, sets the leases index's entries of the partitions a
    /// sweep visited (`left`: slot, earliest lease deadline left or -1) as
    /// `lua/leases_settle.lua` says, `marked` a due sweep's mark of its
    /// visits (a full sweep made none); one server's scripts did already.
    async fn settle_leases(
        &self,
        layout: Layout,
        marked: Option<String>,
        left: &[(u16, i64)],
    ) -> Result<()> {
        if layout == Layout::Server || left.is_empty() {
            return Ok(());
        }
        let attempted = || format!("keeping the leases index of queue `{}`", self.keys.name);
        let mut cmd = LEASES_SETTLE.call(2);
        cmd.arg(self.leases_index()).arg(self.visiting());
        cmd.arg(marked.unwrap_or_default());
        for (slot, deadline) in left {
            cmd.arg(crate::keys::slot_tag(*slot)).arg(deadline);
        }
        self.run::<i64>(&LEASES_SETTLE, &cmd, attempted)
            .await
            .map(drop)
    }

    /// Ends the turns whose lease ran out in the partitions of `slots`: on
    /// one server [`RECOVER_BLOCKS`] partitions a call (a sweep over
    /// 16,384 partitions: 64 calls); on a cluster, where a script reaches
    /// one slot, a call per partition, [`PARTITIONS_AT_ONCE`] at a time.
    async fn recover_slots(&self, slots: &[u16], layout: Layout, max_stalls: u32) -> Result<Swept> {
        use futures_util::{StreamExt, TryStreamExt};
        let (count, age) = self.recording.dead.args();
        let (count, age) = (&count, &age);
        let per_call = match layout {
            Layout::Server => RECOVER_BLOCKS,
            Layout::Cluster => 1,
        };
        let groups: Vec<Vec<Partition>> = (slots.chunks(per_call))
            .map(|slots| {
                let partition = |slot: &u16| Partition::new(self.keys, *slot, layout);
                slots.iter().map(partition).collect()
            })
            .collect();
        let calls = groups.into_iter().map(|partitions| async move {
            self.recover_in((&partitions, layout), max_stalls, (count, age))
                .await
        });
        let at_once = (PARTITIONS_AT_ONCE / per_call).max(2);
        let swept: Vec<Swept> = futures_util::stream::iter(calls)
            .buffered(at_once)
            .try_collect()
            .await?;
        Ok(swept.into_iter().fold(Swept::default(), Swept::absorb))
    }

    /// One recovery call over `partitions` (all on one server, see
    /// `lua/keyed_recover.lua`); marks those where turns ended (one
    /// request for all) and records their events. Returns how many went
    /// back in line, and were buried.
    async fn recover_in(
        &self,
        (partitions, layout): (&[Partition], Layout),
        max_stalls: u32,
        (count, age): (&String, &String),
    ) -> Result<Swept> {
        let attempted = || format!("recovering keyed messages of queue `{}`", self.keys.name);
        let mut cmd = RECOVER.call(partitions.len() * MORE);
        for partition in partitions {
            cmd.arg(&partition.keys[..]);
        }
        // One server keeps the leases index (a cluster's sweeps visit
        // every partition).
        let keeps_index = u8::from(layout == Layout::Server);
        cmd.arg(max_stalls)
            .arg(1000)
            .arg(count)
            .arg(age)
            .arg(keeps_index);
        type Ended = Vec<(String, String, u32, String)>;
        let answers = self.run(&RECOVER, &cmd, attempted).await;
        if answers.is_err() {
            self.changed(partitions.iter().map(|partition| partition.slot));
        }
        let answers: Vec<(usize, Ended, i64)> = answers?;
        let (mut requeued, mut buried, mut marks) = (0, 0, Vec::new());
        let mut left = Vec::with_capacity(answers.len());
        let mut log = Log::default();
        let mut changed = Vec::new();
        for (partition, (examined, ended, earliest)) in partitions.iter().zip(answers) {
            left.push((partition.slot, earliest));
            // (An expired entry without a record is dropped, ending none.)
            if examined > 0 {
                changed.push(partition.slot);
            }
            if ended.is_empty() {
                continue;
            }
            marks.push(partition.slot);
            for (key, stored, attempt, error) in &ended {
                let id = &own_id(key, stored);
                match error.as_str() {
                    "" => log.event(EventKind::Recovered, key, (id, *attempt)),
                    error => log.with_error(EventKind::Dead, key, error, (id, *attempt)),
                }
            }
            let dead = ended.iter().filter(|(.., error)| !error.is_empty()).count();
            (requeued, buried) = (requeued + ended.len() - dead, buried + dead);
        }
        self.changed(changed);
        // The partitions where turns ended have ready keys: one mark for
        // all of them.
        let attempted = || format!("marking partitions of queue `{}` ready", self.keys.name);
        if let Err(error) = self.mark_all_ready(&marks, attempted).await {
            tracing::warn!(queue = %self.keys.name, %error, "could not mark keyed partitions ready after a recovery; the index's next look finds them");
        }
        self.record(log).await;
        Ok(Swept {
            requeued,
            buried,
            left,
        })
    }

    /// Adds up to `limit` of each partition's next messages in line or
    /// delayed to `waiting` and at work to `active` (see `lua/keyed_peek.lua`):
    /// every partition's on one server, those of
    /// [`first_slots`](Self::first_slots) on a cluster.
    pub(crate) async fn peek(
        &self,
        limit: usize,
        waiting: &mut Vec<Peeked>,
        active: &mut Vec<Peeked>,
    ) -> Result<()> {
        use futures_util::{StreamExt, TryStreamExt};
        let attempted = || format!("looking into queue `{}`", self.keys.name);
        type Entries = Vec<(String, i64, String, Option<Vec<u8>>)>;
        let layout = self.layout().await?;
        let slots = match layout {
            Layout::Server => self.slots().await?,
            Layout::Cluster => self.first_slots().await?,
        };
        let each = slots.into_iter().map(|slot| {
            let mut cmd = self.partition_in(slot, layout).call(&PEEK, 0);
            cmd.arg(limit);
            async move { self.run::<(usize, Entries)>(&PEEK, &cmd, attempted).await }
        });
        let each = futures_util::stream::iter(each).buffered(PARTITIONS_AT_ONCE);
        for (count, entries) in each.try_collect::<Vec<_>>().await? {
            for (n, (stored, at, key, record)) in entries.into_iter().enumerate() {
                let id = own_id(&key, &stored);
                let mut peeked = Peeked::new(id, from_unix_ms(at), 0, record);
                peeked.key = Some(key).filter(|key| !key.is_empty());
                match n < count {
                    true => waiting.push(peeked),
                    false => active.push(peeked),
                }
            }
        }
        Ok(())
    }

    /// Removes the keyed messages with id `id`, under whichever key, where
    /// they wait or lie dead (see `lua/keyed_remove.lua`); returns whether
    /// it found one so. Each partition's messages are scanned for the id
    /// (`HSCAN … MATCH`), then each one found is looked for in its key's
    /// line: an operator's call, O(messages) per partition.
    pub(crate) async fn remove(&self, id: &str) -> Result<bool> {
        let attempted = || format!("removing message `{id}`");
        let mut removed = false;
        let layout = self.layout().await?;
        for slot in self.slots().await? {
            let partition = self.partition_in(slot, layout);
            let found = self.scan_for(&partition.keys[DATA], "HSCAN", id).await?;
            for stored in found {
                let Some((key, _)) = split_stored(&stored) else {
                    continue;
                };
                let member = self.place_in_line(&partition, key, &stored).await?;
                let mut cmd = partition.call(&REMOVE, 0);
                cmd.arg(&stored).arg(member.unwrap_or_default());
                let key = self.run(&REMOVE, &cmd, attempted).await;
                self.changed([slot]);
                let key: Option<String> = key?;
                if let Some(key) = key {
                    let mut log = Log::default();
                    log.event(EventKind::Removed, &key, (id, 1));
                    self.record(log).await;
                    removed = true;
                }
            }
        }
        if removed {
            self.settle_copies().await?;
        }
        Ok(removed)
    }

    /// The stored ids (see [`stored_id`]) of the messages with id `id`,
    /// under any key, in the hash or sorted set `set` of a partition, found
    /// by `scan` (`HSCAN` or `ZSCAN`) a batch per round trip.
    pub(crate) async fn scan_for(&self, set: &str, scan: &str, id: &str) -> Result<Vec<String>> {
        let mut pattern = "*\0".to_owned();
        for c in id.chars() {
            if matches!(c, '*' | '?' | '[' | ']' | '\\') {
                pattern.push('\\');
            }
            pattern.push(c);
        }
        let (mut cursor, mut found) = (0u64, Vec::new());
        loop {
            let (next, page): (u64, Vec<String>) = redis::cmd(scan)
                .arg(set)
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_on(self.conn, || format!("looking for message `{id}`"))
                .await?;
            // Field and value (score) alternate; the key holds no NUL, so
            // the id is what follows the first.
            let fields = page.into_iter().step_by(2);
            found.extend(fields.filter(|f| split_stored(f).is_some_and(|(_, own)| own == id)));
            if next == 0 {
                return Ok(found);
            }
            cursor = next;
        }
    }

    /// The member of message `stored` in the line of `key`,
    /// `<key>\0<seq>\0<stored id>`, found by reading that line a page at a
    /// time, or `None`.
    async fn place_in_line(
        &self,
        partition: &Partition,
        key: &str,
        stored: &str,
    ) -> Result<Option<Vec<u8>>> {
        let mut from = [b"[", key.as_bytes(), b"\0"].concat();
        let to = [b"(", key.as_bytes(), b"\x01"].concat();
        let place = |member: &[u8]| {
            member.len() == key.len() + 18 + stored.len() && member.ends_with(stored.as_bytes())
        };
        loop {
            let page: Vec<Vec<u8>> = redis::cmd("ZRANGE")
                .arg(&partition.keys[LINES])
                .arg(&from)
                .arg(&to)
                .arg("BYLEX")
                .arg("LIMIT")
                .arg(0)
                .arg(1000)
                .query_on(self.conn, || {
                    format!("looking for message `{stored}` in line")
                })
                .await?;
            if let Some(member) = page.iter().find(|m| place(m)) {
                return Ok(Some(member.clone()));
            }
            match page.last() {
                Some(last) if page.len() == 1000 => from = [b"(", &last[..]].concat(),
                _ => return Ok(None),
            }
        }
    }
}
