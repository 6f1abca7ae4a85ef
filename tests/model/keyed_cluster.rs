//! Keyed leases on a Redis Cluster (issue 35, item 7). There a partition's
//! scripts live in its own hash slot and cannot reach the queue's leases
//! index, so the callers keep it: a claim lowers the entries of the
//! partitions it visits to the leases it may give, before it gives them and
//! again after; a due sweep takes the due entries out and marks their
//! visits (`lua/keyed_leases_due.lua`) and settles them after, to what
//! each visit found (`lua/leases_settle.lua`). The model on one server
//! (`keyed.rs`) never runs these.
//!
//! Random histories of pushes over twelve keys (three to a partition,
//! spread over the three nodes), claims under a short or a long lease, acknowledgements (alone,
//! or handing the key to its next message under the message's own lease),
//! renewals to the long lease, burials, and sweeps once the short leases have run
//! out, on a three-node cluster. After every step each message at work has
//! its partition in the index no later than its lease's end: the index
//! never hides a lease. A sweep puts every message of a short lease back
//! in line and none of a long one, and a full sweep right after finds
//! nothing it left. Every history ends by running the queue dry: each
//! message acknowledged exactly once.
//!
//! The queue's counts (issue 35, item 8): a partition's scripts keep its
//! own, and the queue's handles copy them into the queue's slot, where
//! `stats` reads them (`lua/keyed_mirror.lua`). After every step the
//! handle's `stats` are the history's: its messages in line, at work,
//! buried and their keys, and `dead_letters` lists the buried ones (from
//! the partitions whose copies hold dead letters); at the end another
//! handle's read the same once the copies of the last changes have
//! landed.
//!
//! Sweepers die too (issue 35, CI): a sweep that reads the due partitions
//! and never settles them (its process killed, or its visit failed) leaves
//! them out of the index and marked as being visited; a mark older than
//! the time a sweep may take is due again, so the next due sweep after
//! that finds their leases, whatever claims wrote in the index meanwhile.
//! The model's dead sweeper runs the library's script
//! (`lua/keyed_leases_due.lua`) and died that time ago (its marks are
//! moved back by it).
//!
//! Hand-overs keep the message's own lease and renewals lengthen it: a
//! shorter lease given by either is one of the cases left to the full
//! sweep (docs/keyed.md, "Recovery sweeps").

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lockgate::testing::RedisCluster;
use lockgate::{Job, PushOptions, Queue};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use redis::cluster_async::ClusterConnection;

const KEYS: usize = 12;
/// Three keys to a hash slot, so that a partition holds several keys'
/// leases at once (slots 0 and 1 on the first node, 5461 on the second,
/// 10923 on the third).
const NAMES: [&str; KEYS] = [
    "k596", "k11493", "k22450", "k37999", "k48492", "k88788", "k13535", "k16247", "k25284",
    "k69207", "k78246", "k84808",
];
const SHORT: Duration = Duration::from_millis(200);
const LONG: Duration = Duration::from_secs(600);
/// How much of a short lease must be left for a step to settle or renew
/// its message: on a slow machine a lease may run out between two steps,
/// and the step is then skipped (the next sweep puts it back in line).
const MARGIN: Duration = Duration::from_millis(100);
/// The stalls a sweep allows before burying: a message whose short lease
/// runs out again and again goes back in line each time.
const NEVER_BURIED: u32 = 1_000;
/// The script that reads the due partitions and marks their visits, as a
/// sweep on a cluster runs it.
const LEASES_DUE: &str = include_str!("../../src/queue/lua/keyed_leases_due.lua");
/// How long a sweep may take to visit the partitions it read
/// (`VISIT_BOUND` in `src/queue/keyed/partitions.rs`): the model's dead
/// sweeper died that long ago.
const VISIT_BOUND: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy)]
enum Op {
    /// `count` messages of key `key`.
    Push { key: usize, count: usize },
    /// Up to `max` messages, under the long lease or the short one.
    Claim { max: usize, long: bool },
    /// The `pick`th message at work is acknowledged; with `next`, its
    /// key's next message is claimed in the same call, under its lease.
    Ack { pick: usize, next: bool },
    /// The `pick`th message at work is renewed to the long lease.
    Renew { pick: usize },
    /// Waits out the short leases, then sweeps.
    Sweep,
    /// The `pick`th message at work is buried.
    Bury { pick: usize },
    /// Waits out the short leases, then a sweeper reads the due partitions,
    /// marking their visits, and dies.
    DeadSweeper,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..KEYS, 1..=3usize).prop_map(|(key, count)| Op::Push { key, count }),
        4 => (1..=6usize, any::<bool>()).prop_map(|(max, long)| Op::Claim { max, long }),
        3 => (0..KEYS * 3, any::<bool>()).prop_map(|(pick, next)| Op::Ack { pick, next }),
        1 => (0..KEYS * 3).prop_map(|pick| Op::Renew { pick }),
        1 => Just(Op::Sweep),
        1 => (0..KEYS * 3).prop_map(|pick| Op::Bury { pick }),
        1 => Just(Op::DeadSweeper),
    ]
}

