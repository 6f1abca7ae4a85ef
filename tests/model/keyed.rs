//! Keyed messages through every script that moves them (issue 23): pushed
//! with their key (ids that repeat, delays), claimed with short and long
//! leases, acknowledged (also with the key's next message claimed in the
//! same script, as the worker does, under a short or a long lease of its
//! own: a chain whose lease runs out is recovered like any turn, issue
//! 35), retried, deferred, released, buried, extended (one, or every job
//! the worker holds in one call) and recovered when their lease ran out
//! (a run whole), while code outside the queue takes and releases
//! the keys' locks; each step possibly resent (its reply lost, the same
//! call made again) or made over a connection the server just dropped.
//!
//! The model keeps each key's line. After every claim it checks that only
//! heads of lines came out, of keys with room (nothing of theirs at work,
//! not waiting out a delay, their lock not held outside), one per key (a
//! claim visits a partition again for the room its share left: each job
//! is a head once the jobs before it are at work), and
//! that claiming again until nothing comes leaves no key with room behind.
//! One key has 2 permits instead of a lock: its first message in line not
//! at work comes out while fewer than 2 of its messages are at work or
//! held by other code (`Locker::acquire_permit`), and its retries wait
//! aside rather than holding the key up. Another has a rate limit of 3 an
//! hour: after 3 claims (the acknowledgement's hand-overs included) it is
//! claimed no more. After every step the counts the scripts keep
//! (`Queue::stats`, issue 35) are the model's, and every partition with
//! messages at work is in the leases index no later than its first lease
//! ends (recovery visits what the index names).
//!
//! The three keys live in partitions of their own, on one server: a claim
//! takes them in one script call over the partitions (a block each), a
//! push of one message per key (`PushAll`) pushes them in one call over
//! the partitions, and a recovery sweep looks at them in one call, so
//! every check above holds across blocks of one call, resent ones
//! included.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use lockgate::queue::EventKind;
use lockgate::testing::RedisServer;
use lockgate::{Acquisition, Job, Lease, Locker, PushOptions, Queue};
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support::{self, ms, secs};
use crate::{Fault, fault};

/// Messages a history draws from: message `n` has key `n % KEYS` and id
/// `m<n / KEYS>`, so that one id names a message under each key (an id is
/// unique within its key, issue 37). Keys 0 and 1 share a hash slot (one
/// partition), key 2 is in another.
const IDS: usize = 12;
const KEYS: usize = 3;
/// The key with permits (`PushOptions::permits(LIMIT)`), not a lock.
const PERMITS_KEY: usize = 2;
const LIMIT: u32 = 2;
/// The key with a rate limit (`PushOptions::rate`), at most `RATE` claims
/// an hour: never more than `RATE` in a history.
const RATED_KEY: usize = 1;
const RATE: u32 = 3;
/// A lease that runs out at the next [`Op::Expire`].
const SHORT: Duration = ms(60);
const LONG: Duration = secs(600);
const LATER: Duration = secs(3600);
const MAX_STALLS: u32 = 2;

#[derive(Debug, Clone, Copy)]
enum Op {
    Push {
        id: usize,
        later: bool,
    },
    /// Every message of a key pushed, in order: a backlog for runs.
    Backlog(usize),
    /// One message of each key (the ids from `first`, one partition each)
    /// in one `push_many`: on one server, one script call over the
    /// partitions.
    PushAll {
        first: usize,
        later: bool,
    },
    /// `claim_runs`: up to `max` turns, each key with a lock and no rate
    /// limit giving up to `run` of its first messages (a run).
    Claim {
        max: usize,
        short: bool,
        run: usize,
    },
    Ack(usize),
    /// `ack_and_next` (`max` 1) or `ack_run` of one message: the key's
    /// next message, or up to `max` of them (a run), claimed by the ack,
    /// leased short or long.
    AckNext {
        job: usize,
        short: bool,
        max: usize,
    },
    /// `ack_run` of a run: the worker's other jobs of the same key and
    /// claim acknowledged with `job`, and the next run claimed.
    AckRun {
        job: usize,
        short: bool,
        max: usize,
    },
    /// `ack_runs`: several keys' runs acknowledged in one call, each as
    /// `AckRun` acknowledges one (the jobs `jobs` picks, one per key).
    AckRuns {
        jobs: [usize; 3],
        short: bool,
        max: usize,
    },
    /// `extend_run`: while `job` goes on at work, the worker's other jobs
    /// of its key and claim before it acknowledged, and up to `max` of the
    /// key's next messages claimed into its run (read ahead), leased short
    /// or long.
    ExtendRun {
        job: usize,
        short: bool,
        max: usize,
    },
    /// `cut_run`: while `job` (one the model says is held) goes on, the
    /// other jobs of its key and claim before it in line acknowledged,
    /// those after it back in line.
    CutRun(usize),
    Retry {
        job: usize,
        later: bool,
    },
    Defer(usize),
    Release(usize),
    Bury(usize),
    Extend {
        job: usize,
        short: bool,
    },
    /// Every job the worker holds (stale ones too) renewed in one
    /// `extend`: on one server, one script call over their partitions.
    ExtendAll {
        short: bool,
    },
    /// Waits out the short leases, then recovers.
    Expire,
    /// Waits out the short leases, and recovers nothing: a lock only short
    /// leases kept may lapse, one a long lease keeps may not.
    Lapse,
    /// Code outside the queue (a `Locker`) takes a key's lock.
    Hold(usize),
    /// ... and lets it go.
    Let(usize),
    /// A key's lock made another kind of Redis key (a hash), while nothing
    /// of the key is at work or held: claims pass the key over and go on
    /// with the others (`refuse` in `lua/keyed_claim.lua`).
    Poison(usize),
    /// ... and deleted.
    Cure(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let job = 0..8usize;
    prop_oneof![
        5 => (0..IDS, prop::bool::weighted(0.1)).prop_map(|(id, later)| Op::Push { id, later }),
        3 => (0..KEYS).prop_map(Op::Backlog),
        2 => (0..IDS / KEYS, prop::bool::weighted(0.1))
            .prop_map(|(row, later)| Op::PushAll { first: row * KEYS, later }),
        5 => (1..=3usize, prop::bool::weighted(0.3), prop_oneof![Just(1usize), 2..=4usize])
            .prop_map(|(max, short, run)| Op::Claim { max, short, run }),
        3 => job.clone().prop_map(Op::Ack),
        3 => (job.clone(), prop::bool::weighted(0.3), 1..=3usize).prop_map(|(job, short, max)| Op::AckNext { job, short, max }),
        2 => (job.clone(), prop::bool::weighted(0.3), 1..=3usize).prop_map(|(job, short, max)| Op::AckRun { job, short, max }),
        2 => ([job.clone(), job.clone(), job.clone()], prop::bool::weighted(0.3), 1..=3usize).prop_map(|(jobs, short, max)| Op::AckRuns { jobs, short, max }),
        2 => (job.clone(), prop::bool::weighted(0.3), 1..=3usize).prop_map(|(job, short, max)| Op::ExtendRun { job, short, max }),
        3 => job.clone().prop_map(Op::CutRun),
        2 => (job.clone(), prop::bool::weighted(0.3)).prop_map(|(job, later)| Op::Retry { job, later }),
        1 => job.clone().prop_map(Op::Defer),
        1 => job.clone().prop_map(Op::Release),
        1 => job.clone().prop_map(Op::Bury),
        2 => (job, any::<bool>()).prop_map(|(job, short)| Op::Extend { job, short }),
        1 => any::<bool>().prop_map(|short| Op::ExtendAll { short }),
        1 => Just(Op::Expire),
        2 => Just(Op::Lapse),
        1 => (0..KEYS).prop_map(Op::Hold),
        1 => (0..KEYS).prop_map(Op::Let),
        1 => (0..KEYS).prop_map(Op::Poison),
        1 => (0..KEYS).prop_map(Op::Cure),
    ]
}

/// A message of the model.
#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Delayed: never due during a history.
    Later,
    /// In its key's line; `Some` when at work (the claim, and whether its
    /// lease is short).
    InLine(Option<(u64, bool)>),
    Dead,
}

