//! Keyed messages over many keys, claimed by several workers at once
//! (issue 35, item 9). Under a backlog a claim names the keys for its next
//! call from a place drawn at random among the first ready keys, so that
//! claimers do not name the same ones (`answer` in
//! `lua/keyed_claim.lua`); the model in `keyed.rs` has three keys and
//! never reaches that. Here 40 keys share the queue's one partition (one
//! server) and three claimers (queues of their own over the same name,
//! each remembering the keys its last claim named) claim runs, settle them
//! (a run acknowledged with the key's next messages claimed in the same
//! script, alone or with other keys' runs in one call, or one message
//! released back to its place), over connections
//! the server may drop and with calls the library resends unchanged.
//!
//! The model keeps each key's line and how many of its first messages are
//! at work. After every claim it checks that only keys with nothing at work
//! gave messages, their first in line, a run taking all it could; after
//! every step that the queue's counts are the model's. A `ClaimAll` claims
//! until nothing comes and checks that no key with waiting messages and
//! nothing at work is left behind, and every history ends by running the
//! queue dry: each message acknowledged exactly once, each key's in the
//! order they were pushed.

use std::cell::RefCell;
use std::time::Duration;

use lockgate::testing::RedisServer;
use lockgate::{Job, PushOptions, Queue};
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support::{self, secs};
use crate::{Fault, Twice};

/// More keys than a claim names (16, `names_for` in
/// src/queue/keyed/claim.rs) twice over, so that a claim's answer may name
/// them from a place past the first ready keys.
const KEYS: usize = 40;
const CLAIMERS: usize = 3;
const LEASE: Duration = secs(600);

#[derive(Debug, Clone, Copy)]
enum Op {
    /// `count` messages of key `key`.
    Push { key: usize, count: usize },
    /// One message each of `keys` keys from `first` on, in one call.
    PushMany { first: usize, keys: usize },
    /// Claimer `claimer` claims up to `max` turns, runs of up to `run`.
    Claim {
        claimer: usize,
        max: usize,
        run: usize,
    },
    /// The messages at work of the `pick`th key with some are acknowledged,
    /// by claimer `claimer`: one alone with `Queue::ack` when `max` is 0,
    /// else as a run with up to `max` of the key's next messages claimed
    /// (`Queue::ack_run`).
    Settle {
        claimer: usize,
        pick: usize,
        max: usize,
    },
    /// The messages at work of up to three keys (the `picks`th with some,
    /// each key once) are acknowledged in one call by claimer `claimer`,
    /// each as a run with up to `max` of its key's next messages claimed
    /// (`Queue::ack_runs`): a block per key, settled as alone.
    SettleMany {
        claimer: usize,
        picks: [usize; 3],
        max: usize,
    },
    /// The one message at work of the `pick`th key with one at work goes
    /// back to its place, first in line (`Queue::release`).
    Release { pick: usize },
    /// Claims round the claimers until nothing comes; no key with room is
    /// left behind.
    ClaimAll { claimer: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let claimer = 0..CLAIMERS;
    prop_oneof![
        2 => (0..KEYS, 1..=3usize).prop_map(|(key, count)| Op::Push { key, count }),
        3 => (0..KEYS, 1..=KEYS).prop_map(|(first, keys)| Op::PushMany { first, keys }),
        5 => (claimer.clone(), 1..=6usize, 1..=3usize)
            .prop_map(|(claimer, max, run)| Op::Claim { claimer, max, run }),
        4 => (claimer.clone(), 0..KEYS, 0..=3usize)
            .prop_map(|(claimer, pick, max)| Op::Settle { claimer, pick, max }),
        3 => (claimer.clone(), [0..KEYS, 0..KEYS, 0..KEYS], 1..=3usize)
            .prop_map(|(claimer, picks, max)| Op::SettleMany { claimer, picks, max }),
        1 => (0..KEYS).prop_map(|pick| Op::Release { pick }),
        1 => claimer.prop_map(|claimer| Op::ClaimAll { claimer }),
    ]
}

/// No lost replies here (`keyed.rs` has them): a call after a dropped
/// connection, or a claim or settlement sent twice.
fn fault() -> impl Strategy<Value = Fault> {
    prop_oneof![
        8 => Just(Fault::None),
        1 => Just(Fault::Dropped),
        1 => Just(Fault::Repeated),
    ]
}

/// A key's messages (payload: key × 1000 + its number), first in line
/// first, the first `at_work` of them claimed, the worker holding them.
#[derive(Default)]
struct Line {
    waiting: Vec<u64>,
    at_work: Vec<Job<u64>>,
    pushed: u64,
    acked: Vec<u64>,
}

struct World<'a> {
    server: &'a RefCell<RedisServer>,
    twice: Twice,
    claimers: Vec<Queue<u64, Twice>>,
    keys: Vec<String>,
    lines: Vec<Line>,
}