/// A message at work: its lease, when that was given (by this process's
/// clock), and the latest its lease can end (Unix ms).
struct AtWork {
    job: Job<u64>,
    lease: Duration,
    given: Instant,
    ends_by: i64,
}

struct World {
    conn: ClusterConnection,
    queue: Queue<u64, ClusterConnection>,
    name: String,
    at_work: Vec<AtWork>,
    pushed: u64,
    acked: BTreeMap<u64, usize>,
    /// Each message pushed and not yet acknowledged or buried: its key.
    unacked: BTreeMap<u64, usize>,
    /// The messages buried: key and id.
    buried: BTreeSet<(String, String)>,
    slots: HashMap<String, u16>,
    /// Whether a sweeper died since the last sweep.
    dead_sweeper: bool,
}

fn unix_ms() -> i64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH);
    since.map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn fail(at: &str, error: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(format!("{at}: {error}"))
}

impl World {
    /// The hash slot of `text`, asked of the cluster once.
    async fn slot(&mut self, text: &str) -> Result<u16, TestCaseError> {
        if let Some(slot) = self.slots.get(text) {
            return Ok(*slot);
        }
        let mut ask = redis::cmd("CLUSTER");
        ask.arg("KEYSLOT").arg(text);
        let slot: u16 = (ask.query_async(&mut self.conn).await).map_err(|e| fail(text, e))?;
        self.slots.insert(text.to_owned(), slot);
        Ok(slot)
    }

    fn leased(&mut self, job: Job<u64>, lease: Duration, given: Instant) {
        let ends_by = unix_ms() + i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        (self.at_work).push(AtWork {
            job,
            lease,
            given,
            ends_by,
        });
    }

    /// Whether the `pick`th message at work (if any) has enough of its
    /// lease left to be settled or renewed by a step.
    fn pick(&self, pick: usize) -> Option<usize> {
        let i = pick.checked_rem(self.at_work.len())?;
        let left = self.at_work[i]
            .lease
            .checked_sub(self.at_work[i].given.elapsed());
        left.is_some_and(|left| left > MARGIN).then_some(i)
    }

    fn acked(&mut self, job: &Job<u64>) {
        *self.acked.entry(*job.payload()).or_default() += 1;
        self.unacked.remove(job.payload());
    }

