//! A key's line of waiters: plain holders take and give back the key (a
//! lock, or one of its permits) while waiters (each a `LockLayer` that
//! retries, woken by a release listener) queue for it. The model says who
//! holds the key and who stands in line in which order; a release hands
//! the key to the first in line, and nobody gets past the line. Waiters of
//! dead processes (no presence on the key's channel) stand in line too: a
//! release drops those before the first live waiter, and hands the key to
//! it. (A release looks at `LINE_LOOK`, 64, waiters at most; the histories
//! keep fewer dead ones in line, and `tests/integration/wake.rs` covers a longer line of
//! them.)

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use lockgate::{Backoff, BoxError, Lease, LockLayer, Locker, OnConflict, Outcome, ReleaseListener};
use proptest::prelude::*;
use redis::aio::ConnectionManager;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tower::{Layer, ServiceExt, service_fn};

use crate::support::{self, ms, secs};

/// Plain holders and waiters in a history.
const HOLDERS: usize = 2;
const WAITERS: usize = 3;
/// Long enough that nothing expires during a history.
const TTL: Duration = secs(60);
/// Longer than anything a step waits for when all is well.
const BOUNDED: Duration = secs(5);

#[derive(Debug, Clone, Copy)]
enum Op {
    /// Plain holder `h` tries once (`Locker::acquire`).
    Acquire(usize),
    /// Plain holder `h` gives its lease back.
    Release(usize),
    /// Waiter `w` calls its layer: it runs at once if the key has room,
    /// or stands in line.
    Wait(usize),
    /// Waiter `w`'s handler returns: its layer gives the key back.
    Finish(usize),
    /// A dead process's `n` waiters join the end of the line (skipped
    /// when more than [`MOST_DEAD`] dead waiters would stand in line).
    DeadJoin(usize),
}

/// The most dead waiters in line in a history: fewer than the 64 waiters a
/// release looks at (`LINE_LOOK` in line.lua), so that a release finds the
/// first live waiter behind them.
const MOST_DEAD: usize = 63;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..HOLDERS).prop_map(Op::Acquire),
        2 => (0..HOLDERS).prop_map(Op::Release),
        3 => (0..WAITERS).prop_map(Op::Wait),
        3 => (0..WAITERS).prop_map(Op::Finish),
        1 => prop_oneof![Just(1usize), Just(3), Just(30)].prop_map(Op::DeadJoin),
    ]
}

/// Who holds a slot of the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Who {
    Plain(usize),
    Waiter(usize),
}

/// Who stands in line: a live waiter, or one of a dead process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InLine {
    Live(usize),
    Dead,
}

#[derive(Debug, Default)]
struct Model {
    holders: BTreeSet<Who>,
    line: VecDeque<InLine>,
    /// A lock only: marked as waited for (a waiter joined the line while
    /// its holder held it, or it was handed on with a line behind), so its
    /// release looks down the line. A permit's release always does.
    marked: bool,
}

impl Model {
    /// A slot was given back (a lock's when `lock`): the first live waiter
    /// in line takes it, the dead ones before it leave the line. Returns
    /// who.
    fn freed(&mut self, lock: bool) -> Option<usize> {
        if lock && !std::mem::take(&mut self.marked) {
            return None;
        }
        while let Some(first) = self.line.pop_front() {
            if let InLine::Live(next) = first {
                self.holders.insert(Who::Waiter(next));
                self.marked = !self.line.is_empty();
                return Some(next);
            }
        }
        None
    }

    /// The live waiters in line.
    fn live(&self) -> usize {
        self.line.iter().filter(|w| **w != InLine::Dead).count()
    }

    fn dead(&self) -> usize {
        self.line.len() - self.live()
    }
}

/// A waiter's call in flight: how to end its handler, and its task.
struct Call {
    finish: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<Outcome<()>, BoxError>>,
}

struct World {
    conn: ConnectionManager,
    locker: Locker<ConnectionManager>,
    listener: ReleaseListener,
    key: String,
    limit: u32,
    model: Model,
    leases: BTreeMap<usize, Lease>,
    calls: BTreeMap<usize, Call>,
    /// Dead processes whose waiters joined the line so far.
    dead_processes: usize,
    /// Waiters whose handler started, as they start.
    started_tx: mpsc::UnboundedSender<usize>,
    started: mpsc::UnboundedReceiver<usize>,
}

impl World {
    /// The Redis key of the line.
    fn line_key(&self) -> String {
        let key = match self.limit {
            1 => self.locker.lock_key(&self.key),
            _ => self.locker.permits_key(&self.key),
        };
        format!("{key}:waiters")
    }

