//! A key's lock and its permits, taken, renewed, fenced and given back by
//! several holders in any order; releases, renewals and fences resent (the
//! reply lost, the same call made again), calls made over a connection the
//! server just dropped, and the server restarted from an older snapshot.
//! Fences must grow strictly across all of it, restarts included. A key's
//! permits set is also given leases that ran out long ago, more than one
//! acquire removes (`PERMITS_TRIM` in permits.lua, 100): they count for
//! nobody.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Duration;

use lockgate::testing::RedisServer;
use lockgate::{Lease, Locker};
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support::{self, ms};
use crate::{Fault, fault};

/// Holders in a history.
const HOLDERS: usize = 3;
/// Long enough that nothing expires during a history.
const TTL: Duration = Duration::from_secs(60);

/// One step of a history, by holder `0..HOLDERS`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire(usize),
    Release(usize),
    Extend(usize),
    Fence(usize),
    /// Adds this many leases that ran out a minute ago to the permits set
    /// (as holders that died leave them; nothing for a lock).
    Expired(usize),
    /// `SAVE`: what a restart goes back to.
    Snapshot,
    /// SIGKILL and start again from the last snapshot of this history (or
    /// empty: an earlier one holds none of its keys).
    Restart,
}

fn step() -> impl Strategy<Value = (Op, Fault)> {
    let holder = 0..HOLDERS;
    let op = prop_oneof![
        6 => holder.clone().prop_map(Op::Acquire),
        4 => holder.clone().prop_map(Op::Release),
        2 => holder.clone().prop_map(Op::Extend),
        4 => holder.prop_map(Op::Fence),
        // Fewer and more than one acquire removes (PERMITS_TRIM, 100).
        1 => prop_oneof![Just(3usize), Just(150), Just(350)].prop_map(Op::Expired),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Restart),
    ];
    (op, fault())
}

/// What the key should look like: who holds it (at most `limit` holders),
/// under which token, with the fence issued to that lease, if any.
#[derive(Debug, Clone, Default)]
struct Model {
    holders: BTreeMap<usize, (String, Option<u64>)>,
}

impl Model {
    fn holds(&self, lease: &Lease) -> Option<usize> {
        let held = self
            .holders
            .iter()
            .find(|(_, (token, _))| token == lease.token());
        held.map(|(h, _)| *h)
    }
}

/// One history's world.
struct World<'a> {
    server: &'a RefCell<RedisServer>,
    conn: ConnectionManager,
    locker: Locker<ConnectionManager>,
    key: String,
    limit: u32,
    model: Model,
    saved: Model,
    /// Each holder's latest lease (after a restart, perhaps no longer held).
    leases: BTreeMap<usize, Lease>,
    /// The highest fence seen: never rolled back with the model.
    last_fence: Option<u64>,
    /// How many times expired leases were added (their tokens' names).
    expired: usize,
}

/// Runs `call` until it is not refused for a dropped connection.
macro_rules! retried {
    ($call:expr) => {{
        let mut tries = 0;
        loop {
            match $call.await {
                Err(e) if crate::dropped(&e) && tries < 100 => {
                    tries += 1;
                    tokio::time::sleep(ms(20)).await;
                }
                other => break other,
            }
        }
    }};
}