    async fn run(&mut self, op: Op, at: &str) -> Result<(), TestCaseError> {
        match op {
            Op::Push { key, count } => {
                for _ in 0..count {
                    let n = key as u64 * 1000 + self.pushed;
                    self.pushed += 1;
                    self.unacked.insert(n, key);
                    let options = PushOptions::new().key(NAMES[key]);
                    (self.queue.push_with(n, options).await).map_err(|e| fail(at, e))?;
                }
            }
            Op::Claim { max, long } => {
                let lease = if long { LONG } else { SHORT };
                let given = Instant::now();
                let claimed = self.queue.claim(max, lease).await;
                for job in claimed.map_err(|e| fail(at, e))?.jobs {
                    self.leased(job, lease, given);
                }
            }
            Op::Ack { pick, next } => {
                let Some(i) = self.pick(pick) else {
                    return Ok(());
                };
                let at_work = self.at_work.remove(i);
                let given = Instant::now();
                let (held, next) = match next {
                    true => self.queue.ack_and_next(&at_work.job, at_work.lease).await,
                    false => (self.queue.ack(&at_work.job).await).map(|held| (held, None)),
                }
                .map_err(|e| fail(at, e))?;
                prop_assert!(held, "{at}: a lease with time left was lost");
                self.acked(&at_work.job);
                if let Some(job) = next {
                    prop_assert_eq!(job.key(), at_work.job.key(), "{}", at);
                    self.leased(job, at_work.lease, given);
                }
            }
            Op::Renew { pick } => {
                let Some(i) = self.pick(pick) else {
                    return Ok(());
                };
                let renewed = self.queue.extend([&self.at_work[i].job], LONG).await;
                prop_assert_eq!(renewed.map_err(|e| fail(at, e))?, vec![true], "{}", at);
                let at_work = self.at_work.remove(i);
                self.leased(at_work.job, LONG, Instant::now());
            }
            Op::Sweep => self.sweep(at).await?,
            Op::DeadSweeper => {
                // (After the short leases ran out: it reads their partitions.)
                tokio::time::sleep(SHORT + Duration::from_millis(50)).await;
                let script = redis::Script::new(LEASES_DUE);
                let mut read = script.prepare_invoke();
                read.key(format!("lockgate:{{{}}}:keyed:leases", self.name));
                read.key(format!("lockgate:{{{}}}:keyed:visiting", self.name));
                read.arg(1024)
                    .arg(VISIT_BOUND.as_millis() as u64)
                    .arg("0.5");
                let marked: Vec<String> =
                    (read.invoke_async(&mut self.conn).await).map_err(|e| fail(at, e))?;
                // It died a sweep's time ago: its marks are that old.
                let mut age = redis::cmd("ZADD");
                age.arg(format!("lockgate:{{{}}}:keyed:visiting", self.name));
                let then = marked[0].parse::<f64>().map_err(|e| fail(at, e))?;
                let then = then - VISIT_BOUND.as_millis() as f64;
                age.arg("XX");
                for tag in &marked[1..] {
                    age.arg(then).arg(tag);
                }
                if marked.len() > 1 {
                    let _: () = (age.query_async(&mut self.conn).await).map_err(|e| fail(at, e))?;
                }
                self.dead_sweeper = true;
            }
            Op::Bury { pick } => {
                let Some(i) = self.pick(pick) else {
                    return Ok(());
                };
                let at_work = self.at_work.remove(i);
                let held =
                    (self.queue.bury(&at_work.job, "model").await).map_err(|e| fail(at, e))?;
                prop_assert!(held, "{at}: a lease with time left was lost");
                let job = &at_work.job;
                self.unacked.remove(job.payload());
                let key = job.key().unwrap_or_default().to_owned();
                self.buried.insert((key, job.id().to_owned()));
            }
        }
        self.check_index(at).await?;
        self.check_counts(at).await
    }

    /// The handle's `stats` are the history's: every message not yet
    /// acknowledged or buried in line or at work (a short lease run out
    /// stays at work until a sweep), their keys, and the dead letters,
    /// which `dead_letters` lists (from the partitions whose copied counts
    /// hold some).
    async fn check_counts(&mut self, at: &str) -> Result<(), TestCaseError> {
        let stats = (self.queue.stats().await).map_err(|e| fail(at, e))?;
        let active = self.at_work.len() as u64;
        let keys: BTreeSet<usize> = self.unacked.values().copied().collect();
        let dead = self.buried.len() as u64;
        let waiting = self.unacked.len() as u64 - active;
        prop_assert_eq!(
            (stats.due, stats.later, stats.active, stats.dead, stats.keys),
            (waiting, 0, active, dead, keys.len() as u64),
            "{}: the queue's counts (due, later, active, dead, keys)",
            at
        );
        let page = (self.queue.dead_letters(None, 500).await).map_err(|e| fail(at, e))?;
        let listed: BTreeSet<(String, String)> = (page.letters.into_iter())
            .map(|letter| (letter.key.unwrap_or_default(), letter.id))
            .collect();
        prop_assert_eq!(&listed, &self.buried, "{}: the dead letters listed", at);
        Ok(())
    }

