//! A queue's messages through every script that moves them: pushed (ids
//! that repeat, delays, priorities), claimed with short and long leases,
//! acknowledged, retried, deferred, released, buried, extended, recovered
//! when their lease ran out, re-driven from the dead letters, removed and
//! purged; each step possibly resent (its reply lost, the same call made
//! again) or made over a connection the server just dropped; and the server
//! snapshotted and restarted from that older snapshot.
//!
//! The model is a map from id to message. Due times are the server's: the
//! model knows the window a step ran in (`TIME` before and after), checks
//! that a due time Redis reports falls in it, and from then on holds the
//! exact value, so claim order (priorities first, highest first, then due
//! time, then id) is checked exactly.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockgate::queue::{DeadCursor, DeadLetter, MAX_BATCH, Recovered};
use lockgate::testing::RedisServer;
use lockgate::{Job, PushOptions, Queue};
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support::{self, ms, secs};
use crate::{Fault, fault};

/// Ids a history draws from, so that they repeat.
const IDS: usize = 5;
/// A lease that runs out at the next [`Op::Expire`].
const SHORT: Duration = ms(50);
/// A lease that never runs out during a history.
const LONG: Duration = secs(600);
/// A delay that never comes due during a history.
const LATER: Duration = secs(3600);
/// Leases that may run out before a message is buried.
const MAX_STALLS: u32 = 2;

/// One step. `job` indexes (modulo) the claimed jobs the history's worker
/// holds, stale ones included; `id` the ids `m0..m4`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Push {
        id: usize,
        later: bool,
        priority: u8,
    },
    Claim {
        max: usize,
        short: bool,
    },
    Ack(usize),
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
    /// Waits out the short leases, then recovers.
    Expire,
    RequeueDead(usize),
    RequeueAllDead,
    Remove(usize),
    Purge,
    /// `SAVE`: what a restart goes back to.
    Snapshot,
    /// SIGKILL and start again from the last snapshot (of this history: an
    /// earlier one holds none of its keys).
    Restart,
}

fn op() -> impl Strategy<Value = Op> {
    let id = 0..IDS;
    let job = 0..8usize;
    let priority = prop_oneof![3 => Just(0u8), 1 => 1..=2u8];
    prop_oneof![
        6 => (id.clone(), prop::bool::weighted(0.2), priority)
            .prop_map(|(id, later, priority)| Op::Push { id, later, priority }),
        5 => (1..=3usize, prop::bool::weighted(0.4)).prop_map(|(max, short)| Op::Claim { max, short }),
        3 => job.clone().prop_map(Op::Ack),
        2 => (job.clone(), prop::bool::weighted(0.2)).prop_map(|(job, later)| Op::Retry { job, later }),
        1 => job.clone().prop_map(Op::Defer),
        1 => job.clone().prop_map(Op::Release),
        1 => job.clone().prop_map(Op::Bury),
        1 => (job, any::<bool>()).prop_map(|(job, short)| Op::Extend { job, short }),
        2 => Just(Op::Expire),
        1 => id.clone().prop_map(Op::RequeueDead),
        1 => Just(Op::RequeueAllDead),
        1 => id.prop_map(Op::Remove),
        1 => Just(Op::Purge),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restart),
    ]
}

fn step() -> impl Strategy<Value = (Op, Fault)> {
    (op(), fault())
}

/// Where a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Scheduled, due at a server time in `lo..=hi` ms (one value once Redis
    /// reported it).
    Waiting {
        lo: i64,
        hi: i64,
    },
    /// Claimed under claim number `claim`, with a short or a long lease.
    Active {
        claim: u64,
        short: bool,
    },
    Dead,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Message {
    state: State,
    priority: u8,
    failures: u32,
    deferrals: u32,
    stalls: u32,
    /// Which push made it (its payload).
    payload: u64,
}