impl World<'_> {
    async fn run(&mut self, (op, fault): (Op, Fault), at: &str) -> Result<(), TestCaseError> {
        if fault == Fault::Dropped {
            let killed = crate::drop_connections(&self.server.borrow());
            prop_assert!(killed.is_ok(), "{}: CLIENT KILL {:?}", at, killed);
        }
        let calls = match (op, fault) {
            // An acquisition is not resent: a new attempt is a new caller
            // with a new token.
            (Op::Acquire(_) | Op::Restart | Op::Expired(_), _)
            | (_, Fault::None | Fault::Dropped | Fault::Repeated) => 1,
            (_, Fault::Resent) => 2,
        };
        for _ in 0..calls {
            self.step(op, at).await?;
        }
        // What Redis holds agrees with the model after every step.
        let held = match self.limit {
            1 => usize::from(retried!(self.locker.inspect(&self.key)).unwrap().is_some()),
            _ => retried!(self.locker.permit_holders(&self.key))
                .unwrap()
                .len(),
        };
        prop_assert_eq!(held, self.model.holders.len(), "after {}", at);
        Ok(())
    }

    async fn step(&mut self, op: Op, at: &str) -> Result<(), TestCaseError> {
        let at = format!("{at}, model {:?}", self.model);
        match op {
            Op::Acquire(h) => {
                let acquired = match self.limit {
                    1 => retried!(self.locker.acquire(&self.key)),
                    n => retried!(self.locker.acquire_permit(&self.key, n)),
                }
                .unwrap()
                .lease();
                // A holder that holds already asks again as a new caller.
                let expected = self.model.holders.len() < self.limit as usize;
                prop_assert_eq!(acquired.is_some(), expected, "{}", at);
                if let Some(lease) = acquired {
                    let earlier = self
                        .model
                        .holders
                        .insert(h, (lease.token().to_owned(), None));
                    let old = self.leases.insert(h, lease);
                    if let (Some(old), Some(earlier)) = (old, earlier) {
                        // Its earlier lease stays held: give it back so the
                        // model keeps one lease per holder.
                        self.model.holders.insert(usize::MAX, earlier);
                        self.release(&old, &at).await?;
                    }
                }
            }
            Op::Release(h) => {
                if let Some(lease) = self.leases.get(&h).cloned() {
                    self.release(&lease, &at).await?;
                }
            }
            Op::Extend(h) => {
                let Some(mut lease) = self.leases.get(&h).cloned() else {
                    return Ok(());
                };
                let extended = retried!(self.locker.extend(&mut lease, TTL)).unwrap();
                prop_assert_eq!(extended, self.model.holds(&lease).is_some(), "{}", at);
            }
            Op::Fence(h) => {
                if let Some(lease) = self.leases.get(&h).cloned() {
                    self.fence(&lease, &at).await?;
                }
            }
            Op::Expired(n) if self.limit > 1 => self.add_expired(n).await?,
            Op::Expired(_) => {}
            Op::Snapshot => {
                self.server.borrow().snapshot().unwrap();
                self.saved = self.model.clone();
            }
            Op::Restart => {
                self.server.borrow_mut().restart().unwrap();
                self.model = self.saved.clone();
            }
        }
        Ok(())
    }

    /// Adds `n` leases that ran out to the permits set: the model is
    /// unchanged.
    async fn add_expired(&mut self, n: usize) -> Result<(), TestCaseError> {
        let mut zadd = redis::cmd("ZADD");
        zadd.arg(self.locker.permits_key(&self.key));
        let minute_ago = crate::server_us(&mut self.conn).await? / 1000 - 60_000;
        self.expired += 1;
        for i in 0..n {
            zadd.arg(minute_ago + i as i64)
                .arg(format!("expired-{}-{i}", self.expired));
        }
        // Asked again while the connection is being re-opened.
        for _ in 0..100 {
            match zadd.query_async::<i64>(&mut self.conn).await {
                Ok(added) => {
                    prop_assert_eq!(added, n as i64);
                    return Ok(());
                }
                Err(_) => tokio::time::sleep(ms(20)).await,
            }
        }
        Err(TestCaseError::fail("expired leases could not be added"))
    }

    /// Asks for `lease`'s fence: issued once, then the lease's own, held or
    /// not; a new one only while held, strictly above every fence seen,
    /// restarts from older snapshots included.
    async fn fence(&mut self, lease: &Lease, at: &str) -> Result<(), TestCaseError> {
        let cached = lease.issued_fence();
        let fence = retried!(self.locker.fence(lease));
        if let Some(cached) = cached {
            // Issued once, then the lease's own, held or not.
            prop_assert_eq!(fence.ok(), Some(cached), "{}", at);
            return Ok(());
        }
        let Some(holder) = self.model.holds(lease) else {
            let not_held = matches!(fence, Err(lockgate::Error::NotHeld { .. }));
            prop_assert!(not_held, "{}: fence {:?} for a lease not held", at, fence);
            return Ok(());
        };
        let fence = fence.unwrap();
        let issued = &mut self.model.holders.get_mut(&holder).unwrap().1;
        match *issued {
            // A lease's fence is issued once.
            Some(issued) => prop_assert_eq!(fence, issued, "{}", at),
            None => {
                // Fences increase strictly across holders and
                // across restarts from older snapshots.
                let last = self.last_fence;
                prop_assert!(
                    last.is_none_or(|last| fence > last),
                    "{}: {} after {:?}",
                    at,
                    fence,
                    last
                );
                self.last_fence = Some(fence);
                *issued = Some(fence);
            }
        }
        Ok(())
    }

    /// Releases `lease`: `true` when it held the key; also when the key is
    /// found free (a resent release, or a lock a restart lost: nothing but
    /// its own release frees a lock before its TTL), and for permits when
    /// it holds none; `false` for a lock another holder has.
    async fn release(&mut self, lease: &Lease, at: &str) -> Result<(), TestCaseError> {
        let released = retried!(self.locker.release(lease)).unwrap();
        let expected = match self.model.holds(lease) {
            Some(h) => {
                self.model.holders.remove(&h);
                true
            }
            None => self.limit > 1 || self.model.holders.is_empty(),
        };
        prop_assert_eq!(released, expected, "{}: release", at);
        Ok(())
    }
}

/// Runs random histories with at most `limit` holders per key.
fn check_histories(limit: u32) {
    let server = RefCell::new(support::server());
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::reconnecting_manager(&server.borrow()));
    let what = format!("lock model, {limit} holder(s) at most");
    let histories = prop::collection::vec(step(), 1..40);
    crate::run(&what, 64, histories, |history, n| {
        // A key of its own per history (shrinking runs reuse none).
        runtime.block_on(run_history(
            &server,
            &conn,
            format!("model-{limit}-{n}"),
            limit,
            &history,
        ))
    });
}

async fn run_history(
    server: &RefCell<RedisServer>,
    conn: &ConnectionManager,
    key: String,
    limit: u32,
    history: &[(Op, Fault)],
) -> Result<(), TestCaseError> {
    let mut world = World {
        server,
        conn: conn.clone(),
        locker: Locker::new(conn.clone()).ttl(TTL).unwrap(),
        key,
        limit,
        model: Model::default(),
        saved: Model::default(),
        leases: BTreeMap::new(),
        last_fence: None,
        expired: 0,
    };
    for (step, op) in history.iter().enumerate() {
        world.run(*op, &format!("step {step}: {op:?}")).await?;
    }
    Ok(())
}

#[test]
fn a_lock_follows_the_model_through_random_histories() {
    check_histories(1);
}

#[test]
fn permits_follow_the_model_through_random_histories() {
    check_histories(2);
}