    async fn run(&mut self, op: Op, at: &str) -> Result<(), TestCaseError> {
        // Nobody started behind the model's back.
        prop_assert!(
            self.started.try_recv().is_err(),
            "{}: a waiter started unasked",
            at
        );
        match op {
            Op::Acquire(h) => self.acquire(h, at).await?,
            Op::Release(h) => {
                if let Some(lease) = self.leases.remove(&h) {
                    prop_assert!(self.locker.release(&lease).await.unwrap(), "{}", at);
                    self.model.holders.remove(&Who::Plain(h));
                    self.hand_off(at).await?;
                }
            }
            Op::Wait(w) => self.wait(w, at).await?,
            Op::DeadJoin(n) if self.model.dead() + n <= MOST_DEAD => self.dead_join(n).await,
            Op::DeadJoin(_) => {}
            Op::Finish(w) => {
                if self.model.holders.remove(&Who::Waiter(w)) {
                    let mut call = self.calls.remove(&w).expect("a running call");
                    let _ = call.finish.take().expect("not finished").send(());
                    let done = tokio::time::timeout(BOUNDED, call.task).await;
                    prop_assert!(
                        matches!(done, Ok(Ok(Ok(Outcome::Done(()))))),
                        "{}: {:?}",
                        at,
                        done
                    );
                    self.hand_off(at).await?;
                }
            }
        }
        // A line of live waiters stands only while the key is full.
        let full = self.model.holders.len() == self.limit as usize;
        prop_assert!(self.model.live() == 0 || full, "{}: {:?}", at, self.model);
        let held = match self.limit {
            1 => usize::from(self.locker.inspect(&self.key).await.unwrap().is_some()),
            _ => self.locker.permit_holders(&self.key).await.unwrap().len(),
        };
        prop_assert_eq!(
            held,
            self.model.holders.len(),
            "after {}: {:?}",
            at,
            self.model
        );
        let line: usize = support::raw(&self.conn, &["ZCARD", &self.line_key()]).await;
        prop_assert_eq!(line, self.model.line.len(), "after {}: the line", at);
        Ok(())
    }

    async fn acquire(&mut self, h: usize, at: &str) -> Result<(), TestCaseError> {
        if self.model.holders.contains(&Who::Plain(h)) {
            return Ok(());
        }
        let acquired = match self.limit {
            1 => self.locker.acquire(&self.key).await,
            n => self.locker.acquire_permit(&self.key, n).await,
        };
        let lease = acquired.unwrap().lease();
        // Room, and nobody in line before it (a line stands only while the
        // key is full, so room means no line).
        let room = self.model.holders.len() < self.limit as usize;
        prop_assert_eq!(lease.is_some(), room, "{}: {:?}", at, self.model);
        if let Some(lease) = lease {
            self.leases.insert(h, lease);
            self.model.holders.insert(Who::Plain(h));
        }
        Ok(())
    }

    /// Waiter `w` calls: it starts at once when the key has room, else it
    /// joins the end of the line (seen in Redis before the next step).
    async fn wait(&mut self, w: usize, at: &str) -> Result<(), TestCaseError> {
        if self.calls.contains_key(&w) {
            return Ok(());
        }
        let (finish, finished) = oneshot::channel::<()>();
        let task = self.spawn_waiter(w, finished);
        self.calls.insert(
            w,
            Call {
                finish: Some(finish),
                task,
            },
        );
        if self.model.holders.len() < self.limit as usize {
            self.model.holders.insert(Who::Waiter(w));
            return self.started_is(w, at).await;
        }
        self.model.line.push_back(InLine::Live(w));
        self.model.marked = true;
        let line_key = self.line_key();
        let expected = self.model.line.len();
        let joined = tokio::time::timeout(BOUNDED, async {
            loop {
                let n: usize = support::raw(&self.conn, &["ZCARD", &line_key]).await;
                if n == expected {
                    break;
                }
                tokio::time::sleep(ms(2)).await;
            }
        })
        .await;
        prop_assert!(joined.is_ok(), "{}: waiter {} never stood in line", at, w);
        Ok(())
    }