/// A message as Redis shows it (`peek`, `dead_letters`): where it is, its
/// priority (not shown for dead letters), its counts (stalls shown for dead
/// letters only), its payload.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    place: &'static str,
    priority: Option<u8>,
    failures: u32,
    deferrals: u32,
    stalls: Option<u32>,
    payload: Vec<u8>,
}

impl Message {
    fn seen(&self) -> Seen {
        let (place, dead) = match self.state {
            State::Waiting { .. } => ("waiting", false),
            State::Active { .. } => ("active", false),
            State::Dead => ("dead", true),
        };
        Seen {
            place,
            priority: (!dead).then_some(self.priority),
            failures: self.failures,
            deferrals: self.deferrals,
            stalls: dead.then_some(self.stalls),
            payload: self.payload.to_string().into_bytes(),
        }
    }
}

/// The queue as it should be: messages by id. Acknowledged and removed
/// messages are not in it, and must not be in Redis.
#[derive(Debug, Clone, Default)]
struct Model {
    messages: BTreeMap<String, Message>,
}

impl Model {
    /// Whether `job`'s claim is the one its message is under now.
    fn holds(&self, job: &Job<u64>) -> bool {
        self.messages
            .get(job.id())
            .is_some_and(|m| matches!(m.state, State::Active { claim, .. } if claim == job.claim()))
    }

    /// The waiting messages due by `now`, in claim order.
    fn due_in_order(&self, now: i64) -> Result<Vec<&str>, TestCaseError> {
        let mut due = Vec::new();
        for (id, m) in &self.messages {
            if let State::Waiting { lo, hi } = m.state {
                // Pinned at the end of the step that scheduled it.
                prop_assert_eq!(lo, hi, "{} has no exact due time", id);
                if lo <= now {
                    // Priorities first, highest first; then due time, then id.
                    due.push(((m.priority == 0, u8::MAX - m.priority, lo), id.as_str()));
                }
            }
        }
        due.sort();
        Ok(due.into_iter().map(|(_, id)| id).collect())
    }
}

/// One history's world: the server (restarted in place), the queue, the
/// jobs its worker holds, and what must hold across restarts.
struct World<'a> {
    server: &'a RefCell<RedisServer>,
    conn: ConnectionManager,
    queue: Queue<u64, crate::Twice>,
    twice: crate::Twice,
    /// Whether the step's claim is repeated (see `Fault::Repeated`).
    repeated: bool,
    model: Model,
    /// The model at the last snapshot of this history.
    saved: Model,
    /// Every job claimed with its reply received, stale ones too.
    hands: Vec<Job<u64>>,
    /// The highest claim number seen: claim numbers only grow, restarts
    /// included (this is not rolled back with the model).
    last_claim: u64,
    /// Pushes so far (the next payload).
    pushes: u64,
}

/// The server time before and after a step's calls, in ms.
#[derive(Debug, Clone, Copy)]
struct Window {
    t0: i64,
    t1: i64,
}

impl Window {
    /// Waiting, due now or [`LATER`] by the server's clock during the step.
    fn when(self, later: bool) -> State {
        let d = if later { LATER.as_millis() as i64 } else { 0 };
        State::Waiting {
            lo: self.t0 + d,
            hi: self.t1 + d,
        }
    }
}

/// What a call answered.
#[derive(Debug)]
enum Reply {
    Pushed { created: bool, due: Option<i64> },
    Claimed(Vec<Job<u64>>),
    Held(bool),
    Due(Option<i64>),
    Recovered(Recovered),
    Count(usize),
    Nothing,
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn id(n: usize) -> String {
    format!("m{n}")
}

impl World<'_> {
    /// The server's clock in ms.
    async fn now(&mut self) -> Result<i64, TestCaseError> {
        Ok(crate::server_us(&mut self.conn).await? / 1000)
    }

    fn job(&self, n: usize) -> Option<Job<u64>> {
        (!self.hands.is_empty()).then(|| self.hands[n % self.hands.len()].clone())
    }