impl World<'_> {
    fn push_options(&self, k: usize, i: u64) -> PushOptions {
        PushOptions::new()
            .id(format!("m{i}"))
            .key(self.keys[k].clone())
    }

    async fn run(&mut self, (op, fault): (Op, Fault), at: &str) -> Result<(), TestCaseError> {
        if fault == Fault::Dropped {
            let killed = crate::drop_connections(&self.server.borrow());
            prop_assert!(killed.is_ok(), "{}: CLIENT KILL {:?}", at, killed);
        }
        // Only the calls that answer a resend from their record are sent
        // twice: a plain acknowledgement or release resent answers that the
        // claim is no longer held, as the first call let it go.
        let twice = self.twice.clone();
        let resends = matches!(
            op,
            Op::Claim { .. }
                | Op::ClaimAll { .. }
                | Op::Settle { max: 1.., .. }
                | Op::SettleMany { .. }
        );
        let repeated = fault == Fault::Repeated && resends;
        twice
            .armed(repeated, async || self.step(op, at).await)
            .await?;
        self.counts_agree(at).await
    }

    async fn step(&mut self, op: Op, at: &str) -> Result<(), TestCaseError> {
        let q = self.claimers[0].clone();
        match op {
            Op::Push { key, count } => {
                for _ in 0..count {
                    self.push(&[key], at).await?;
                }
            }
            Op::PushMany { first, keys } => {
                let keys: Vec<usize> = (first..first + keys).map(|k| k % KEYS).collect();
                self.push(&keys, at).await?;
            }
            Op::Claim { claimer, max, run } => {
                let q = self.claimers[claimer].clone();
                let jobs = crate::retried(at, || q.claim_runs(max, LEASE, run))
                    .await?
                    .jobs;
                self.claimed(jobs, max, run, at)?;
            }
            Op::Settle { claimer, pick, max } => {
                let busy: Vec<usize> = (0..KEYS)
                    .filter(|k| !self.lines[*k].at_work.is_empty())
                    .collect();
                if busy.is_empty() {
                    return Ok(());
                }
                self.settle(claimer, busy[pick % busy.len()], max, at)
                    .await?;
            }
            Op::SettleMany {
                claimer,
                picks,
                max,
            } => {
                let busy: Vec<usize> = (0..KEYS)
                    .filter(|k| !self.lines[*k].at_work.is_empty())
                    .collect();
                if busy.is_empty() {
                    return Ok(());
                }
                let mut keys: Vec<usize> = picks.iter().map(|p| busy[p % busy.len()]).collect();
                keys.dedup();
                keys.sort_unstable();
                keys.dedup();
                self.settle_many(claimer, &keys, max, at).await?;
            }
            Op::Release { pick } => {
                let single: Vec<usize> = (0..KEYS)
                    .filter(|k| self.lines[*k].at_work.len() == 1)
                    .collect();
                if single.is_empty() {
                    return Ok(());
                }
                let k = single[pick % single.len()];
                let job = self.lines[k].at_work[0].clone();
                let held = crate::retried(at, || q.release(&job)).await?;
                prop_assert!(held, "{}: a held claim released", at);
                let line = &mut self.lines[k];
                line.at_work.clear();
                line.waiting.insert(0, *job.payload());
            }
            Op::ClaimAll { claimer } => self.claim_all(claimer, at).await?,
        }
        Ok(())
    }

    /// Pushes one message of each of `keys`, in one call when several.
    async fn push(&mut self, keys: &[usize], at: &str) -> Result<(), TestCaseError> {
        let q = self.claimers[0].clone();
        let messages: Vec<(u64, PushOptions)> = (keys.iter().enumerate())
            .map(|(j, k)| {
                // A key named twice in one call gives two messages.
                let before = keys[..j].iter().filter(|other| *other == k).count() as u64;
                let i = self.lines[*k].pushed + before;
                (*k as u64 * 1000 + i, self.push_options(*k, i))
            })
            .collect();
        let pushed = crate::retried(at, || {
            q.push_many_with(messages.iter().map(|(n, o)| (n, o.clone())))
        })
        .await?;
        prop_assert_eq!(pushed.len(), keys.len(), "{}: a receipt each", at);
        for ((n, _), receipt) in messages.iter().zip(pushed) {
            prop_assert!(receipt.created, "{}: message {} created", at, n);
            let line = &mut self.lines[*n as usize / 1000];
            line.waiting.push(*n);
            line.pushed += 1;
        }
        Ok(())
    }

    /// Checks and records a claim of up to `max` turns, runs of `run`:
    /// each turn a key with nothing at work, its first messages in line,
    /// all of them up to `run`.
    fn claimed(
        &mut self,
        jobs: Vec<Job<u64>>,
        max: usize,
        run: usize,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let mut turns: Vec<(usize, usize)> = Vec::new();
        for job in jobs {
            let k = *job.payload() as usize / 1000;
            prop_assert_eq!(job.key(), Some(self.keys[k].as_str()), "{}: the key", at);
            match turns.last_mut() {
                Some((last, taken)) if *last == k => *taken += 1,
                _ => {
                    prop_assert!(
                        self.lines[k].at_work.is_empty(),
                        "{}: key {} claimed with a message at work",
                        at,
                        k
                    );
                    turns.push((k, 1));
                }
            }
            self.start(k, job, at)?;
        }
        prop_assert!(
            turns.len() <= max,
            "{}: {} turns, over {}",
            at,
            turns.len(),
            max
        );
        for (k, taken) in turns {
            let rest = self.lines[k].waiting.len();
            prop_assert!(taken <= run, "{}: a run of {} over {}", at, taken, run);
            prop_assert!(
                taken == run || rest == 0,
                "{}: key {}'s run of {} left {} in line",
                at,
                k,
                taken,
                rest
            );
        }
        Ok(())
    }

    /// Acknowledges key `k`'s messages at work through `claimer`, and
    /// checks the next messages the settlement claimed.
    async fn settle(
        &mut self,
        claimer: usize,
        k: usize,
        max: usize,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let q = self.claimers[claimer].clone();
        let run = std::mem::take(&mut self.lines[k].at_work);
        let (held, next) = match (max, &run[..]) {
            (0, [job]) => (crate::retried(at, || q.ack(job)).await?, Vec::new()),
            _ => crate::retried(at, || q.ack_run(&run, LEASE, max.max(1))).await?,
        };
        let max = max.max(usize::from(run.len() > 1));
        self.settled(k, &run, (held, next), max, at)
    }

    /// Records key `k`'s `run` acknowledged, answered `held` and the
    /// `next` messages claimed (up to `max`): the key's next in line.
    fn settled(
        &mut self,
        k: usize,
        run: &[Job<u64>],
        (held, next): (bool, Vec<Job<u64>>),
        max: usize,
        at: &str,
    ) -> Result<(), TestCaseError> {
        prop_assert!(held, "{}: key {}'s claim held", at, k);
        let line = &mut self.lines[k];
        line.acked.extend(run.iter().map(|job| *job.payload()));
        for job in next {
            self.start(k, job, at)?;
        }
        let at_work = self.lines[k].at_work.len();
        prop_assert!(at_work <= max, "{}: over {} next", at, max);
        Ok(())
    }

    /// Checks that `job`, claimed or handed over, is key `k`'s first
    /// message in line, and puts it at work.
    fn start(&mut self, k: usize, job: Job<u64>, at: &str) -> Result<(), TestCaseError> {
        let line = &mut self.lines[k];
        prop_assert_eq!(
            line.waiting.first(),
            Some(job.payload()),
            "{}: not key {}'s first in line",
            at,
            k
        );
        line.waiting.remove(0);
        line.at_work.push(job);
        Ok(())
    }

    /// Acknowledges the messages at work of each of `keys` in one call
    /// through `claimer`, each with up to `max` next messages claimed, and
    /// checks each key's answer as [`settled`](Self::settled).
    async fn settle_many(
        &mut self,
        claimer: usize,
        keys: &[usize],
        max: usize,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let q = self.claimers[claimer].clone();
        let runs: Vec<Vec<Job<u64>>> = (keys.iter())
            .map(|k| std::mem::take(&mut self.lines[*k].at_work))
            .collect();
        let slices: Vec<&[Job<u64>]> = runs.iter().map(Vec::as_slice).collect();
        let all = || async {
            let answers = q.ack_runs(&slices, LEASE, max).await?;
            answers.into_iter().collect::<lockgate::Result<Vec<_>>>()
        };
        let answers = crate::retried(at, all).await?;
        prop_assert_eq!(answers.len(), keys.len(), "{}: an answer per key", at);
        for ((k, run), answer) in keys.iter().zip(&runs).zip(answers) {
            self.settled(*k, run, answer, max, at)?;
        }
        Ok(())
    }

    /// Claims round the claimers from `claimer` on until a round brings
    /// nothing; then no key has messages waiting and none at work.
    async fn claim_all(&mut self, claimer: usize, at: &str) -> Result<(), TestCaseError> {
        let (mut c, mut empty) = (claimer, 0);
        for _ in 0..4 * KEYS {
            if empty == CLAIMERS {
                break;
            }
            let q = self.claimers[c % CLAIMERS].clone();
            let jobs = crate::retried(at, || q.claim_runs(8, LEASE, 2)).await?.jobs;
            empty = if jobs.is_empty() { empty + 1 } else { 0 };
            self.claimed(jobs, 8, 2, at)?;
            c += 1;
        }
        let left: Vec<usize> = (0..KEYS)
            .filter(|k| self.lines[*k].at_work.is_empty() && !self.lines[*k].waiting.is_empty())
            .collect();
        prop_assert!(
            left.is_empty(),
            "{}: keys with room left unclaimed: {:?}",
            at,
            left
        );
        Ok(())
    }

    async fn counts_agree(&self, at: &str) -> Result<(), TestCaseError> {
        let q = self.claimers[0].clone();
        let stats = crate::retried(at, || q.stats()).await?;
        let waiting: usize = self.lines.iter().map(|l| l.waiting.len()).sum();
        let at_work: usize = self.lines.iter().map(|l| l.at_work.len()).sum();
        prop_assert_eq!(
            (stats.due, stats.later, stats.active, stats.dead),
            (waiting as u64, 0, at_work as u64, 0),
            "{}: counts (in line, delayed, at work, dead)",
            at
        );
        Ok(())
    }

    /// Runs the queue dry: claims and acknowledges until nothing is left,
    /// then each message was acknowledged once, in push order.
    async fn drain(&mut self, at: &str) -> Result<(), TestCaseError> {
        for round in 0..4 * KEYS {
            self.claim_all(round, at).await?;
            let busy: Vec<usize> = (0..KEYS)
                .filter(|k| !self.lines[*k].at_work.is_empty())
                .collect();
            if busy.is_empty() {
                break;
            }
            // Every key at work in one call, a block each.
            self.settle_many(round % CLAIMERS, &busy, 1, at).await?;
        }
        self.counts_agree(at).await?;
        for (k, line) in self.lines.iter().enumerate() {
            let order: Vec<u64> = (0..line.pushed).map(|i| k as u64 * 1000 + i).collect();
            prop_assert_eq!(&line.acked, &order, "{}: key {}'s acknowledgements", at, k);
        }
        Ok(())
    }
}