    /// Waits out the short leases, then a due sweep puts exactly their
    /// messages back in line, and a full sweep after it finds nothing.
    async fn sweep(&mut self, at: &str) -> Result<(), TestCaseError> {
        tokio::time::sleep(SHORT + Duration::from_millis(50)).await;
        let short = self.at_work.iter().filter(|w| w.lease == SHORT).count();
        let due = (self.queue.recover(NEVER_BURIED).await).map_err(|e| fail(at, e))?;
        prop_assert_eq!(
            (due.requeued, due.buried),
            (short, 0),
            "{}: the due sweep",
            at
        );
        self.at_work.retain(|w| w.lease != SHORT);
        self.dead_sweeper = false;
        self.check_index(&format!("{at}, after the due sweep"))
            .await?;
        let mut full = redis::cmd("DEL");
        full.arg(format!("lockgate:{{{}}}:recovering:full", self.name));
        let _: () = (full.query_async(&mut self.conn).await).map_err(|e| fail(at, e))?;
        let full = (self.queue.recover(NEVER_BURIED).await).map_err(|e| fail(at, e))?;
        prop_assert_eq!(full.requeued, 0, "{}: left by the due sweep", at);
        Ok(())
    }

    /// Each message at work has its partition (its key's slot) in the
    /// leases index no later than its lease's end, or marked as visited
    /// (by a sweeper that died since the last sweep, whose mark the next
    /// due sweep takes).
    async fn check_index(&mut self, at: &str) -> Result<(), TestCaseError> {
        let mut read = redis::cmd("ZRANGE");
        read.arg(format!("lockgate:{{{}}}:keyed:leases", self.name));
        read.arg(0).arg(-1).arg("WITHSCORES");
        let entries: Vec<(String, i64)> =
            (read.query_async(&mut self.conn).await).map_err(|e| fail(at, e))?;
        let mut index = HashMap::new();
        for (tag, score) in entries {
            index.insert(self.slot(&tag).await?, score);
        }
        let mut read = redis::cmd("ZRANGE");
        read.arg(format!("lockgate:{{{}}}:keyed:visiting", self.name));
        read.arg(0).arg(-1);
        let marks: Vec<String> =
            (read.query_async(&mut self.conn).await).map_err(|e| fail(at, e))?;
        let mut marked = HashSet::new();
        for tag in marks {
            marked.insert(self.slot(&tag).await?);
        }
        prop_assert!(
            self.dead_sweeper || marked.is_empty(),
            "{}: visits marked with no sweeper dead since the last sweep",
            at
        );
        let leases: Vec<(String, i64)> = (self.at_work.iter())
            .map(|w| (w.job.key().unwrap_or_default().to_owned(), w.ends_by))
            .collect();
        for (key, ends_by) in leases {
            let slot = self.slot(&key).await?;
            let entry = index.get(&slot).copied();
            prop_assert!(
                entry.is_some_and(|entry| entry <= ends_by) || marked.contains(&slot),
                "{}: key {} (slot {}) leased until at most {}, its entry {:?}",
                at,
                key,
                slot,
                ends_by,
                entry
            );
        }
        Ok(())
    }