    async fn run(&mut self, (op, fault): (Op, Fault), at: &str) -> Result<(), TestCaseError> {
        if let Op::Expire = op {
            tokio::time::sleep(SHORT + ms(20)).await;
        }
        let t0 = self.now().await?;
        if fault == Fault::Dropped {
            let killed = crate::drop_connections(&self.server.borrow());
            prop_assert!(killed.is_ok(), "{}: CLIENT KILL {:?}", at, killed);
        }
        let calls = if fault == Fault::Resent { 2 } else { 1 };
        // A repeated claim answers as one: what the first call claimed,
        // from its record (`lua/claim.lua`).
        let repeated = fault == Fault::Repeated && matches!(op, Op::Claim { .. });
        self.repeated = repeated;
        for call in 0..calls {
            let twice = self.twice.clone();
            let reply = twice.armed(repeated, async || self.call(op).await).await?;
            let t1 = self.now().await?;
            // The first reply of a resent call is lost: its jobs never reach
            // the worker (they come back when their lease runs out).
            let lost = fault == Fault::Resent && call == 0;
            self.apply(op, reply, Window { t0, t1 }, lost, at)?;
        }
        self.check(at).await
    }

    /// Makes `op`'s call, again while the connection is being re-opened (a
    /// call on a connection the server closed never reached it).
    async fn call(&mut self, op: Op) -> Result<Reply, TestCaseError> {
        for _ in 0..100 {
            match self.try_call(op).await {
                Ok(reply) => return Ok(reply),
                Err(e) if crate::dropped(&e) => tokio::time::sleep(ms(20)).await,
                Err(e) => return Err(TestCaseError::fail(format!("{op:?}: {e}"))),
            }
        }
        Err(TestCaseError::fail(format!("{op:?}: no connection")))
    }

    async fn try_call(&mut self, op: Op) -> lockgate::Result<Reply> {
        let q = &self.queue;
        let ms_of = |t: Option<SystemTime>| t.map(unix_ms);
        Ok(match op {
            Op::Push {
                id: n,
                later,
                priority,
            } => {
                let delay = if later { LATER } else { Duration::ZERO };
                let options = PushOptions::new().id(id(n)).after(delay).priority(priority);
                let pushed = q.push_with(self.pushes, options).await?;
                Reply::Pushed {
                    created: pushed.created,
                    due: ms_of(pushed.due),
                }
            }
            Op::Claim { max, short } => {
                let lease = if short { SHORT } else { LONG };
                Reply::Claimed(q.claim(max, lease).await?.jobs)
            }
            Op::Ack(n) => match self.job(n) {
                Some(job) => Reply::Held(q.ack(&job).await?),
                None => Reply::Nothing,
            },
            Op::Retry { job, later } => match self.job(job) {
                Some(job) => {
                    let delay = if later { LATER } else { Duration::ZERO };
                    Reply::Due(ms_of(q.retry(&job, delay, "boom").await?))
                }
                None => Reply::Nothing,
            },
            Op::Defer(n) => match self.job(n) {
                Some(job) => Reply::Due(ms_of(q.defer(&job, Duration::ZERO).await?)),
                None => Reply::Nothing,
            },
            Op::Release(n) => match self.job(n) {
                Some(job) => Reply::Held(q.release(&job).await?),
                None => Reply::Nothing,
            },
            Op::Bury(n) => match self.job(n) {
                Some(job) => Reply::Held(q.bury(&job, "bad").await?),
                None => Reply::Nothing,
            },
            Op::Extend { job, short } => match self.job(job) {
                Some(job) => {
                    let lease = if short { SHORT } else { LONG };
                    Reply::Held(q.extend([&job], lease).await?[0])
                }
                None => Reply::Nothing,
            },
            Op::Expire => Reply::Recovered(q.recover(MAX_STALLS).await?),
            Op::RequeueDead(n) => Reply::Held(q.requeue_dead(&id(n)).await?),
            Op::RequeueAllDead => Reply::Count(q.requeue_all_dead().await?),
            Op::Remove(n) => Reply::Held(q.remove(&id(n)).await?),
            Op::Purge => {
                q.purge().await?;
                Reply::Nothing
            }
            Op::Snapshot => {
                let saved = self.server.borrow().snapshot();
                saved.map_err(|e| lockgate::Error::Config(format!("SAVE: {e}")))?;
                Reply::Nothing
            }
            Op::Restart => {
                let restarted = self.server.borrow_mut().restart();
                restarted.map_err(|e| lockgate::Error::Config(format!("restart: {e}")))?;
                Reply::Nothing
            }
        })
    }
}

