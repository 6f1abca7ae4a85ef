//! A queue spread over shards (see docs/cluster.md, "One queue across a
//! Redis Cluster"). Shard 0 is the queue's own keys, `<prefix>:{<queue>}:…`, so a
//! queue of one shard is the plain queue; shard `i` of `n` keeps the same
//! keys under `<prefix>:{<t>}#<i>:<queue>:…`, where `<t>` is the tag of the
//! slot `(CRC16(tag(queue)) mod 16384 + i × 16384 / n) mod 16384` (`tag`:
//! the queue name escaped as inside its keys' braces): slots evenly apart,
//! which a cluster whose masters hold contiguous ranges places on different
//! masters. (`#` after the tag, where every other layout has `:`, keeps a
//! shard's keys apart from any keyed partition in the same slot.) A message
//! without a key lives in shard `(CRC16(id) mod 16384) mod n`, its id's
//! slot modulo `n`; keyed messages stay in their keys' partitions. The
//! queue's own slot keeps what spans the shards: the index of partitions,
//! where shard `i` is member `16384 + i` (from when it may have work), the
//! bell, and the record of `n`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;
use redis::{Cmd, Value};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::keyed::{RECHECK_MS, lock, shares};
use super::scripts::{self, Query};
use super::{Claimed, Queue, QueueKeys};
use crate::error::{Error, Result};
use crate::keys::{self, SLOTS};
use crate::script::{run, run_after, run_then};

/// The most shards a queue can have.
pub const MAX_SHARDS: usize = 256;

/// A queue's shards, shared by its handles' clones.
#[derive(Debug)]
pub(crate) struct Shards {
    /// Each shard's keys; `[0]` is the queue's own.
    pub(crate) keys: Vec<Arc<QueueKeys>>,
    /// Whether `n` was checked against the queue's record.
    checked: tokio::sync::OnceCell<()>,
    /// Whether this handle put the queue's name in the prefix's list of
    /// queues (see `Queue::register`).
    pub(crate) registered: tokio::sync::OnceCell<()>,
    /// The shard the next claim starts with.
    turn: AtomicUsize,
    /// The shards other than 0 the last reading of the index found with
    /// work, less those a claim found empty since.
    due: Mutex<Vec<usize>>,
    /// Per shard, whether this handle's last claim there left a backlog.
    backlog: Vec<AtomicBool>,
    /// The server's time at the last reading of the index, and when.
    clock: Mutex<(i64, Instant)>,
}