#[derive(Debug, Clone)]
struct Message {
    /// Which push of its id made it: an id pushed again after it went is
    /// a new message, and a job of the old one (which may carry the same
    /// claim number, continued under one hold) is not a job of the new.
    generation: u64,
    state: State,
    failures: u32,
    stalls: u32,
}

#[derive(Debug, Default)]
struct Model {
    messages: BTreeMap<usize, Message>,
    /// Per key, its line: ids in push order.
    lines: [Vec<usize>; KEYS],
    /// Keys waiting out a retry's or a deferral's long delay.
    waiting: [bool; KEYS],
    /// The outside holder's lease, per key.
    outside: [Option<Lease>; KEYS],
    /// Keys whose outside lock was let go: a claim that found the lock held
    /// made the key wait for its release (heard by a worker's listener,
    /// which these histories have none of) or its expiry. Whether one did
    /// depends on which keys the claims looked at, so such a key may or
    /// may not be claimed again: a claim of it is still checked.
    uncertain: [bool; KEYS],
    /// Keys whose lock is another kind of Redis key (`Op::Poison`): never
    /// claimed while so; once cured, uncertain (a claim that passed the
    /// key over looks at it again after its lease).
    poisoned: [bool; KEYS],
    /// Keys with a lock whose run lost a message to recovery while another
    /// of the run went on under a long lease: recovery made the key ready,
    /// and a claim that looked at it found the lock held (by the run) and
    /// marked it waited for, so the run's end may let the key go rather
    /// than hand it over. Until nothing of the key is at work.
    marked: [bool; KEYS],
    /// Keys with a lock whose run recovery ended while one of it was at
    /// work under a long lease: the dead run's lock outlives its messages
    /// (it lasts as long as the longest lease at work), for the rest of
    /// the history.
    dead_run: [bool; KEYS],
    /// Per message at work, how many of its key's ran back to back before
    /// it under the same hold (`ack_and_next` stops at `MAX_RUN`).
    runs: BTreeMap<usize, u32>,
    /// Messages created so far (see `Message::generation`).
    generations: u64,
    /// Admissions under `RATED_KEY`'s rate limit: at least, at most (a
    /// hand-over whose short lease ran out may have been admitted, then
    /// found the lock gone).
    admitted: (u32, u32),
}

impl Model {
    /// The keys a claim may take: a line, nothing at work, not waiting,
    /// the lock free; for the key with permits, a message in line not at
    /// work and a permit that may be free (a short lease may have run out).
    fn with_room(&self) -> BTreeSet<usize> {
        (0..KEYS).filter(|&k| self.room(k, false)).collect()
    }

    /// The keys a claim must take: as `with_room`, counting every permit
    /// held (a short lease may still run).
    fn surely_with_room(&self) -> BTreeSet<usize> {
        (0..KEYS).filter(|&k| self.room(k, true)).collect()
    }

    fn room(&self, k: usize, count_short: bool) -> bool {
        if k != PERMITS_KEY {
            let head = self.lines[k].first();
            let admitted = if count_short {
                self.admitted.1
            } else {
                self.admitted.0
            };
            // A message of its run still at work keeps the key's lock,
            // its head back in line or not (a short lease may be gone).
            let (long, short) = self.at_work_counts(k);
            let busy = long > 0 || (count_short && short > 0) || self.dead_run[k];
            return head.is_some_and(|id| self.messages[id].state == State::InLine(None))
                && !busy
                && !self.waiting[k]
                && !self.poisoned[k]
                && self.outside[k].is_none()
                && (k != RATED_KEY || admitted < RATE);
        }
        let (long, short) = self.at_work_counts(k);
        let held = long + usize::from(self.outside[k].is_some());
        let held = if count_short { held + short } else { held };
        self.first_waiting(k).is_some() && held < LIMIT as usize
    }

    /// Key `k` (with a lock) let go under `claim`: the messages of its run
    /// still at work under that claim go back in line (`keyed_done.lua`).
    fn let_go(&mut self, k: usize, claim: u64) {
        if k == PERMITS_KEY {
            return;
        }
        for id in &self.lines[k] {
            let m = self.messages.get_mut(id).expect("known");
            if matches!(m.state, State::InLine(Some((c, _))) if c == claim) {
                m.state = State::InLine(None);
            }
        }
    }

    /// The first message of key `k`'s line not at work.
    fn first_waiting(&self, k: usize) -> Option<usize> {
        let waiting = |id: &&usize| self.messages[*id].state == State::InLine(None);
        self.lines[k].iter().find(waiting).copied()
    }

    /// Key `k`'s messages at work: with long leases, with short ones.
    fn at_work_counts(&self, k: usize) -> (usize, usize) {
        let mut counts = (0, 0);
        for id in &self.lines[k] {
            match self.messages[id].state {
                State::InLine(Some((_, false))) => counts.0 += 1,
                State::InLine(Some((_, true))) => counts.1 += 1,
                _ => {}
            }
        }
        counts
    }

    /// Whether message `n` is at work under `claim` with a short lease.
    fn short(&self, n: usize, claim: u64) -> bool {
        self.messages
            .get(&n)
            .is_some_and(|m| m.state == State::InLine(Some((claim, true))))
    }
}

struct World<'a> {
    server: &'a RefCell<RedisServer>,
    conn: ConnectionManager,
    queue: Queue<u64, crate::Twice>,
    twice: crate::Twice,
    locker: Locker<ConnectionManager>,
    model: Model,
    /// Claimed jobs the worker holds, stale ones included.
    hands: Vec<(Job<u64>, u64)>,
    last_claim: u64,
    /// The history's keys (see [`keys`]).
    keys: [String; KEYS],
    /// How many times each message was acknowledged (a message pushed
    /// again after its acknowledgement is another).
    acks: BTreeMap<usize, usize>,
}

fn rate() -> lockgate::lock::rate::Rate {
    lockgate::lock::rate::Rate::new(RATE, secs(3600)).expect("a rate")
}

fn id(n: usize) -> String {
    format!("m{}", n / KEYS)
}