impl World<'_> {
    /// Checks `reply` against the model and moves the model on.
    fn apply(
        &mut self,
        op: Op,
        reply: Reply,
        window: Window,
        lost: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        match (op, reply) {
            (
                Op::Push {
                    id: n,
                    later,
                    priority,
                },
                Reply::Pushed { created, due },
            ) => self.pushed(id(n), window.when(later), priority, (created, due), at),
            (Op::Claim { max, short }, Reply::Claimed(jobs)) => {
                self.claimed(max, short, jobs, window, lost, at)
            }
            (Op::Retry { job, later }, Reply::Due(due)) => {
                let job = self.hands[job % self.hands.len()].clone();
                self.rescheduled(&job, due, window.when(later), |m| m.failures += 1, at)
            }
            (Op::Defer(n), Reply::Due(due)) => {
                let job = self.hands[n % self.hands.len()].clone();
                self.rescheduled(&job, due, window.when(false), |m| m.deferrals += 1, at)
            }
            (
                Op::Ack(n) | Op::Release(n) | Op::Bury(n) | Op::Extend { job: n, .. },
                Reply::Held(held),
            ) => self.settled(op, n, held, window, at),
            (Op::Expire, Reply::Recovered(recovered)) => self.expired(recovered, window, at),
            (Op::RequeueDead(_) | Op::RequeueAllDead | Op::Remove(_), reply) => {
                self.administered(op, reply, window, at)
            }
            (Op::Purge, Reply::Nothing) => {
                self.model.messages.clear();
                Ok(())
            }
            (Op::Snapshot, Reply::Nothing) => {
                self.saved = self.model.clone();
                Ok(())
            }
            (Op::Restart, Reply::Nothing) => {
                self.model = self.saved.clone();
                Ok(())
            }
            // A job op with no job held yet.
            (_, Reply::Nothing) => {
                prop_assert!(self.hands.is_empty(), "{}", at);
                Ok(())
            }
            (op, reply) => Err(TestCaseError::fail(format!(
                "{at}: {op:?} answered {reply:?}"
            ))),
        }
    }

    /// A re-drive of one or all dead letters (due now, counts reset), or a
    /// removal (of a message that waits or is dead, never of an active one).
    fn administered(
        &mut self,
        op: Op,
        reply: Reply,
        window: Window,
        at: &str,
    ) -> Result<(), TestCaseError> {
        match (op, reply) {
            (Op::RequeueDead(n), Reply::Held(redriven)) => {
                let dead = self
                    .model
                    .messages
                    .get_mut(&id(n))
                    .filter(|m| m.state == State::Dead);
                prop_assert_eq!(redriven, dead.is_some(), "{}: re-drive of {}", at, id(n));
                if let Some(m) = dead {
                    redrive(m, window.when(false));
                }
                Ok(())
            }
            (Op::RequeueAllDead, Reply::Count(count)) => {
                let dead = self
                    .model
                    .messages
                    .values_mut()
                    .filter(|m| m.state == State::Dead);
                let redriven = dead.map(|m| redrive(m, window.when(false))).count();
                prop_assert_eq!(count, redriven, "{}: re-driven", at);
                Ok(())
            }
            (Op::Remove(n), Reply::Held(removed)) => {
                let state = self.model.messages.get(&id(n)).map(|m| m.state);
                let removable = state.is_some_and(|s| !matches!(s, State::Active { .. }));
                prop_assert_eq!(removed, removable, "{}: removal of {}", at, id(n));
                if removable {
                    self.model.messages.remove(&id(n));
                }
                Ok(())
            }
            (op, reply) => Err(TestCaseError::fail(format!(
                "{at}: {op:?} answered {reply:?}"
            ))),
        }
    }

    /// A push: a new id is added, due in `when`; an existing one is left
    /// as it is and its due time reported (none when it does not wait).
    fn pushed(
        &mut self,
        id: String,
        when: State,
        priority: u8,
        (created, due): (bool, Option<i64>),
        at: &str,
    ) -> Result<(), TestCaseError> {
        let payload = self.pushes;
        self.pushes += 1;
        if let Some(m) = self.model.messages.get(&id) {
            prop_assert!(!created, "{}: an existing id was pushed again", at);
            let expected = match m.state {
                State::Waiting { lo, .. } => Some(lo),
                _ => None,
            };
            prop_assert_eq!(due, expected, "{}: the existing message's due time", at);
            return Ok(());
        }
        prop_assert!(created, "{}: a new id was not added", at);
        let due = due.ok_or_else(|| TestCaseError::fail(format!("{at}: no due time")))?;
        let message = Message {
            state: pinned(when, due, at)?,
            priority,
            failures: 0,
            deferrals: 0,
            stalls: 0,
            payload,
        };
        self.model.messages.insert(id, message);
        Ok(())
    }

    /// A claim: exactly the first `max` due messages in claim order, each
    /// as the model has it, under one claim number larger than any before.
    fn claimed(
        &mut self,
        max: usize,
        short: bool,
        jobs: Vec<Job<u64>>,
        window: Window,
        lost: bool,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let expected: Vec<String> = self
            .model
            .due_in_order(window.t0)?
            .into_iter()
            .take(max)
            .map(str::to_owned)
            .collect();
        let mut got: Vec<&str> = jobs.iter().map(|j| j.id()).collect();
        let mut expected: Vec<&str> = expected.iter().map(String::as_str).collect();
        if self.repeated {
            // A repeated claim answers the same messages, found by their
            // leases, in another order.
            got.sort_unstable();
            expected.sort_unstable();
        }
        prop_assert_eq!(&got, &expected, "{}: claimed in the model's order", at);
        let Some(claim) = jobs.first().map(|j| j.claim()) else {
            return Ok(());
        };
        prop_assert!(
            claim > self.last_claim,
            "{}: claim {} after {}",
            at,
            claim,
            self.last_claim
        );
        self.last_claim = claim;
        for job in &jobs {
            prop_assert_eq!(job.claim(), claim, "{}: one claim number per call", at);
            let m = self
                .model
                .messages
                .get_mut(job.id())
                .expect("claimed from the model");
            let State::Waiting { lo: due, .. } = m.state else {
                unreachable!("the model's order holds waiting messages only")
            };
            let seen = (
                job.attempt(),
                job.deferrals(),
                job.stalls(),
                job.priority(),
                *job.payload(),
            );
            let model = (m.failures + 1, m.deferrals, m.stalls, m.priority, m.payload);
            prop_assert_eq!(seen, model, "{}: claimed {}", at, job.id());
            // A repeated claim gives each message its push time as its due
            // time (its record keeps the claim, not the due times): no
            // later than the due time.
            let seen_due = unix_ms(job.due_at());
            match self.repeated {
                false => prop_assert_eq!(seen_due, due, "{}: due time of {}", at, job.id()),
                true => prop_assert!(seen_due <= due, "{}: due time of {}", at, job.id()),
            }
            m.state = State::Active { claim, short };
        }
        if !lost {
            self.hands.extend(jobs);
        }
        Ok(())
    }

    /// An ack, release, burial or renewal of held job `n`: it acts only if
    /// the job's claim is the message's current one.
    fn settled(
        &mut self,
        op: Op,
        n: usize,
        held: bool,
        window: Window,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let job = self.hands[n % self.hands.len()].clone();
        prop_assert_eq!(held, self.model.holds(&job), "{}: {} held", at, job.id());
        if !held {
            return Ok(());
        }
        match op {
            Op::Ack(_) => {
                self.model.messages.remove(job.id());
            }
            Op::Release(_) => {
                self.model.messages.get_mut(job.id()).unwrap().state = window.when(false)
            }
            Op::Bury(_) => {
                let m = self.model.messages.get_mut(job.id()).unwrap();
                m.failures += 1;
                m.state = State::Dead;
            }
            Op::Extend { short, .. } => {
                let claim = job.claim();
                self.model.messages.get_mut(job.id()).unwrap().state =
                    State::Active { claim, short };
            }
            _ => unreachable!("not a settling op"),
        }
        Ok(())
    }

    /// A recovery after the short leases ran out: each of their messages
    /// counts a stall, and is buried at [`MAX_STALLS`] or due again now.
    fn expired(
        &mut self,
        recovered: Recovered,
        window: Window,
        at: &str,
    ) -> Result<(), TestCaseError> {
        let (mut requeued, mut buried) = (0, 0);
        for m in self.model.messages.values_mut() {
            if let State::Active { short: true, .. } = m.state {
                m.stalls += 1;
                if m.stalls >= MAX_STALLS {
                    m.state = State::Dead;
                    buried += 1;
                } else {
                    m.state = window.when(false);
                    requeued += 1;
                }
            }
        }
        let got = (recovered.requeued, recovered.buried);
        prop_assert_eq!(got, (requeued, buried), "{}: recovered", at);
        Ok(())
    }

    /// Checks a retry's or deferral's answer: a due time in `when` if the
    /// job's claim is held, and then counts with `count`.
    fn rescheduled(
        &mut self,
        job: &Job<u64>,
        due: Option<i64>,
        when: State,
        count: impl FnOnce(&mut Message),
        at: &str,
    ) -> Result<(), TestCaseError> {
        let held = self.model.holds(job);
        prop_assert_eq!(due.is_some(), held, "{}: rescheduling {}", at, job.id());
        if let Some(due) = due {
            let m = self.model.messages.get_mut(job.id()).unwrap();
            count(m);
            m.state = pinned(when, due, at)?;
        }
        Ok(())
    }

    /// Every dead letter, read in pages of 2 by cursor: each page goes on
    /// in list order (burial time, then id) where the one before ended,
    /// and the last says so.
    async fn dead_letters(&self, at: &str) -> Result<Vec<DeadLetter>, TestCaseError> {
        let fail = |e: lockgate::Error| TestCaseError::fail(format!("after {at}: {e}"));
        let (mut all, mut after) = (Vec::new(), None);
        loop {
            let page = (self.queue.dead_letters(after.as_ref(), 2).await).map_err(fail)?;
            prop_assert!(page.letters.len() <= 2, "after {}: {:?}", at, page);
            let places = page.letters.iter().map(DeadCursor::after);
            for place in after
                .iter()
                .cloned()
                .chain(places)
                .collect::<Vec<_>>()
                .windows(2)
            {
                prop_assert!(
                    place[0] < place[1],
                    "after {}: out of order: {:?}",
                    at,
                    page
                );
            }
            all.extend(page.letters);
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(all),
            }
            prop_assert!(all.len() <= IDS, "after {}: pages without end", at);
        }
    }

    /// Compares what Redis holds with the model, and pins the due times it
    /// reports.
    async fn check(&mut self, at: &str) -> Result<(), TestCaseError> {
        let fail = |e: lockgate::Error| TestCaseError::fail(format!("after {at}: {e}"));
        let peek = self.queue.peek(MAX_BATCH).await.map_err(fail)?;
        let dead = self.dead_letters(at).await?;
        let stats = self.queue.stats().await.map_err(fail)?;
        let now = self.now().await?;
        for w in &peek.waiting {
            if let Some(m) = self.model.messages.get_mut(&w.id) {
                m.state = pinned(m.state, unix_ms(w.at), at)?;
            }
        }
        let mut redis = BTreeMap::new();
        let peeked = (peek.waiting.iter().map(|w| (w, "waiting")))
            .chain(peek.active.iter().map(|a| (a, "active")));
        for (p, place) in peeked {
            let seen = Seen {
                place,
                priority: Some(p.priority),
                failures: p.failures,
                deferrals: p.deferrals,
                stalls: None,
                payload: p.payload.clone(),
            };
            let twice = redis.insert(p.id.clone(), seen);
            prop_assert!(twice.is_none(), "after {}: {} is in two places", at, p.id);
        }
        for d in dead {
            let seen = Seen {
                place: "dead",
                priority: None,
                failures: d.failures,
                deferrals: d.deferrals,
                stalls: Some(d.stalls),
                payload: d.payload,
            };
            let twice = redis.insert(d.id.clone(), seen);
            prop_assert!(twice.is_none(), "after {}: {} is in two places", at, d.id);
        }
        // Nothing lost, nothing acknowledged or removed come back, every
        // count as the model has it.
        let model: BTreeMap<String, Seen> = (self.model.messages.iter())
            .map(|(id, m)| (id.clone(), m.seen()))
            .collect();
        prop_assert_eq!(redis, model, "after {}: what Redis holds", at);
        let count = |f: &dyn Fn(&State) -> bool| {
            self.model.messages.values().filter(|m| f(&m.state)).count() as u64
        };
        let due = count(&|s| matches!(s, State::Waiting { hi, .. } if *hi <= now));
        let later = count(&|s| matches!(s, State::Waiting { hi, .. } if *hi > now));
        let active = count(&|s| matches!(s, State::Active { .. }));
        let dead = count(&|s| *s == State::Dead);
        prop_assert_eq!(
            (stats.due, stats.later, stats.active, stats.dead),
            (due, later, active, dead),
            "after {}: stats",
            at
        );
        Ok(())
    }
}

