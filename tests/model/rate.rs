//! A key's rate limit (`Locker::admit`): calls admitted or refused as time
//! passes, with resent calls, dropped connections and restarts from an
//! older snapshot. The model is the definition: an admission at `x` is
//! allowed when fewer than `limit` admissions lie in `(x - period, x]` and
//! fewer than `burst` in `(x - window, x]` (window = period × burst /
//! limit), and admissions never go back in time; a refusal names the
//! earliest such `x`. Stale entries (admissions of long ago, as a pause
//! leaves them) are added to the log, more than one call removes
//! (`RATE_TRIM` in rate.lua, 100): admissions go on as the model says.

use std::cell::RefCell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockgate::Locker;
use lockgate::lock::rate::{Admission, Rate};
use lockgate::testing::RedisServer;
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support::{self, ms};
use crate::{Fault, fault};

/// The limits a history runs under: 3 per 120 ms, at most 2 per 80 ms.
const LIMIT: u32 = 3;
const BURST: u32 = 2;
const PERIOD: Duration = ms(120);

#[derive(Debug, Clone, Copy)]
enum Op {
    Admit,
    /// Lets time pass (ms).
    Sleep(u64),
    /// Adds this many admissions of a minute ago to the log (stale: older
    /// than the period), as after a pause.
    Stale(usize),
    Snapshot,
    Restart,
}

fn step() -> impl Strategy<Value = (Op, Fault)> {
    let op = prop_oneof![
        6 => Just(Op::Admit),
        3 => prop_oneof![Just(10u64), Just(45), Just(90)].prop_map(Op::Sleep),
        // Fewer and more than one call removes (rate.lua's RATE_TRIM, 100).
        1 => prop_oneof![Just(3usize), Just(150), Just(350)].prop_map(Op::Stale),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restart),
    ];
    (op, fault())
}

/// Admission times (server µs), in order.
#[derive(Debug, Clone, Default)]
struct Model {
    admitted: Vec<i64>,
}

impl Model {
    /// The earliest time at or after `now` an admission is allowed.
    fn earliest(&self, now: i64, rate: &Rate) -> i64 {
        let period = rate.period().as_micros() as i64;
        let window = period * i64::from(rate.burst_size()) / i64::from(rate.limit());
        let mut at = now.max(self.admitted.last().copied().unwrap_or(i64::MIN));
        for (n, span) in [(rate.limit(), period), (rate.burst_size(), window)] {
            // The n-th most recent admission must have left the span.
            if let Some(nth) = self.admitted.iter().rev().nth(n as usize - 1) {
                at = at.max(nth + span);
            }
        }
        at
    }
}

fn us(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

struct World<'a> {
    server: &'a RefCell<RedisServer>,
    conn: ConnectionManager,
    locker: Locker<ConnectionManager>,
    key: String,
    rate: Rate,
    model: Model,
    saved: Model,
}

impl World<'_> {
    async fn run(&mut self, (op, fault): (Op, Fault), at: &str) -> Result<(), TestCaseError> {
        match op {
            Op::Sleep(n) => tokio::time::sleep(ms(n)).await,
            Op::Stale(n) => self.add_stale(n).await?,
            Op::Snapshot => {
                self.server.borrow().snapshot().unwrap();
                self.saved = self.model.clone();
            }
            Op::Restart => {
                self.server.borrow_mut().restart().unwrap();
                self.model = self.saved.clone();
            }
            Op::Admit => {
                if fault == Fault::Dropped {
                    let killed = crate::drop_connections(&self.server.borrow());
                    prop_assert!(killed.is_ok(), "{}: CLIENT KILL {:?}", at, killed);
                }
                // A resent admission is a second call (a new token).
                let calls = if fault == Fault::Resent { 2 } else { 1 };
                for _ in 0..calls {
                    self.admit(at).await?;
                }
            }
        }
        Ok(())
    }

    /// Adds `n` stale admissions to the log: the model is unchanged.
    async fn add_stale(&mut self, n: usize) -> Result<(), TestCaseError> {
        let minute_ago = crate::server_us(&mut self.conn).await? - 60_000_000;
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(self.locker.rate_key(&self.key));
        for i in 0..n {
            let member = format!("stale-{minute_ago}-{i}");
            zadd.arg(minute_ago + i as i64).arg(member);
        }
        // Asked again while the connection is being re-opened.
        for _ in 0..100 {
            let added: redis::RedisResult<i64> = zadd.query_async(&mut self.conn).await;
            match added {
                Ok(added) => {
                    prop_assert_eq!(added, n as i64);
                    return Ok(());
                }
                Err(_) => tokio::time::sleep(ms(20)).await,
            }
        }
        Err(TestCaseError::fail("stale entries could not be added"))
    }

    /// One call, checked against the model at the server time it ran,
    /// which lies between `TIME` before and after.
    async fn admit(&mut self, at: &str) -> Result<(), TestCaseError> {
        let t0 = crate::server_us(&mut self.conn).await?;
        let admission = loop {
            match self.locker.admit(&self.key, &self.rate).await {
                Err(e) if crate::dropped(&e) => tokio::time::sleep(ms(20)).await,
                other => break other.unwrap(),
            }
        };
        let t1 = crate::server_us(&mut self.conn).await?;
        match admission {
            Admission::Admitted(when) => {
                let when = us(when);
                prop_assert!(
                    (t0..=t1).contains(&when),
                    "{}: admitted at {} outside {}..={}",
                    at,
                    when,
                    t0,
                    t1
                );
                let allowed = self.model.earliest(when, &self.rate);
                prop_assert_eq!(
                    allowed,
                    when,
                    "{}: admitted against the limit: {:?}",
                    at,
                    self.model
                );
                self.model.admitted.push(when);
            }
            Admission::Limited(busy) => {
                let wait = busy.retry_after().as_micros() as i64;
                // Refused at some now in t0..=t1: the earliest allowed time
                // lies after it, and the wait points at it exactly.
                let (lo, hi) = (
                    self.model.earliest(t0, &self.rate),
                    self.model.earliest(t1, &self.rate),
                );
                prop_assert!(
                    hi > t0,
                    "{}: refused though allowed since {}: {:?}",
                    at,
                    hi,
                    self.model
                );
                let slot =
                    (t0 + wait..=t1 + wait).contains(&lo) || (t0 + wait..=t1 + wait).contains(&hi);
                prop_assert!(
                    slot,
                    "{}: wait {} µs, allowed at {}..={}, asked in {}..={}",
                    at,
                    wait,
                    lo,
                    hi,
                    t0,
                    t1
                );
            }
        }
        Ok(())
    }
}

async fn run_history(
    server: &RefCell<RedisServer>,
    conn: &ConnectionManager,
    key: String,
    history: &[(Op, Fault)],
) -> Result<(), TestCaseError> {
    let mut world = World {
        server,
        conn: conn.clone(),
        locker: Locker::new(conn.clone()),
        key,
        rate: Rate::new(LIMIT, PERIOD).unwrap().burst(BURST).unwrap(),
        model: Model::default(),
        saved: Model::default(),
    };
    for (step, op) in history.iter().enumerate() {
        world.run(*op, &format!("step {step}: {op:?}")).await?;
    }
    Ok(())
}

#[test]
fn a_rate_limit_follows_the_model_through_random_histories() {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let histories = prop::collection::vec(step(), 1..30);
    crate::run("rate model", 32, histories, |history, n| {
        runtime.block_on(run_history(&server, &conn, format!("rate-{n}"), &history))
    });
}