    fn spawn_waiter(
        &self,
        w: usize,
        finished: oneshot::Receiver<()>,
    ) -> JoinHandle<Result<Outcome<()>, BoxError>> {
        let backoff = Backoff::exponential(ms(20), ms(200))
            .unwrap()
            .unlimited_attempts()
            .max_elapsed(secs(30));
        let layer = LockLayer::new(self.locker.clone(), String::clone)
            .on_conflict(OnConflict::retry(backoff))
            .wake_on_release(self.listener.clone());
        let layer = match self.limit {
            1 => layer,
            n => layer.permits(n).unwrap(),
        };
        let started = self.started_tx.clone();
        let finished = std::sync::Arc::new(std::sync::Mutex::new(Some(finished)));
        let handler = service_fn(move |_key: String| {
            let _ = started.send(w);
            let finished = finished.lock().unwrap().take();
            async move {
                if let Some(finished) = finished {
                    let _ = finished.await;
                }
                Ok::<_, BoxError>(())
            }
        });
        let key = self.key.clone();
        tokio::spawn(layer.layer(handler).oneshot(key))
    }

    /// A dead process's `n` waiters join the end of the line: tokens of a
    /// process tag nobody listens for (`dead` and 4 digits), after every
    /// waiter in line.
    async fn dead_join(&mut self, n: usize) {
        let line_key = self.line_key();
        self.dead_processes += 1;
        let tag = format!("dead{:04}", self.dead_processes);
        let now: (i64, i64) = support::raw(&self.conn, &["TIME"]).await;
        let last: Vec<(String, f64)> = (redis::cmd("ZRANGE").arg(&line_key).arg(-1).arg(-1))
            .arg("WITHSCORES")
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let after = last.first().map_or(0, |(_, score)| *score as i64 + 1);
        let start = (now.0 * 1_000_000 + now.1).max(after);
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(&line_key);
        for i in 0..n {
            // A permit's waiter stands as `<token>/<limit>`.
            let member = match self.limit {
                1 => format!("{tag}{i:024}"),
                limit => format!("{tag}{i:024}/{limit}"),
            };
            zadd.arg(start + i as i64).arg(member);
        }
        let _: i64 = zadd.query_async(&mut self.conn.clone()).await.unwrap();
        self.model.line.extend(std::iter::repeat_n(InLine::Dead, n));
    }

    /// A slot was given back: the first live waiter in line, if any,
    /// starts.
    async fn hand_off(&mut self, at: &str) -> Result<(), TestCaseError> {
        match self.model.freed(self.limit == 1) {
            Some(next) => self.started_is(next, at).await,
            None => Ok(()),
        }
    }

    /// Waits for the next waiter to start: it must be `w`.
    async fn started_is(&mut self, w: usize, at: &str) -> Result<(), TestCaseError> {
        let started = tokio::time::timeout(BOUNDED, self.started.recv()).await;
        prop_assert_eq!(
            started,
            Ok(Some(w)),
            "{}: who started, {:?}",
            at,
            self.model
        );
        Ok(())
    }

    /// Ends the history: gives back every slot, through the model (so the
    /// line drains in order).
    async fn drain(&mut self) -> Result<(), TestCaseError> {
        while let Some(&who) = self.model.holders.first() {
            let op = match who {
                Who::Plain(h) => Op::Release(h),
                Who::Waiter(w) => Op::Finish(w),
            };
            self.run(op, &format!("draining: {op:?}")).await?;
        }
        Ok(())
    }
}

async fn run_history(
    conn: &ConnectionManager,
    listener: &ReleaseListener,
    key: String,
    limit: u32,
    history: &[Op],
) -> Result<(), TestCaseError> {
    let (started_tx, started) = mpsc::unbounded_channel();
    let mut world = World {
        conn: conn.clone(),
        locker: Locker::new(conn.clone()).ttl(TTL).unwrap(),
        listener: listener.clone(),
        key,
        limit,
        model: Model::default(),
        leases: BTreeMap::new(),
        calls: BTreeMap::new(),
        dead_processes: 0,
        started_tx,
        started,
    };
    for (step, op) in history.iter().enumerate() {
        world.run(*op, &format!("step {step}: {op:?}")).await?;
    }
    world.drain().await
}

/// Runs random histories with at most `limit` holders per key.
fn check_lines(limit: u32) {
    let server = support::server();
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::manager(&server));
    let listener = runtime
        .block_on(ReleaseListener::connect(server.client()))
        .unwrap();
    let what = format!("line model, {limit} holder(s) at most");
    let histories = prop::collection::vec(op(), 1..40);
    crate::run(&what, 32, histories, |history, n| {
        let key = format!("line-{limit}-{n}");
        runtime.block_on(run_history(&conn, &listener, key, limit, &history))
    });
}

#[test]
fn waiters_take_a_released_lock_in_line_order() {
    check_lines(1);
}

#[test]
fn waiters_take_released_permits_in_line_order() {
    check_lines(2);
}