/// `state` (waiting in a window) with the due time Redis reported, which
/// must fall in the window.
fn pinned(state: State, due: i64, at: &str) -> Result<State, TestCaseError> {
    let State::Waiting { lo, hi } = state else {
        return Err(TestCaseError::fail(format!(
            "{at}: due {due} for a message that does not wait"
        )));
    };
    prop_assert!(
        (lo..=hi).contains(&due),
        "{}: due {} outside {}..={}",
        at,
        due,
        lo,
        hi
    );
    Ok(State::Waiting { lo: due, hi: due })
}

/// A dead letter re-driven: due now, its counts reset.
fn redrive(m: &mut Message, when: State) {
    m.state = when;
    m.failures = 0;
    m.deferrals = 0;
    m.stalls = 0;
}

async fn run_history(
    server: &RefCell<RedisServer>,
    conn: &ConnectionManager,
    n: usize,
    history: &[(Op, Fault)],
) -> Result<(), TestCaseError> {
    let twice = crate::Twice::new(conn.clone());
    let queue = Queue::new(twice.clone(), format!("model-{n}")).expect("a queue");
    let mut world = World {
        server,
        conn: conn.clone(),
        queue,
        twice,
        repeated: false,
        model: Model::default(),
        saved: Model::default(),
        hands: Vec::new(),
        last_claim: 0,
        pushes: 0,
    };
    for (i, step) in history.iter().enumerate() {
        let at = format!("step {i}: {step:?}");
        world.run(*step, &at).await?;
    }
    Ok(())
}

#[test]
fn a_queue_follows_the_model_through_random_histories_with_faults() {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let histories = prop::collection::vec(step(), 1..60);
    crate::run("queue model", 64, histories, |history, n| {
        runtime.block_on(run_history(&server, &conn, n, &history))
    });
}