/// History `h`'s keys: on one server all three lines are in the queue's one
/// partition (and their ids in its hashes); the first two also hash to one
/// lock slot and the third to another, as a Redis Cluster's partitions
/// would split them.
fn keys(h: usize) -> [String; KEYS] {
    let slot = |key: &str| crc16::State::<crc16::XMODEM>::calculate(key.as_bytes()) % 16_384;
    let first = format!("h{h}-k0");
    let same = (0..).map(|i| format!("h{h}-k1-{i}"));
    let second = same.into_iter().find(|k| slot(k) == slot(&first));
    let third = (0..).map(|i| format!("h{h}-k2-{i}"));
    let third = third.into_iter().find(|k| slot(k) != slot(&first));
    [first, second.expect("a key"), third.expect("a key")]
}

impl World<'_> {
    fn key(&self, k: usize) -> String {
        self.keys[k].clone()
    }

    /// How message `n` is pushed: with its key and that key's limits, now
    /// or `later`.
    fn push_options(&self, n: usize, later: bool) -> PushOptions {
        let delay = if later { LATER } else { Duration::ZERO };
        let options = PushOptions::new()
            .id(id(n))
            .key(self.key(n % KEYS))
            .after(delay);
        match n % KEYS {
            PERMITS_KEY => options.permits(LIMIT),
            RATED_KEY => options.rate(rate()),
            _ => options,
        }
    }

    /// Checks and records a push of message `n` (now or `later`) that
    /// answered `created`.
    fn pushed(
        &mut self,
        n: usize,
        later: bool,
        created: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let new = !self.model.messages.contains_key(&n);
        prop_assert_eq!(created, new, "{}: created", at);
        if new {
            let state = if later {
                State::Later
            } else {
                State::InLine(None)
            };
            if !later {
                self.model.lines[n % KEYS].push(n);
            }
            let m = Message {
                state,
                failures: 0,
                stalls: 0,
                generation: self.model.generations,
            };
            self.model.generations += 1;
            self.model.messages.insert(n, m);
        }
        Ok(())
    }

    /// The key of `job` (its payload is its message's number).
    fn key_index(&self, job: &Job<u64>) -> usize {
        *job.payload() as usize % KEYS
    }

    /// A job the worker holds, and the generation of its message: for
    /// even `n` one whose claim the model says is held (stale ones pile up
    /// in a history), for odd `n` any.
    fn job(&self, n: usize) -> Option<(Job<u64>, u64)> {
        let held: Vec<&(Job<u64>, u64)> = (self.hands.iter())
            .filter(|(job, generation)| self.holds(job, *generation))
            .collect();
        if n.is_multiple_of(2) && !held.is_empty() {
            return Some(held[n / 2 % held.len()].clone());
        }
        (!self.hands.is_empty()).then(|| self.hands[n % self.hands.len()].clone())
    }

    async fn run(&mut self, (op, fault): (Op, Fault), at: &str) -> Result<(), TestCaseError> {
        if let Op::Expire | Op::Lapse = op {
            tokio::time::sleep(SHORT + ms(20)).await;
        }
        if fault == Fault::Dropped {
            let killed = crate::drop_connections(&self.server.borrow());
            prop_assert!(killed.is_ok(), "{}: CLIENT KILL {:?}", at, killed);
        }
        // Holding and letting go are not resent (each acquire is a new token).
        let calls = match (fault, op) {
            (_, Op::Hold(_) | Op::Let(_) | Op::Poison(_) | Op::Cure(_)) => 1,
            (Fault::Resent, _) => 2,
            _ => 1,
        };
        // A repeated claim or hand-over answers as one: what the first
        // call took, from its record (`lua/keyed_claim.lua`, `keyed_done.lua`).
        let repeated = fault == Fault::Repeated
            && matches!(
                op,
                Op::Claim { .. }
                    | Op::AckNext { .. }
                    | Op::AckRun { .. }
                    | Op::AckRuns { .. }
                    | Op::ExtendRun { .. }
            );
        for call in 0..calls {
            let lost = fault == Fault::Resent && call == 0;
            let twice = self.twice.clone();
            twice
                .armed(repeated, async || self.step(op, lost, at).await)
                .await?;
        }
        if let Op::Claim { .. } = op {
            self.claim_the_rest(at).await?;
        }
        for k in 0..KEYS {
            let idle = self.model.at_work_counts(k) == (0, 0);
            self.model.marked[k] &= !idle;
        }
        self.counts_agree(at).await
    }

    /// The counts the scripts keep as they change the partitions (issue
    /// 35, item 8), as `stats` reads them, are the model's: in line,
    /// delayed, at work, dead.
    async fn counts_agree(&self, at: &str) -> Result<(), TestCaseError> {
        let q = self.queue.clone();
        let stats = self.retried(at, || q.stats()).await?;
        let mut expected = [0; 4];
        for m in self.model.messages.values() {
            expected[match m.state {
                State::InLine(None) => 0,
                State::Later => 1,
                State::InLine(Some(_)) => 2,
                State::Dead => 3,
            }] += 1;
        }
        let counts = [stats.due, stats.later, stats.active, stats.dead];
        prop_assert_eq!(
            counts,
            expected,
            "{}: counts (in line, delayed, at work, dead)",
            at
        );
        self.oldest_agrees(at).await
    }

    /// The earliest ready time (above 0) the scripts keep per partition in
    /// the queue's `keyed:oldest` is each partition's own, and the keys
    /// they count (`keyed:counts`' `keys`, `key_stats`' total) are those
    /// of the partitions' ready sets.
    async fn oldest_agrees(&self, at: &str) -> Result<(), TestCaseError> {
        let queue = self.queue.name();
        let pattern = format!("lockgate:{{*}}:{queue}:ready");
        let oldest = format!("lockgate:{{{queue}}}:keyed:oldest");
        let mut kept: Vec<(String, String)> = self
            .read(at, &["ZRANGE", &oldest, "0", "-1", "WITHSCORES"])
            .await?;
        let mut partitions: Vec<String> = self.read(at, &["KEYS", &pattern]).await?;
        partitions.sort();
        let mut expected = Vec::new();
        let mut keys = 0;
        for ready in partitions {
            let n: usize = self.read(at, &["ZCARD", &ready]).await?;
            keys += n;
            let first: Vec<(String, String)> = self
                .read(
                    at,
                    &[
                        "ZRANGE",
                        &ready,
                        "(0",
                        "+inf",
                        "BYSCORE",
                        "LIMIT",
                        "0",
                        "1",
                        "WITHSCORES",
                    ],
                )
                .await?;
            if let Some((_, at)) = first.into_iter().next() {
                expected.push((ready, at));
            }
        }
        kept.sort();
        prop_assert_eq!(
            kept,
            expected,
            "{}: each partition's earliest ready time",
            at
        );
        let q = self.queue.clone();
        let counted = self.retried(at, || q.key_stats(1)).await?.keys;
        prop_assert_eq!(counted, keys, "{}: keys counted", at);
        self.locks_held(at).await?;
        self.seq_kept(at).await?;
        self.leases_indexed(at).await
    }

    /// Every partition with messages at work is in the leases index
    /// (`keyed:leases`, the queue's on one server) at or before its
    /// earliest lease deadline: a recovery sweep, which visits the
    /// partitions the index names, misses no lease that ran out.
    /// A message's `done` events: one per acknowledgement the model made,
    /// at most (a lost reply's resend logs what the first call did, an
    /// event call that failed logs nothing), never one for a message that a
    /// settlement named but did not acknowledge (acknowledged before, or
    /// back in line after its lease).
    async fn done_once(&self) -> Result<(), TestCaseError> {
        let events = self.queue.events_after("0", 100_000).await;
        let events = events.map_err(|e| TestCaseError::fail(format!("events: {e}")))?;
        let mut done = BTreeMap::<usize, usize>::new();
        for event in events.iter().filter(|e| e.kind == EventKind::Done) {
            let k = (self.keys.iter()).position(|key| event.key.as_deref() == Some(key.as_str()));
            let m = event
                .id
                .strip_prefix('m')
                .and_then(|m| m.parse::<usize>().ok());
            let (Some(k), Some(m)) = (k, m) else {
                return Err(TestCaseError::fail(format!(
                    "a done event of no message: {event:?}"
                )));
            };
            *done.entry(m * KEYS + k).or_default() += 1;
        }
        for (n, times) in done {
            let acks = self.acks.get(&n).copied().unwrap_or(0);
            prop_assert!(
                times <= acks,
                "message {}: done {} times, acknowledged {}",
                n,
                times,
                acks
            );
        }
        Ok(())
    }

    async fn leases_indexed(&self, at: &str) -> Result<(), TestCaseError> {
        let queue = self.queue.name();
        let leases = format!("lockgate:{{{queue}}}:keyed:leases");
        let pattern = format!("lockgate:{{*}}:{queue}:active");
        let sets: Vec<String> = self.read(at, &["KEYS", &pattern]).await?;
        for active in sets {
            let first: Vec<(String, f64)> = self
                .read(at, &["ZRANGE", &active, "0", "0", "WITHSCORES"])
                .await?;
            let Some((_, deadline)) = first.into_iter().next() else {
                continue;
            };
            let tag = active.split(['{', '}']).nth(1).unwrap_or_default();
            let indexed: Option<f64> = self.read(at, &["ZSCORE", &leases, tag]).await?;
            prop_assert!(
                indexed.is_some_and(|indexed| indexed <= deadline),
                "{}: {} indexed at {:?}, its first lease ends at {}",
                at,
                active,
                indexed,
                deadline
            );
        }
        Ok(())
    }

    /// The last seq handed out is kept (`keyed:seq`, the queue's on one
    /// server): no message in line or at work has a later one, so that
    /// the next push goes last.
    async fn seq_kept(&self, at: &str) -> Result<(), TestCaseError> {
        let queue = self.queue.name();
        let kept: Option<String> = self
            .read(at, &["GET", &format!("lockgate:{{{queue}}}:keyed:seq")])
            .await?;
        let kept = kept.unwrap_or_default();
        for set in ["lines", "active"] {
            let pattern = format!("lockgate:{{*}}:{queue}:{set}");
            let sets: Vec<String> = self.read(at, &["KEYS", &pattern]).await?;
            for name in sets {
                let members: Vec<String> = self.read(at, &["ZRANGE", &name, "0", "-1"]).await?;
                for member in members {
                    let seq = member.split('\0').nth(1).unwrap_or_default();
                    prop_assert!(
                        seq <= kept.as_str(),
                        "{}: seq {} above the kept {:?}",
                        at,
                        seq,
                        kept
                    );
                }
            }
        }
        Ok(())
    }

    /// The lock of a key with a message at work under a long lease is
    /// held, whichever message of its run that is, however short the
    /// leases of the others (issue 35: the key's lock outlives each of its
    /// messages at work).
    async fn locks_held(&self, at: &str) -> Result<(), TestCaseError> {
        for k in (0..KEYS).filter(|&k| k != PERMITS_KEY) {
            if self.model.at_work_counts(k).0 == 0 {
                continue;
            }
            let lock = format!("lockgate:lock:{{{}}}", self.key(k));
            let held: bool = self.read(at, &["EXISTS", &lock]).await?;
            prop_assert!(held, "{}: key {} at work without its lock", at, k);
        }
        Ok(())
    }

    /// A raw command's reply, retried while the connection is re-opened.
    async fn read<T: redis::FromRedisValue>(
        &self,
        at: &str,
        args: &[&str],
    ) -> Result<T, TestCaseError> {
        for _ in 0..100 {
            let mut conn = self.conn.clone();
            match redis::cmd(args[0])
                .arg(&args[1..])
                .query_async(&mut conn)
                .await
            {
                Ok(reply) => return Ok(reply),
                Err(_) => tokio::time::sleep(ms(20)).await,
            }
        }
        Err(TestCaseError::fail(format!("{at}: no reply to {args:?}")))
    }

    /// Retries a call while the connection is being re-opened.
    async fn retried<T, F, Fut>(&self, at: &str, call: F) -> Result<T, TestCaseError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = lockgate::Result<T>>,
    {
        crate::retried(at, call).await
    }

    /// Sends a command of the history's own (not the queue's), again after
    /// a dropped connection.
    async fn command(&self, args: &[&str], at: &str) -> Result<(), TestCaseError> {
        for _ in 0..100 {
            let mut cmd = redis::cmd(args[0]);
            cmd.arg(&args[1..]);
            match cmd
                .query_async::<redis::Value>(&mut self.conn.clone())
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if e.is_connection_dropped() || e.is_io_error() => {
                    tokio::time::sleep(ms(20)).await
                }
                Err(e) => return Err(TestCaseError::fail(format!("{at}: {args:?}: {e}"))),
            }
        }
        Err(TestCaseError::fail(format!("{at}: no connection")))
    }

    async fn step(&mut self, op: Op, lost: bool, at: &str) -> Result<(), TestCaseError> {
        let q = self.queue.clone();
        match op {
            Op::Push { id: n, later } => {
                let options = self.push_options(n, later);
                let pushed = self
                    .retried(at, || q.push_with(n as u64, options.clone()))
                    .await?;
                self.pushed(n, later, pushed.created, at)?;
            }
            Op::PushAll { first, later } => {
                let all: Vec<usize> = (first..first + KEYS).collect();
                let messages: Vec<(u64, PushOptions)> = (all.iter())
                    .map(|n| (*n as u64, self.push_options(*n, later)))
                    .collect();
                let pushed = self
                    .retried(at, || {
                        q.push_many_with(messages.iter().map(|(n, o)| (n, o.clone())))
                    })
                    .await?;
                prop_assert_eq!(pushed.len(), all.len(), "{}: a receipt each", at);
                for (n, pushed) in all.into_iter().zip(pushed) {
                    self.pushed(n, later, pushed.created, at)?;
                }
            }
            Op::Backlog(k) => {
                for n in (k..IDS).step_by(KEYS) {
                    let push = Op::Push {
                        id: n,
                        later: false,
                    };
                    Box::pin(self.step(push, lost, at)).await?;
                }
            }
            Op::Claim { max, short, run } => {
                let lease = if short { SHORT } else { LONG };
                let jobs = self
                    .retried(at, || q.claim_runs(max, lease, run))
                    .await?
                    .jobs;
                self.claimed(jobs, (max, run), short, lost, at)?;
            }
            Op::Ack(j) | Op::Bury(j) => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let held = match op {
                    Op::Ack(_) => self.retried(at, || q.ack(&job)).await?,
                    _ => self.retried(at, || q.bury(&job, "bad")).await?,
                };
                prop_assert_eq!(held, self.holds(&job, generation), "{}: held", at);
                if held {
                    let n = job.payload().to_owned() as usize;
                    let k = self.key_index(&job);
                    self.model.lines[k].retain(|i| *i != n);
                    match op {
                        Op::Ack(_) => {
                            self.model.messages.remove(&n);
                            *self.acks.entry(n).or_default() += 1;
                        }
                        _ => self.model.messages.get_mut(&n).expect("known").state = State::Dead,
                    }
                    self.model.let_go(k, job.claim());
                }
            }
            Op::AckNext {
                job: j,
                short: next_short,
                max,
            }
            | Op::AckRun {
                job: j,
                short: next_short,
                max,
            } => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let lease = if next_short { SHORT } else { LONG };
                let mut run = match op {
                    Op::AckRun { .. } => self
                        .run_of(&job)
                        .0
                        .into_iter()
                        .chain(self.run_of(&job).1)
                        .collect(),
                    _ => Vec::new(),
                };
                run.push((job.clone(), generation));
                let jobs: Vec<Job<u64>> = run.iter().map(|(job, _)| job.clone()).collect();
                let (held, next) = match max {
                    1 if jobs.len() == 1 => {
                        let (held, next) = self.retried(at, || q.ack_and_next(&job, lease)).await?;
                        (held, next.into_iter().collect())
                    }
                    _ => self.retried(at, || q.ack_run(&jobs, lease, max)).await?,
                };
                let acked = ((&job, generation), &run[..]);
                self.ran(acked, (held, next), (next_short, max), lost, at)?;
            }
            Op::AckRuns {
                jobs: picks,
                short: next_short,
                max,
            } => {
                let mut chosen: Vec<(Job<u64>, u64)> = Vec::new();
                for (job, generation) in picks.into_iter().filter_map(|j| self.job(j)) {
                    if chosen.iter().all(|(other, _)| other.key() != job.key()) {
                        chosen.push((job, generation));
                    }
                }
                let lease = if next_short { SHORT } else { LONG };
                let runs: Vec<Vec<(Job<u64>, u64)>> = (chosen.iter())
                    .map(|(job, generation)| {
                        let (before, after) = self.run_of(job);
                        let last = std::iter::once((job.clone(), *generation));
                        before.into_iter().chain(after).chain(last).collect()
                    })
                    .collect();
                let jobs: Vec<Vec<Job<u64>>> = (runs.iter())
                    .map(|run| run.iter().map(|(job, _)| job.clone()).collect())
                    .collect();
                let slices: Vec<&[Job<u64>]> = jobs.iter().map(Vec::as_slice).collect();
                // A run's error fails the step as a call's would.
                let all = || async {
                    let answers = q.ack_runs(&slices, lease, max).await?;
                    answers.into_iter().collect::<lockgate::Result<Vec<_>>>()
                };
                let answers = self.retried(at, all).await?;
                prop_assert_eq!(answers.len(), runs.len(), "{}: an answer per run", at);
                // Each block as its own call would have settled it, in order.
                for (((job, generation), run), answer) in chosen.iter().zip(&runs).zip(answers) {
                    let acked = ((job, *generation), &run[..]);
                    self.ran(acked, answer, (next_short, max), lost, at)?;
                }
            }
            Op::ExtendRun {
                job: j,
                short: next_short,
                max,
            } => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let lease = if next_short { SHORT } else { LONG };
                let (handled, _) = self.run_of(&job);
                let done: Vec<Job<u64>> = handled.iter().map(|(job, _)| job.clone()).collect();
                let (held, next) =
                    (self.retried(at, || q.extend_run(&job, &done, lease, max))).await?;
                prop_assert_eq!(held, self.holds(&job, generation), "{}: held", at);
                if !held {
                    prop_assert!(next.is_empty(), "{}: a next job for a lost claim", at);
                    return Ok(());
                }
                let n = *job.payload() as usize;
                let short = self.model.short(n, job.claim());
                let k = self.key_index(&job);
                self.acknowledged(&handled);
                if k == PERMITS_KEY || k == RATED_KEY {
                    prop_assert!(
                        next.is_empty(),
                        "{}: read ahead under permits or a rate",
                        at
                    );
                    return Ok(());
                }
                // The job goes on at work; the next ones join its run.
                let before = self.model.runs.get(&n).copied().unwrap_or(0);
                self.continued(&job, (short, before), (next, next_short, max), lost, at)?;
            }
            Op::CutRun(j) => {
                // As the worker does: for a message of a run at work (one
                // with others of its run held, when there is such a run).
                let held = |(job, g): &(Job<u64>, u64)| self.holds(job, *g);
                let in_run = |entry: &&(Job<u64>, u64)| {
                    let (before, after) = self.run_of(&entry.0);
                    held(entry) && before.iter().chain(&after).any(held)
                };
                let runs: Vec<_> = self.hands.iter().filter(in_run).cloned().collect();
                let chosen = match runs.len() {
                    0 => self.job(j).filter(held),
                    n => Some(runs[j % n].clone()),
                };
                let Some((job, _)) = chosen else {
                    return Ok(());
                };
                let (handled, unstarted) = self.run_of(&job);
                let jobs = |run: &[(Job<u64>, u64)]| {
                    run.iter().map(|(job, _)| job.clone()).collect::<Vec<_>>()
                };
                let (done, rest) = (jobs(&handled), jobs(&unstarted));
                self.retried(at, || q.cut_run(&job, &done, &rest)).await?;
                self.acknowledged(&handled);
                for (later, generation) in &unstarted {
                    if self.holds(later, *generation) {
                        let l = *later.payload() as usize;
                        self.model.messages.get_mut(&l).expect("known").state = State::InLine(None);
                    }
                }
            }
            Op::Retry { job: j, later } => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let delay = if later { LATER } else { Duration::ZERO };
                let due = self.retried(at, || q.retry(&job, delay, "boom")).await?;
                self.back_in_line((&job, generation), due.is_some(), later, true, at)?;
            }
            Op::Defer(j) | Op::Release(j) => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let held = match op {
                    Op::Defer(_) => self
                        .retried(at, || q.defer(&job, Duration::ZERO))
                        .await?
                        .is_some(),
                    _ => self.retried(at, || q.release(&job)).await?,
                };
                self.back_in_line((&job, generation), held, false, false, at)?;
            }
            Op::Extend { job: j, short } => {
                let Some((job, generation)) = self.job(j) else {
                    return Ok(());
                };
                let lease = if short { SHORT } else { LONG };
                let held = self.retried(at, || q.extend([&job], lease)).await?[0];
                self.extended((&job, generation), held, short, at)?;
            }
            Op::ExtendAll { short } => {
                let hands = self.hands.clone();
                let lease = if short { SHORT } else { LONG };
                let jobs = || hands.iter().map(|(job, _)| job);
                let held = self.retried(at, || q.extend(jobs(), lease)).await?;
                prop_assert_eq!(held.len(), hands.len(), "{}: answers", at);
                for ((job, generation), held) in hands.iter().zip(held) {
                    self.extended((job, *generation), held, short, at)?;
                }
            }
            Op::Lapse => {}
            Op::Expire => {
                let recovered = self.retried(at, || q.recover(MAX_STALLS)).await?;
                self.expired(recovered.requeued + recovered.buried, at)?;
            }
            Op::Hold(k) if k == PERMITS_KEY => {
                if self.model.outside[k].is_some() {
                    return Ok(()); // one outside holder at a time
                }
                let key = self.key(k);
                let acquired = self
                    .retried(at, || self.locker.acquire_permit(&key, LIMIT))
                    .await?;
                let (long, short) = self.model.at_work_counts(k);
                match acquired {
                    Acquisition::Acquired(lease) => {
                        prop_assert!(long < LIMIT as usize, "{}: a permit beyond {}", at, LIMIT);
                        self.model.outside[k] = Some(lease);
                    }
                    Acquisition::Contended(_) => prop_assert!(
                        long + short >= LIMIT as usize,
                        "{}: {} full for nobody",
                        at,
                        key
                    ),
                }
            }
            Op::Hold(k) if self.model.poisoned[k] => {}
            Op::Hold(k) => {
                let key = self.key(k);
                let acquired = self.retried(at, || self.locker.acquire(&key)).await?;
                let at_work = self.at_work(k);
                match acquired {
                    Acquisition::Acquired(lease) => {
                        prop_assert!(self.model.outside[k].is_none(), "{}: held twice", at);
                        // A short lease may have run out already: its lock too.
                        prop_assert!(at_work != Some(false), "{}: the queue holds {}", at, key);
                        prop_assert!(!self.model.dead_run[k], "{}: a dead run's lock lapsed", at);
                        self.model.outside[k] = Some(lease);
                    }
                    Acquisition::Contended(_) => prop_assert!(
                        self.model.outside[k].is_some()
                            || at_work.is_some()
                            || self.model.dead_run[k],
                        "{}: {} busy for nobody",
                        at,
                        key
                    ),
                }
            }
            Op::Let(k) => {
                if let Some(lease) = self.model.outside[k].take() {
                    self.retried(at, || self.locker.release(&lease)).await?;
                    self.model.uncertain[k] = true;
                }
            }
            Op::Poison(k) => {
                let idle = self.at_work(k).is_none() && !self.model.dead_run[k];
                let free = self.model.outside[k].is_none() && !self.model.poisoned[k];
                if k != PERMITS_KEY && idle && free {
                    let lock = self.locker.lock_key(&self.key(k));
                    self.command(&["HSET", &lock, "not", "a lock"], at).await?;
                    self.model.poisoned[k] = true;
                }
            }
            Op::Cure(k) => {
                if self.model.poisoned[k] {
                    let lock = self.locker.lock_key(&self.key(k));
                    self.command(&["DEL", &lock], at).await?;
                    self.model.poisoned[k] = false;
                    self.model.uncertain[k] = true;
                }
            }
        }
        Ok(())
    }

    /// Whether the queue works on key `k`: `Some(false)` while a message
    /// of it is at work under a long lease, whichever of its run (the
    /// key's lock outlives each), `Some(true)` while only short leases are
    /// (a lost turn too: the lock may have lapsed), else `None`.
    fn at_work(&self, k: usize) -> Option<bool> {
        match self.model.at_work_counts(k) {
            (0, 0) => None,
            (0, _) => Some(true),
            _ => Some(false),
        }
    }

    /// Checks what acknowledging `run` (ending with `job`, of its message's
    /// `generation`) answered: whether its claim was `held`, and the `next`
    /// run claimed, leased short when `next_short`, at most `max`.
    #[allow(clippy::type_complexity)]
    fn ran(
        &mut self,
        ((job, generation), run): ((&Job<u64>, u64), &[(Job<u64>, u64)]),
        (held, next): (bool, Vec<Job<u64>>),
        (next_short, max): (bool, usize),
        lost: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(held, self.holds(job, generation), "{}: held", at);
        if !held {
            prop_assert!(next.is_empty(), "{}: a next job for a lost claim", at);
            return Ok(());
        }
        let n = *job.payload() as usize;
        let short = self.model.short(n, job.claim());
        let k = self.key_index(job);
        // The run's jobs the model still holds go with it.
        self.acknowledged(run);
        self.model.lines[k].retain(|i| *i != n);
        self.model.messages.remove(&n);
        *self.acks.entry(n).or_default() += 1;
        let before = self.model.runs.remove(&n).unwrap_or(0);
        let let_go = next.is_empty();
        self.continued(job, (short, before), (next, next_short, max), lost, at)?;
        if let_go {
            self.model.let_go(k, job.claim());
        }
        Ok(())
    }

    /// Those of `jobs` whose claim the model says is held, acknowledged.
    fn acknowledged(&mut self, jobs: &[(Job<u64>, u64)]) {
        for (job, generation) in jobs {
            if self.holds(job, *generation) {
                let n = *job.payload() as usize;
                self.model.lines[n % KEYS].retain(|i| *i != n);
                self.model.messages.remove(&n);
                *self.acks.entry(n).or_default() += 1;
            }
        }
    }

    /// The worker's other jobs of `job`'s key under its claim number (its
    /// run), stale ones included: those before it in line, those after.
    #[allow(clippy::type_complexity)]
    fn run_of(&self, job: &Job<u64>) -> (Vec<(Job<u64>, u64)>, Vec<(Job<u64>, u64)>) {
        let n = *job.payload() as usize;
        let same = |other: &&(Job<u64>, u64)| {
            other.0.claim() == job.claim()
                && other.0.key() == job.key()
                && *other.0.payload() as usize != n
        };
        let line = &self.model.lines[n % KEYS];
        let place = |m: usize| line.iter().position(|i| *i == m);
        let at = place(n);
        let others = self.hands.iter().filter(same).cloned();
        // One out of line (stale) counts as before: it changes nothing.
        others.partition(|(other, _)| place(*other.payload() as usize) <= at)
    }

    /// Checks the next jobs an acknowledgement of `job` (its lease `short`
    /// or not, `run` messages before it under its hold) claimed, leased
    /// short when `next_short`, at most `max`: the key's first in line,
    /// under the same claim, whenever the key's lock is still the queue's
    /// (a short lease may have run out, and other code taken the lock) and
    /// the run is not at its end. A key with a lock and no limits gives
    /// them all; one with permits or a rate limit one at a time.
    fn continued(
        &mut self,
        job: &Job<u64>,
        (short, run): (bool, u32),
        (next, next_short, max): (Vec<Job<u64>>, bool, usize),
        lost: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let k = self.key_index(job);
        let (permits, rated) = (k == PERMITS_KEY, k == RATED_KEY);
        let waiting: Vec<usize> = (self.model.lines[k].iter())
            .filter(|id| self.model.messages[*id].state == State::InLine(None))
            .copied()
            .collect();
        let room = lockgate::queue::MAX_RUN.saturating_sub(run) as usize;
        if next.is_empty() {
            let head = waiting.first();
            let must = head.is_some()
                && !short
                && !self.model.marked[k]
                && (permits || self.model.outside[k].is_none())
                && (!rated || self.model.admitted.1 < RATE)
                && room > 0;
            if rated && head.is_some() && short && room > 0 {
                // Admitted, perhaps, then the lock found gone.
                self.model.admitted.1 += 1;
            }
            prop_assert!(
                !must,
                "{}: no next job though {:?} is first in line",
                at,
                head
            );
            return Ok(());
        }
        let taken: Vec<usize> = next.iter().map(|next| *next.payload() as usize).collect();
        let most = if permits || rated { 1 } else { max.min(room) };
        prop_assert!(
            taken.len() <= most,
            "{}: {} next jobs, at most {}",
            at,
            taken.len(),
            most
        );
        prop_assert_eq!(
            &taken[..],
            &waiting[..taken.len().min(waiting.len())],
            "{}: the next jobs are not the first in line",
            at
        );
        if !permits && !rated && !short {
            prop_assert_eq!(taken.len(), most.min(waiting.len()), "{}: a short run", at);
        }
        prop_assert!(
            permits || self.model.outside[k].is_none(),
            "{}: continued while other code holds the lock",
            at
        );
        prop_assert!(room > 0, "{}: ran on past MAX_RUN", at);
        for (i, next) in next.into_iter().enumerate() {
            let n = taken[i];
            prop_assert_eq!(next.claim(), job.claim(), "{}: the same claim", at);
            let key = self.key(k);
            prop_assert_eq!(next.key(), Some(key.as_str()), "{}: the key", at);
            let m = self.model.messages.get_mut(&n).expect("known");
            prop_assert_eq!(
                (next.attempt(), next.stalls()),
                (m.failures + 1, m.stalls),
                "{}: counts",
                at
            );
            // Every message a hand-over claims has the lease the ack gave
            // it, its key's lock (or permit) renewed with it (issue 35: a
            // chain must not live on its first message's lease).
            m.state = State::InLine(Some((next.claim(), next_short)));
            if rated {
                prop_assert!(self.model.admitted.0 < RATE, "{}: over the rate", at);
                self.model.admitted.0 += 1;
                self.model.admitted.1 += 1;
            }
            let generation = m.generation;
            self.model.runs.insert(n, run + 1 + i as u32);
            if !lost {
                self.hands.push((next, generation));
            }
        }
        Ok(())
    }

    /// Whether the model says `job`'s claim is the one at work.
    fn holds(&self, job: &Job<u64>, generation: u64) -> bool {
        let n = job.payload().to_owned() as usize;
        self.model.messages.get(&n).is_some_and(|m| {
            m.generation == generation
                && matches!(m.state, State::InLine(Some((claim, _))) if claim == job.claim())
        })
    }

    /// Checks the jobs a claim of up to `max` turns took, each a run of up
    /// to `run` messages of a key with a lock and no rate limit.
    fn claimed(
        &mut self,
        jobs: Vec<Job<u64>>,
        (max, run): (usize, usize),
        short: bool,
        lost: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        // A claim asks its partitions for shares of its batch, and those
        // that filled theirs again: each turn is a head of a key with room
        // once the jobs before it are at work (so the key with permits may
        // give two, its first two in line); a key with a lock and no rate
        // limit gives its first `run` in line (all it has, if fewer), one
        // after another under one claim.
        let last_claim = self.last_claim;
        let (mut turns, mut taking): (usize, Option<(usize, u64, u32)>) = (0, None);
        for job in jobs {
            let k = self.key_index(&job);
            let n = *job.payload() as usize;
            let runs = k != PERMITS_KEY && k != RATED_KEY;
            let follows = taking.filter(|(of, _, _)| *of == k && runs);
            if let Some((_, claim, i)) = follows {
                prop_assert_eq!(job.claim(), claim, "{}: a run under one claim", at);
                prop_assert!((i as usize) < run, "{}: a run longer than {}", at, run);
                taking = Some((k, claim, i + 1));
            } else {
                self.run_taken(taking.take(), run, at)?;
                turns += 1;
                prop_assert!(turns <= max, "{}: over {} turns", at, max);
                prop_assert!(
                    self.model.with_room().contains(&k),
                    "{}: {} of a key without room",
                    at,
                    job.id()
                );
                taking = Some((k, job.claim(), 1));
            }
            prop_assert_eq!(self.model.first_waiting(k), Some(n), "{}: not the head", at);
            let key = self.key(k);
            prop_assert_eq!(job.key(), Some(key.as_str()), "{}: the key", at);
            prop_assert_eq!(job.id(), id(n), "{}: the id", at);
            prop_assert!(job.claim() > last_claim, "{}: claim number went back", at);
            let m = &self.model.messages[&n];
            prop_assert_eq!(
                (job.attempt(), job.stalls()),
                (m.failures + 1, m.stalls),
                "{}: counts",
                at
            );
            self.last_claim = self.last_claim.max(job.claim());
            if n % KEYS == RATED_KEY {
                self.model.admitted.0 += 1;
                self.model.admitted.1 += 1;
            }
            let m = self.model.messages.get_mut(&n).expect("known");
            m.state = State::InLine(Some((job.claim(), short)));
            match taking {
                Some((_, _, i)) if i > 1 => drop(self.model.runs.insert(n, i - 1)),
                _ => drop(self.model.runs.remove(&n)),
            }
            // A lost reply never reached the worker: the message stays at
            // work until its lease runs out (a long one: for the history).
            if !lost {
                let generation = self.model.messages[&n].generation;
                self.hands.push((job, generation));
            }
        }
        self.run_taken(taking, run, at)
    }

    /// After a turn of key `k` (`taking`: the key, its claim, how many it
    /// took): one with a lock and no rate limit took all it could, up to
    /// `run`.
    fn run_taken(
        &self,
        taking: Option<(usize, u64, u32)>,
        run: usize,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let Some((k, _, took)) = taking else {
            return Ok(());
        };
        if k != PERMITS_KEY && k != RATED_KEY && (took as usize) < run {
            prop_assert_eq!(
                self.model.first_waiting(k),
                None,
                "{}: a run of {} left messages in line",
                at,
                took
            );
        }
        Ok(())
    }

    /// After a claim: claims until nothing comes (at most 6 more calls),
    /// and checks no key with room is left.
    async fn claim_the_rest(&mut self, at: &str) -> Result<(), TestCaseError> {
        let q = self.queue.clone();
        for _ in 0..6 {
            let jobs = self.retried(at, || q.claim(3, LONG)).await?.jobs;
            if jobs.is_empty() {
                break;
            }
            self.claimed(jobs, (3, 1), false, false, at)?;
        }
        let mut room = self.model.surely_with_room();
        room.retain(|k| !self.model.uncertain[*k]);
        prop_assert!(
            room.is_empty(),
            "{}: keys with room left unclaimed: {:?}",
            at,
            room
        );
        Ok(())
    }

    fn back_in_line(
        &mut self,
        (job, generation): (&Job<u64>, u64),
        held: bool,
        later: bool,
        failed: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        prop_assert_eq!(held, self.holds(job, generation), "{}: held", at);
        if held {
            let n = *job.payload() as usize;
            let k = self.key_index(job);
            let m = self.model.messages.get_mut(&n).expect("known");
            m.state = State::InLine(None);
            m.failures += u32::from(failed);
            if k != PERMITS_KEY {
                self.model.waiting[k] = later;
                self.model.let_go(k, job.claim());
            } else if later {
                // Aside until due (never, in a history), its place kept;
                // the key's next messages go on meanwhile.
                m.state = State::Later;
                self.model.lines[k].retain(|i| *i != n);
            }
        }
        Ok(())
    }

    /// A renewal of `job` under a short or long lease answered `held`:
    /// it keeps the claim, and takes the key's lock again if its lease ran
    /// out, unless other code took the lock (a permit: unless the key's
    /// permits were all taken since).
    fn extended(
        &mut self,
        (job, generation): (&Job<u64>, u64),
        held: bool,
        short: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let k = self.key_index(job);
        let holds = self.holds(job, generation);
        let was_short = self.model.short(*job.payload() as usize, job.claim());
        if k != PERMITS_KEY {
            let outside = self.model.outside[k].is_some();
            prop_assert_eq!(held, holds && !outside, "{}: extended", at);
        } else if !was_short {
            prop_assert_eq!(held, holds, "{}: extended", at);
        } else {
            prop_assert!(holds || !held, "{}: extended a claim not held", at);
        }
        if held {
            let n = job.payload().to_owned() as usize;
            let m = self.model.messages.get_mut(&n).expect("known");
            m.state = State::InLine(Some((job.claim(), short)));
        }
        Ok(())
    }

    /// Recovery ended `count` turns: those of short leases, and the rest
    /// of their runs (the messages of their key with a lock at work under
    /// the same claim, long leases included: `keyed_recover.lua`).
    fn expired(&mut self, count: usize, at: &str) -> Result<(), TestCaseError> {
        let runs: BTreeSet<(usize, u64)> = (self.model.messages.iter())
            .filter_map(|(n, m)| match m.state {
                State::InLine(Some((claim, true))) if n % KEYS != PERMITS_KEY => {
                    Some((n % KEYS, claim))
                }
                _ => None,
            })
            .collect();
        let mut ended = 0;
        for (n, m) in self.model.messages.iter_mut() {
            let State::InLine(Some((claim, short))) = m.state else {
                continue;
            };
            if !short && !runs.contains(&(n % KEYS, claim)) {
                continue;
            }
            ended += 1;
            self.model.dead_run[n % KEYS] |= !short;
            m.stalls += 1;
            if m.stalls >= MAX_STALLS {
                m.state = State::Dead;
                self.model.lines[n % KEYS].retain(|i| i != n);
            } else {
                m.state = State::InLine(None);
            }
        }
        // A key whose recovered turn left another of it at work under a
        // long lease (not of its run) was made ready while held.
        for &(k, _) in &runs {
            self.model.marked[k] |= self.model.at_work_counts(k).0 > 0;
        }
        prop_assert_eq!(count, ended, "{}: recovered", at);
        Ok(())
    }
}