impl Shards {
    pub(crate) fn new(own: Arc<QueueKeys>, n: usize) -> Self {
        let keys = (0..n)
            .map(|i| match i {
                0 => own.clone(),
                i => Arc::new(QueueKeys::at(
                    &own.prefix,
                    &own.name,
                    shard_base(&own, i, n),
                )),
            })
            .collect();
        Self {
            keys,
            checked: tokio::sync::OnceCell::new(),
            registered: tokio::sync::OnceCell::new(),
            turn: AtomicUsize::new(0),
            due: Mutex::default(),
            backlog: (0..n).map(|_| AtomicBool::new(false)).collect(),
            clock: Mutex::new((0, Instant::now())),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The shard a message without a key goes to: by its id, so that a
    /// given id always meets itself (dedup by id holds).
    pub(crate) fn of(&self, id: &str) -> usize {
        match self.keys.len() {
            1 => 0,
            n => usize::from(keys::slot_of(id)) % n,
        }
    }

    /// The server's time now, as the last reading of the index and the
    /// time since tell it (ms; for the index entries a claim raises).
    fn now(&self) -> i64 {
        let (at, when) = *lock(&self.clock);
        at + i64::try_from(when.elapsed().as_millis()).unwrap_or(0)
    }

    /// Takes in a reading of the shards' index entries (`scores`, shard 1
    /// on) at the server's `now`: those due have work.
    fn read_index(&self, scores: &[Option<f64>], now: i64) {
        let due = (scores.iter().enumerate())
            .filter(|(_, score)| score.is_some_and(|at| at <= now as f64))
            .map(|(i, _)| i + 1);
        *lock(&self.due) = due.collect();
        *lock(&self.clock) = (now, Instant::now());
    }

    /// The keys of shard `i`.
    pub(crate) fn get(&self, i: usize) -> Result<&Arc<QueueKeys>> {
        self.keys.get(i).ok_or_else(|| {
            Error::config(format_args!(
                "a claim of shard {i}, but queue `{}` has {} shards here",
                self.keys[0].name,
                self.keys.len()
            ))
        })
    }
}

/// Refuses a shard count outside 1..=[`MAX_SHARDS`].
pub(crate) fn check_count(n: usize) -> Result<()> {
    super::check_count("a queue's shard count", n, 1..=MAX_SHARDS)
}

/// The key stem of shard `i` (of `n`, `i` ≥ 1).
fn shard_base(own: &QueueKeys, i: usize, n: usize) -> String {
    let name = keys::tag(&own.name);
    let step = usize::from(SLOTS) * i / n;
    let slot = (usize::from(keys::slot_of(&name)) + step) % usize::from(SLOTS);
    let tag = keys::slot_tag(u16::try_from(slot).unwrap_or_default());
    format!("{}:{{{tag}}}#{i}:{name}", own.prefix)
}

/// Shard `i`'s member in the queue's index of partitions (above every slot).
fn member(i: usize) -> usize {
    usize::from(SLOTS) + i
}

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The queue's shards, once their count was checked against the one the
    /// queue was created with: a queue of more than one shard records its
    /// count on first use, and a handle configured with another is refused.
    pub(crate) async fn layout(&self) -> Result<&Shards> {
        let shards = &*self.shards;
        let check = || async {
            let record = &self.keys.shards;
            let n = shards.len();
            let attempted = || format!("reading the shard count of queue `{}`", self.name());
            let recorded: Option<usize> = match n {
                // One shard is the plain queue: nothing recorded.
                1 => Cmd::get(record).query_on(&self.conn, attempted).await?,
                n => {
                    let mut pipe = redis::pipe();
                    pipe.cmd("SET").arg(record).arg(n).arg("NX").ignore();
                    pipe.get(record);
                    let (recorded,): (Option<usize>,) = (pipe.query_async(&mut self.conn.clone()))
                        .await
                        .map_err(Error::redis(attempted()))?;
                    recorded
                }
            };
            match recorded {
                Some(m) if m != n => Err(Error::config(format_args!(
                    "queue `{}` was created with {m} shards, this handle has {n}: give every \
                     producer and worker of a queue the shard count it was created with",
                    self.name()
                ))),
                _ => Ok(()),
            }
        };
        shards.checked.get_or_try_init(check).await?;
        Ok(shards)
    }

    /// This handle with the shard count the queue was created with, as
    /// recorded in Redis (one when none is: the plain queue). For tools
    /// that open queues by name, such as the `lockgate` command.
    pub async fn with_recorded_shards(self) -> Result<Self> {
        let attempted = || format!("reading the shard count of queue `{}`", self.name());
        let n: Option<usize> = (Cmd::get(&self.keys.shards))
            .query_on(&self.conn, attempted)
            .await?;
        let queue = self.shards(n.unwrap_or(1))?;
        // Checked against the record just read: `layout` need not read it.
        let _ = queue.shards.checked.set(());
        Ok(queue)
    }

    /// The keys of the shard `job` was claimed from.
    pub(crate) fn shard_of(&self, job: &super::ClaimToken) -> Result<&QueueKeys> {
        self.shards.get(usize::from(job.shard)).map(|k| &**k)
    }

    /// Whether the connection is to a Redis Cluster.
    async fn is_cluster(&self) -> Result<bool> {
        self.keyed().is_cluster().await
    }

    /// Tells the queue's workers that shard `i` has work from `due` (server
    /// ms; 0: now): see [`mark_shards`](Self::mark_shards).
    pub(crate) async fn mark_shard(&self, i: usize, due: i64) -> Result<()> {
        self.mark_shards(&[(i, due)]).await
    }

    /// [`mark_shard`](Self::mark_shard) after a script gave the shard its
    /// work: a failure is logged, not returned (the change stands, and a
    /// resend would be refused); the shard is looked at again within
    /// `RECHECK_MS` at the latest.
    pub(crate) async fn mark_shard_after(&self, i: usize, due: i64) {
        if let Err(error) = self.mark_shard(i, due).await {
            tracing::warn!(queue = %self.name(), shard = i, %error, "could not mark a shard after a change; the index's next look finds it");
        }
    }

    /// Tells the queue's workers that each shard `i` has work from its
    /// `due`: the index entries of those other than shard 0 (whose scripts
    /// ring themselves) are lowered to it and the bell rings, in one round
    /// trip, sent after the scripts that gave the shards that work.
    pub(crate) async fn mark_shards(&self, marks: &[(usize, i64)]) -> Result<()> {
        let k = &self.keys;
        let mut pipe = redis::pipe();
        for (i, due) in marks.iter().filter(|(i, _)| *i > 0) {
            let index = pipe.cmd("ZADD").arg(&k.partitions).arg("LT");
            index.arg((*due).max(0)).arg(member(*i)).ignore();
        }
        if pipe.is_empty() {
            return Ok(());
        }
        pipe.lpush(&k.bell, 1)
            .ignore()
            .ltrim(&k.bell, 0, 0)
            .ignore();
        let marked = pipe.query_async::<()>(&mut self.conn.clone()).await;
        marked.map_err(Error::redis(format!("ringing queue `{}`", self.name())))
    }

    /// Puts every shard missing from the index in it, due now: a producer
    /// that stopped between its push and its mark leaves a shard's first
    /// messages unmarked until this runs (with `recover`). A shard in the
    /// index is looked at within `RECHECK_MS` at the latest.
    pub(crate) async fn index_shards(&self) -> Result<()> {
        if self.shards.len() == 1 {
            return Ok(());
        }
        let mut add = redis::cmd("ZADD");
        add.arg(&self.keys.partitions).arg("NX");
        for i in 1..self.shards.len() {
            add.arg(0).arg(member(i));
        }
        add.query_on(&self.conn, || {
            format!("indexing the shards of queue `{}`", self.name())
        })
        .await
    }

    /// Claims up to `max` across the shards, in batches per shard: each
    /// call starts with the next shard in turn and takes what it can there
    /// before it goes on round the ring to the next one with work, so that
    /// under a backlog one call is one shard's batch and the shards take
    /// turns. Shard 0's claim script reads the index of shards with work;
    /// between its turns the last reading is used, and read again when the
    /// shards known to have work come up short. Returns the claimed jobs,
    /// the keyed partitions with work (when the index was read), and the
    /// server's time.
    pub(crate) async fn claim_shards(
        &self,
        max: usize,
        lease: Duration,
    ) -> Result<(Claimed<T>, Vec<u16>, i64)> {
        let shards = &*self.shards;
        let turn = shards.turn.fetch_add(1, Ordering::Relaxed) % shards.len();
        let known = lock(&shards.due).clone();
        let mut claimed = Claimed {
            jobs: Vec::new(),
            next_due: None,
            buried: 0,
        };
        let (mut entries, mut now, mut visited) = (Vec::new(), shards.now(), Vec::new());
        let mut failed = None;
        if turn > 0 && !known.is_empty() {
            let limits = (now, max, lease);
            visited = self
                .claim_round(&known, turn, limits, (&mut claimed, &mut failed))
                .await;
        }
        if claimed.jobs.len() < max {
            match self.read_shards(max - claimed.jobs.len(), lease).await {
                Ok((more, read, at)) => {
                    add(&mut claimed, more);
                    (entries, now) = (read, at);
                    let fresh = lock(&shards.due).clone();
                    let fresh: Vec<usize> = (fresh.into_iter())
                        .filter(|i| !visited.contains(i))
                        .collect();
                    let limits = (now, max, lease);
                    self.claim_round(&fresh, turn, limits, (&mut claimed, &mut failed))
                        .await;
                }
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        match failed {
            Some(error) if claimed.jobs.is_empty() => Err(error),
            Some(error) => {
                // The jobs claimed elsewhere are leased: they must reach the
                // caller; the failed shard is tried again on the next claim.
                tracing::warn!(queue = %self.name(), %error, "a shard could not be claimed from; returning what the others gave");
                Ok((claimed, entries, now))
            }
            None => Ok((claimed, entries, now)),
        }
    }

    /// Claims up to `max` from shard 0, whose script reads the index of
    /// partitions too, then reads the shards' entries in it (`ZMSCORE`: a
    /// claim's reading names only the first partitions with work).
    async fn read_shards(
        &self,
        max: usize,
        lease: Duration,
    ) -> Result<(Claimed<T>, Vec<u16>, i64)> {
        let k = &self.keys;
        let cmd = self.claim_call(k, (max, lease), super::keyed::PARTITIONS_PER_CLAIM);
        let members: Vec<usize> = (1..self.shards.len()).map(member).collect();
        let mut scores = redis::cmd("ZMSCORE");
        scores.arg(&k.partitions).arg(&members);
        // One round trip: both keys are in the queue's own slot.
        let attempted = || format!("claiming from queue `{}`", self.name());
        let window = crate::script::resend_window(lease);
        let send =
            || async { run_then(&scripts::CLAIM, &cmd, &scores, &mut self.conn.clone()).await };
        let (reply, scores): (Vec<Value>, Vec<Option<f64>>) =
            (crate::script::resending(window, send).await).map_err(Error::redis(attempted()))?;
        let (claimed, entries, now) = self.decode_claimed(reply, 0, attempted).await?;
        self.shards.read_index(&scores, now);
        Ok((claimed, entries, now))
    }

    /// Claims from the shards `due`, from the one in `turn` on round the
    /// ring, until `max` are claimed; returns the shards it visited. The
    /// shard in turn is asked first, for all the room (under a backlog it
    /// fills it: one call is one shard's batch, and the shards take turns);
    /// what room it leaves is shared among the others, asked all at once,
    /// and again among those that filled their share. A shard that fails
    /// is passed over, its error kept in `failed`.
    async fn claim_round(
        &self,
        due: &[usize],
        turn: usize,
        (now, max, lease): (i64, usize, Duration),
        (claimed, failed): (&mut Claimed<T>, &mut Option<Error>),
    ) -> Vec<usize> {
        let n = self.shards.len();
        let mut left = due.to_vec();
        left.sort_unstable_by_key(|i| (*i + n - turn.max(1)) % n);
        let mut visited = Vec::new();
        let mut first = true;
        while claimed.jobs.len() < max && !left.is_empty() {
            let room = max - claimed.jobs.len();
            let wave = if first { 1 } else { left.len().min(room) };
            first = false;
            let shares = shares(room, wave);
            let claims = (left.iter().zip(&shares))
                .map(|(i, share)| self.claim_shard(*i, (now, *share, lease)));
            let answers = futures_util::future::join_all(claims).await;
            let mut more = Vec::new();
            for ((i, share), answer) in left.iter().zip(shares).zip(answers) {
                visited.push(*i);
                match answer {
                    // A shard that filled its share may have more.
                    Ok(got) if got.jobs.len() == share => {
                        more.push(*i);
                        add(claimed, got);
                    }
                    Ok(got) => add(claimed, got),
                    Err(error) => {
                        failed.get_or_insert(error);
                    }
                }
            }
            // Those not asked yet, then those that may have more.
            more.splice(0..0, left.drain(wave..));
            left = more;
        }
        visited.sort_unstable();
        visited.dedup();
        visited
    }

    /// Claims up to `max` of shard `i`. Its index entry is raised before the
    /// claim and lowered after it only to what the claim saw: a push that
    /// came in between lowers it itself, after its own script. While this
    /// handle's claims find a backlog there, the entry stays due and is
    /// left as it is (raising and lowering it would change nothing).
    async fn claim_shard(
        &self,
        i: usize,
        (now, max, lease): (i64, usize, Duration),
    ) -> Result<Claimed<T>> {
        let k = &self.shards.keys[i];
        let attempted = || format!("claiming from shard {i} of queue `{}`", self.name());
        let cmd = self.claim_call(k, (max, lease), 0);
        let backlog = &self.shards.backlog[i];
        let mut raise = redis::cmd("ZADD");
        raise.arg(&self.keys.partitions).arg("XX");
        raise.arg(now + RECHECK_MS).arg(member(i));
        // The raise must reach the server before the script: one round trip
        // on one server, two on a cluster (the index and the shard are on
        // different nodes, whose order a pipeline does not keep).
        let window = crate::script::resend_window(lease);
        let alone = || async { run(&scripts::CLAIM, &cmd, &mut self.conn.clone()).await };
        let reply: Vec<Value> = match (backlog.load(Ordering::Relaxed), self.is_cluster().await?) {
            (true, _) => crate::script::resending(window, alone).await,
            (false, false) => {
                let after_raise = || async {
                    run_after(&scripts::CLAIM, &raise, &cmd, &mut self.conn.clone()).await
                };
                crate::script::resending(window, after_raise).await
            }
            (false, true) => {
                raise.query_on::<(), _>(&self.conn, attempted).await?;
                crate::script::resending(window, alone).await
            }
        }
        .map_err(Error::redis(attempted()))?;
        let (from_shard, _, shard_now) = self.decode_claimed(reply, i, attempted).await?;
        let next_due = from_shard.next_due;
        let was_backlog = backlog.swap(next_due == Some(Duration::ZERO), Ordering::Relaxed);
        match next_due {
            // Nothing left: the raised entry stays (or, after a backlog,
            // the due one: the next visit raises it).
            None => lock(&self.shards.due).retain(|due| *due != i),
            Some(wait) if wait.is_zero() && was_backlog => {}
            Some(wait) => {
                let at = shard_now + i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
                // The claimed jobs are leased: they reach the caller even
                // when the lowering fails (the entry is looked at again
                // within `RECHECK_MS`).
                if let Err(error) = self.lower(i, at, wait.is_zero()).await {
                    tracing::warn!(queue = %self.name(), %error, "could not lower a shard's index entry after a claim");
                }
            }
        }
        Ok(from_shard)
    }

    /// Lowers shard `i`'s index entry to `at` (server ms) and, for a
    /// backlog, rings the bell: another idle worker may take part of it.
    async fn lower(&self, i: usize, at: i64, ring: bool) -> Result<()> {
        let mut lower = redis::pipe();
        let index = lower.cmd("ZADD").arg(&self.keys.partitions);
        index.arg(&["XX", "LT"]).arg(at).arg(member(i)).ignore();
        if ring {
            let bell = &self.keys.bell;
            lower.lpush(bell, 1).ignore().ltrim(bell, 0, 0).ignore();
        }
        let lowered = lower.query_async::<()>(&mut self.conn.clone()).await;
        lowered.map_err(Error::redis(format!(
            "claiming from queue `{}`",
            self.name()
        )))
    }
}

/// Adds what one claim script claimed to `claimed`.
fn add<T>(claimed: &mut Claimed<T>, more: Claimed<T>) {
    claimed.buried += more.buried;
    claimed.jobs.extend(more.jobs);
    if let Some(wait) = more.next_due {
        claimed.next_due = Some(claimed.next_due.map_or(wait, |d| d.min(wait)));
    }
}
