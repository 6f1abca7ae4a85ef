//! A keyed queue's counts on a Redis Cluster, copied into the queue's slot.
//!
//! On one server the keyed scripts keep the queue's counts themselves
//! (`<prefix>:{<queue>}:keyed:counts` and `:keyed:oldest`). On a cluster a
//! script reaches one slot, so each partition keeps its own, and adding
//! them up read every partition: 16,000 of them at 100,000 keys. Instead,
//! the queue's handles copy the counts of the partitions they changed into
//! the queue's slot (`lua/keyed_mirror.lua`), where `stats` reads them as
//! on one server. A handle notes the partitions its calls change; a task
//! of its own reads them (two commands a partition, all at once) and
//! writes the copies (a few commands a call, whatever the partitions),
//! then waits [`COPY_EVERY`] before the next round, so that a partition
//! changed many times meanwhile is read once. Each copy carries the number
//! of the partition's last change, and only a newer copy replaces the one
//! kept: handles copying at once leave the newest, whatever order their
//! copies land in.
//!
//! What the copies miss: the changes of a process that stopped before
//! copying them (killed; a handle dropped with its runtime; a call
//! cancelled after it was sent) and of producers in other languages,
//! until a handle changes the partition again (a worker's claim, soon
//! after a push) or the recovery sweep over every partition, once per 5
//! minutes between the queue's handles, copies them all.

use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use redis::Script;
use redis::aio::ConnectionLike;

use super::{COUNTS, Keyed, KeyedState, Layout, OLDEST, Partition, READY, lock};
use crate::error::{Error, Result};
use crate::queue::QueueKeys;
use crate::queue::scripts::Lazy;
use crate::script::{Program, run};

/// How long a handle's copying task waits after a round before the next:
/// the counts `stats` reads on a cluster are this much behind the
/// partitions, plus a round trip or two.
pub(crate) const COPY_EVERY: Duration = Duration::from_millis(500);

/// Partitions read at once, and copies written per call.
const COPIES_AT_ONCE: usize = 256;

/// The longest pause of the copying task between failed rounds.
const RETRY_MOST: Duration = Duration::from_secs(30);

static COPY: Lazy = LazyLock::new(|| Script::new(include_str!("../lua/keyed_mirror.lua")));

/// A handle's partitions changed and not yet copied, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    state: Mutex<Pending>,
    /// Told when a round ends.
    quiet: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Pending {
    /// The partitions changed since their last reading.
    changed: BTreeSet<u16>,
    /// Whether the copying task runs.
    task: bool,
    /// The number of the last round taken, and the rounds under way (the
    /// task's, and callers' own, see `settle_copies`).
    rounds: u64,
    under_way: BTreeSet<u64>,
}

impl Copies {
    /// Takes the partitions changed, for a round; when nothing is left,
    /// with `stop`, marks the copying task ended (at once: a change noted
    /// after it starts another).
    fn take(&self, stop: bool) -> Option<Round<'_>> {
        self.take_or_last(stop).ok()
    }

    /// The same, or else the number of the last round taken, read under
    /// the same lock.
    fn take_or_last(&self, stop: bool) -> std::result::Result<Round<'_>, u64> {
        let mut pending = lock(&self.state);
        if pending.changed.is_empty() {
            pending.task &= !stop;
            return Err(pending.rounds);
        }
        pending.rounds += 1;
        let number = pending.rounds;
        pending.under_way.insert(number);
        let slots = std::mem::take(&mut pending.changed).into_iter().collect();
        Ok(Round {
            copies: self,
            number,
            slots,
            copied: false,
        })
    }

    /// Waits for the rounds under way that were taken by round `last` or
    /// before.
    async fn rounds_ended(&self, last: u64) {
        loop {
            let quiet = self.quiet.notified();
            tokio::pin!(quiet);
            quiet.as_mut().enable();
            let first = lock(&self.state).under_way.first().copied();
            if first.is_none_or(|first| first > last) {
                return;
            }
            quiet.await;
        }
    }
}

/// A round of copies under way: ended when dropped, whatever ended it (an
/// error, or its future dropped); unless copied, its partitions go back
/// to be copied by the next.
struct Round<'a> {
    copies: &'a Copies,
    number: u64,
    slots: Vec<u16>,
    copied: bool,
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        let mut pending = lock(&self.copies.state);
        pending.under_way.remove(&self.number);
        if !self.copied {
            pending.changed.extend(&self.slots);
        }
        drop(pending);
        self.copies.quiet.notify_waiters();
    }
}