async fn run_history(
    server: &RefCell<RedisServer>,
    conn: &ConnectionManager,
    n: usize,
    history: &[(Op, Fault)],
) -> Result<(), TestCaseError> {
    let twice = crate::Twice::new(conn.clone());
    let queue = Queue::new(twice.clone(), format!("keyed-{n}"))
        .and_then(|queue| queue.record_events(100_000))
        .expect("a queue");
    let mut world = World {
        server,
        conn: conn.clone(),
        queue,
        twice,
        locker: Locker::new(conn.clone()).ttl(LONG).expect("a TTL"),
        model: Model::default(),
        hands: Vec::new(),
        last_claim: 0,
        keys: keys(n),
        acks: BTreeMap::new(),
    };
    for (i, step) in history.iter().enumerate() {
        let at = format!("step {i}: {step:?}");
        world.run(*step, &at).await?;
    }
    world.done_once().await
}

/// Runs one history without faults on a server of its own; fails where the
/// model and the scripts part.
fn run_directed(history: &[Op]) {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let history: Vec<(Op, Fault)> = history.iter().map(|op| (*op, Fault::None)).collect();
    let ran = runtime.block_on(run_history(&server, &conn, 0, &history));
    assert!(ran.is_ok(), "{ran:?}");
}

/// A key whose lock is another kind of Redis key does not stop the claims
/// of the others (on one server every key is in one partition, claimed in
/// one script): the claim passes it over, and takes it no more once cured
/// until its lease (here a long one) has passed.
#[test]
fn a_key_whose_lock_is_another_kind_of_key_is_passed_over() {
    let claim = Op::Claim {
        max: 3,
        short: false,
        run: 2,
    };
    let history = [
        Op::Backlog(0),
        Op::Backlog(2),
        Op::Poison(0),
        claim,
        Op::Ack(0),
        Op::Cure(0),
        claim,
    ];
    run_directed(&history);
}