    /// Runs the queue dry: each message pushed acknowledged exactly once.
    async fn drain(&mut self) -> Result<(), TestCaseError> {
        let short = self.at_work.iter().any(|w| w.lease == SHORT);
        for at_work in std::mem::take(&mut self.at_work) {
            // A short lease may have run out: its message comes again.
            if (self.queue.ack(&at_work.job).await).map_err(|e| fail("drain", e))? {
                self.acked(&at_work.job);
            }
        }
        if short || self.dead_sweeper {
            // (A dead sweeper's marks are due by then.)
            tokio::time::sleep(SHORT + Duration::from_millis(50)).await;
            (self.queue.recover(NEVER_BURIED).await).map_err(|e| fail("drain", e))?;
        }
        loop {
            let claimed = self.queue.claim(16, LONG).await;
            let jobs = claimed.map_err(|e| fail("drain", e))?.jobs;
            if jobs.is_empty() {
                break;
            }
            for job in jobs {
                let held = (self.queue.ack(&job).await).map_err(|e| fail("drain", e))?;
                prop_assert!(held, "drain: a long lease lost");
                self.acked(&job);
            }
        }
        prop_assert_eq!(
            (self.acked.len() + self.buried.len()) as u64,
            self.pushed,
            "every message handled or buried"
        );
        let twice: Vec<_> = self.acked.iter().filter(|(_, n)| **n > 1).collect();
        prop_assert!(twice.is_empty(), "acknowledged twice: {:?}", twice);
        // Another handle reads what this one's copies left (the dead
        // letters alone), once its task has copied them (before this
        // handle's own `stats` would).
        let other: Queue<u64, _> =
            Queue::new(self.conn.clone(), &self.name).map_err(|e| fail("other", e))?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let stats = (other.stats().await).map_err(|e| fail("other", e))?;
            let counts = (stats.due, stats.later, stats.active, stats.dead, stats.keys);
            if counts == (0, 0, 0, self.buried.len() as u64, 0) {
                break;
            }
            prop_assert!(
                Instant::now() < deadline,
                "another handle still reads {:?}",
                stats
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.check_counts("drained").await
    }
}

async fn run_history(
    conn: &ClusterConnection,
    n: usize,
    history: &[Op],
) -> Result<(), TestCaseError> {
    let name = format!("kc-{n}");
    let queue = Queue::new(conn.clone(), &name).map_err(|e| fail("queue", e))?;
    // The first sweep of a queue is its full one: the history's are due
    // sweeps.
    (queue.recover(NEVER_BURIED).await).map_err(|e| fail("first sweep", e))?;
    let mut world = World {
        conn: conn.clone(),
        queue,
        name,
        at_work: Vec::new(),
        pushed: 0,
        acked: BTreeMap::new(),
        unacked: BTreeMap::new(),
        buried: BTreeSet::new(),
        slots: HashMap::new(),
        dead_sweeper: false,
    };
    for (step, op) in history.iter().enumerate() {
        world.run(*op, &format!("step {step} ({op:?})")).await?;
    }
    world.drain().await
}

#[test]
fn keyed_leases_on_a_cluster_stay_in_the_leases_index_and_sweeps_find_them() {
    let cluster = RedisCluster::start().expect("a three-node test cluster starts");
    let runtime = crate::runtime();
    let conn = runtime
        .block_on(cluster.connection())
        .expect("a connection");
    let histories = prop::collection::vec(op(), 1..30);
    crate::run("keyed leases on a cluster", 10, histories, |history, n| {
        runtime.block_on(run_history(&conn, n + 1, &history))
    });
}

/// A partition holding a long lease and a short one: the sweep after the
/// short one ran out puts it back and keeps the partition in the index for
/// the long one.
#[test]
fn a_sweep_keeps_the_entry_of_a_partition_with_a_lease_left() {
    let cluster = RedisCluster::start().expect("a three-node test cluster starts");
    let runtime = crate::runtime();
    let conn = runtime
        .block_on(cluster.connection())
        .expect("a connection");
    let history = [
        Op::Push { key: 0, count: 1 },
        Op::Push { key: 1, count: 1 },
        Op::Claim { max: 1, long: true },
        Op::Claim {
            max: 1,
            long: false,
        },
        Op::Sweep,
        Op::Sweep,
    ];
    if let Err(failure) = runtime.block_on(run_history(&conn, 0, &history)) {
        panic!("{failure}");
    }
}