/// The copying task's mark in [`Pending::task`], taken back if the task
/// is dropped before it ends (with its runtime, or before it first ran),
/// so that the next change starts another.
struct Running {
    state: Arc<KeyedState>,
    armed: bool,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.armed {
            lock(&self.state.copies.state).task = false;
        }
    }
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// Notes that calls changed the partitions of `slots` (or may have: a
    /// call whose reply was lost): on a cluster they are copied into the
    /// queue's slot by the handle's task, started here when it is not
    /// running. Nothing on one server, whose scripts keep the queue's
    /// counts. (The layout is known: the call found it first.)
    pub(crate) fn changed(&self, slots: impl IntoIterator<Item = u16>) {
        if self
            .state
            .publish
            .get()
            .is_none_or(|publish| *publish == "PUBLISH")
        {
            return;
        }
        let copies = &self.state.copies;
        let mut pending = lock(&copies.state);
        pending.changed.extend(slots);
        if pending.task || pending.changed.is_empty() {
            return;
        }
        // (Outside a Tokio runtime no task starts: `stats` copies them.)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        pending.task = true;
        drop(pending);
        let running = Running {
            state: self.state.clone(),
            armed: true,
        };
        runtime.spawn(copy_task(self.conn.clone(), self.keys.clone(), running));
    }

    /// Copies the partitions this handle changed, and waits for the copies
    /// under way: on a cluster, what `stats` reads then has this handle's
    /// changes, and those of other handles up to about [`COPY_EVERY`] ago.
    /// Partitions a round under way failed to copy are copied here, or
    /// their error returned.
    pub(crate) async fn settle_copies(&self) -> Result<()> {
        let copies = &self.state.copies;
        // A round under way that fails puts its partitions back: copied
        // here, in a round of this call's own (a few tries).
        for _ in 0..3 {
            let last = match copies.take_or_last(false) {
                Ok(round) => {
                    let last = round.number;
                    self.copy_round(round).await?;
                    last
                }
                Err(last) => last,
            };
            copies.rounds_ended(last).await;
            if lock(&copies.state).changed.is_empty() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Copies a round's partitions; one that fails goes back to the copying
    /// task (started again if it ended).
    async fn copy_round(&self, mut round: Round<'_>) -> Result<()> {
        match copy(self.conn, self.keys, &round.slots, false).await {
            Ok(_) => {
                round.copied = true;
                Ok(())
            }
            Err(error) => {
                drop(round);
                self.changed(std::iter::empty());
                Err(error)
            }
        }
    }

    /// The partitions with dead letters on a cluster, as their copies say
    /// (after this handle's own are written, and the first copies made):
    /// where a page of dead letters looks.
    pub(crate) async fn dead_slots(&self) -> Result<Vec<u16>> {
        self.settle_copies().await?;
        self.first_copies().await?;
        let attempted = || format!("listing dead letters of queue `{}`", self.keys.name);
        redis::Cmd::zrange(dead_partitions(self.keys), 0, -1)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))
    }

    /// Until every partition of a queue was copied once (a version before
    /// the copies made none; a copy of every partition that failed part
    /// way), copies every partition of the index: the first whole copy
    /// leaves a mark (`keyed:copied`), which handles' own copies do not.
    pub(crate) async fn first_copies(&self) -> Result<()> {
        let attempted = || format!("copying the keyed counts of queue `{}`", self.keys.name);
        let copied: bool = redis::Cmd::exists(copied_mark(self.keys))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        if copied {
            return Ok(());
        }
        let slots = self.slots().await?;
        self.copy_all(&slots).await
    }

    /// Copies every partition of the index (`slots`) and every partition
    /// copied before (a sweep over every partition, once per 5 minutes
    /// between the queue's handles; or a first look at the copies, which
    /// a version before them never made): a copy that differs from the one
    /// kept replaces it, its number newer or not (see
    /// `lua/keyed_mirror.lua`). A partition whose kept copy it took back to
    /// an older number (changed and copied meanwhile, or a failover that
    /// lost the partition's last writes) is copied again as usual.
    pub(crate) async fn copy_all(&self, slots: &[u16]) -> Result<()> {
        let attempted = || format!("copying the keyed counts of queue `{}`", self.keys.name);
        let copied: Vec<u16> = redis::Cmd::hkeys(copies_key(self.keys))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        let every: BTreeSet<u16> = slots.iter().copied().chain(copied).collect();
        let every: Vec<u16> = every.into_iter().collect();
        let older = copy(self.conn, self.keys, &every, true).await?;
        copy(self.conn, self.keys, &older, false).await?;
        redis::Cmd::set(copied_mark(self.keys), 1)
            .query_async::<()>(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))
    }
}