async fn run_history(
    server: &RefCell<RedisServer>,
    conn: &ConnectionManager,
    n: usize,
    history: &[(Op, Fault)],
) -> Result<(), TestCaseError> {
    let twice = Twice::new(conn.clone());
    let name = format!("wide-{n}");
    let claimers = (0..CLAIMERS)
        .map(|_| Queue::new(twice.clone(), &name).expect("a queue"))
        .collect();
    let mut world = World {
        server,
        twice,
        claimers,
        keys: (0..KEYS).map(|k| format!("h{n}-k{k}")).collect(),
        lines: (0..KEYS).map(|_| Line::default()).collect(),
    };
    for (i, step) in history.iter().enumerate() {
        let at = format!("step {i}: {step:?}");
        world.run(*step, &at).await?;
    }
    world.drain("draining").await
}

/// The many-key histories the random ones are built to reach: a backlog
/// over every key, then claims by each claimer from where its last claim's
/// answer pointed, settlements in between.
#[test]
fn claimers_over_many_ready_keys_follow_the_model() {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let claim = |claimer| Op::Claim {
        claimer,
        max: 4,
        run: 2,
    };
    let mut history = vec![Op::PushMany {
        first: 0,
        keys: KEYS,
    }];
    for round in 0..3 {
        history.extend([claim(0), claim(1), claim(2)]);
        history.push(Op::Settle {
            claimer: round,
            pick: round,
            max: 1,
        });
    }
    history.push(Op::ClaimAll { claimer: 1 });
    let history: Vec<(Op, Fault)> = history.into_iter().map(|op| (op, Fault::None)).collect();
    let ran = runtime.block_on(run_history(&server, &conn, 0, &history));
    assert!(ran.is_ok(), "{ran:?}");
}

#[test]
fn keyed_messages_over_many_keys_follow_the_model_with_several_claimers() {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let histories = prop::collection::vec((op(), fault()), 1..40);
    crate::run("keyed model, many keys", 48, histories, |history, n| {
        runtime.block_on(run_history(&server, &conn, n + 1, &history))
    });
}