/// One history the random ones rarely draw: a run of two under a long
/// lease, one of them renewed under a short one, the short one run out.
/// The key's lock must outlive the other (a renewal shortened it).
#[test]
fn a_run_keeps_its_lock_when_one_of_it_is_renewed_shorter() {
    let long = false;
    let history = [
        Op::Backlog(0),
        Op::Claim {
            max: 1,
            short: long,
            run: 1,
        },
        Op::AckRun {
            job: 0,
            short: long,
            max: 2,
        },
        // The run's second (`job` picks the held ones at even numbers).
        Op::Extend {
            job: 2,
            short: true,
        },
        Op::Lapse,
        Op::Hold(0),
    ];
    run_directed(&history);
}

/// A run read ahead under a long lease from a message claimed under a
/// short one, then `rest`.
fn read_ahead_from_a_short_claim(rest: &[Op]) {
    let mut history = vec![
        Op::Backlog(0),
        Op::Claim {
            max: 1,
            short: true,
            run: 1,
        },
        Op::ExtendRun {
            job: 0,
            short: false,
            max: 2,
        },
    ];
    history.extend_from_slice(rest);
    run_directed(&history);
}

/// A run read ahead under a long lease from a message claimed under a
/// short one: the key's lock lasts as long as the messages it took.
#[test]
fn a_run_read_ahead_keeps_its_lock_for_the_messages_it_took() {
    read_ahead_from_a_short_claim(&[Op::Lapse, Op::Hold(0)]);
}

/// A run read ahead under a long lease from a message claimed under a
/// short one, whose worker died: once the short lease ran out, recovery
/// puts the whole run back in line, where it put back the expired message
/// alone and a claim took the key's messages after the run's first.
#[test]
fn a_run_read_ahead_goes_back_in_line_whole_when_its_first_lease_runs_out() {
    let claim = Op::Claim {
        max: 1,
        short: false,
        run: 4,
    };
    read_ahead_from_a_short_claim(&[Op::Expire, claim]);
}

#[test]
fn keyed_messages_follow_the_model_through_random_histories_with_faults() {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let histories = prop::collection::vec((op(), fault()), 1..50);
    crate::run("keyed model", 64, histories, |history, n| {
        runtime.block_on(run_history(&server, &conn, n, &history))
    });
}