/// The copying task of a handle: rounds until nothing is left to copy. A
/// round that fails leaves its partitions for the next, after a pause
/// that doubles up to [`RETRY_MOST`].
async fn copy_task<C: ConnectionLike + Clone + Send + Sync>(
    conn: C,
    keys: Arc<QueueKeys>,
    mut running: Running,
) {
    let copies = &running.state.copies;
    let mut pause = COPY_EVERY;
    while let Some(mut round) = copies.take(true) {
        match copy(&conn, &keys, &round.slots, false).await {
            Ok(_) => {
                round.copied = true;
                pause = COPY_EVERY;
            }
            Err(error) => {
                tracing::warn!(queue = %keys.name, %error, partitions = round.slots.len(), "could not copy keyed partitions' counts into the queue's slot; trying again");
                pause = (pause * 2).min(RETRY_MOST);
                // Every handle of the queue gone: nobody reads these.
                if Arc::strong_count(&running.state) == 1 {
                    break;
                }
            }
        }
        drop(round);
        tokio::time::sleep(pause).await;
    }
    running.armed = false;
}

/// Reads the partitions of `slots` and writes their copies; with
/// `force`, copies that differ from those kept, their number newer or not.
/// Returns the partitions whose kept copy it took back to an older number.
async fn copy<C: ConnectionLike + Clone + Send + Sync>(
    conn: &C,
    keys: &QueueKeys,
    slots: &[u16],
    force: bool,
) -> Result<Vec<u16>> {
    use futures_util::{StreamExt, TryStreamExt};
    let attempted = || format!("copying the keyed counts of queue `{}`", keys.name);
    // The queue's counts and oldest: one server's scripts' names.
    let queue = Partition::new(keys, 0, Layout::Server).keys;
    let copies = copies_key(keys);
    let mut older = Vec::new();
    for slots in slots.chunks(COPIES_AT_ONCE) {
        // Each partition's counts and their number, and its earliest ready
        // time: two commands in one request a partition, all at once (a
        // cluster's pipeline keeps to one slot). Read apart, the two may
        // straddle a change; that change's own copy, newer, follows.
        let partitions: Vec<Partition> = (slots.iter())
            .map(|&slot| Partition::new(keys, slot, Layout::Cluster))
            .collect();
        type Read = ([Option<i64>; 6], Vec<(String, i64)>);
        // Collected first: a lazy map's closure in a spawned task's future
        // is not `Send` for every lifetime, as `tokio::spawn` asks.
        let reads: Vec<_> = (partitions.iter())
            .map(|partition| {
                let mut pipe = redis::pipe();
                pipe.cmd("HMGET").arg(&partition.keys[COUNTS]);
                pipe.arg(&["v", "lines", "schedule", "active", "dead", "keys"]);
                pipe.zrange_withscores(&partition.keys[OLDEST], 0, 0);
                let mut conn = conn.clone();
                async move { pipe.query_async::<Read>(&mut conn).await }
            })
            .collect();
        let read: Vec<Read> = futures_util::stream::iter(reads)
            .buffered(COPIES_AT_ONCE)
            .try_collect()
            .await
            .map_err(Error::redis(attempted()))?;
        let mut cmd = COPY.call(4);
        cmd.arg(&copies).arg(&queue[COUNTS]).arg(&queue[OLDEST]);
        cmd.arg(dead_partitions(keys))
            .arg(if force { "1" } else { "0" });
        for ((slot, partition), (counts, first)) in slots.iter().zip(&partitions).zip(read) {
            cmd.arg(slot).arg(&partition.keys[READY]);
            cmd.arg(&counts.map(|n| n.unwrap_or(0))[..]);
            cmd.arg(first.first().map_or(-1, |(_, ms)| *ms));
        }
        let went_back: Vec<u16> = run(&*COPY, &cmd, &mut conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        older.extend(went_back);
    }
    Ok(older)
}

/// The copies kept in the queue's slot (see `lua/keyed_mirror.lua`).
fn copies_key(keys: &QueueKeys) -> String {
    format!("{}:keyed:copies", keys.base)
}

/// The mark of a copy of every partition (see
/// [`first_copies`](Keyed::first_copies)).
fn copied_mark(keys: &QueueKeys) -> String {
    format!("{}:keyed:copied", keys.base)
}

/// The partitions whose copies hold dead letters (see
/// `lua/keyed_mirror.lua`).
fn dead_partitions(keys: &QueueKeys) -> String {
    format!("{}:keyed:dead_partitions", keys.base)
}
