//! Random histories checked against reference models, on a real
//! redis-server (issue 22): a key's lock and its permits (`lock`), a
//! queue's messages through every script that moves them, with lease
//! expiry, resent requests, dropped connections and restarts from an older
//! snapshot (`queue`), a key's line of waiters (`line`), its rate limit as
//! time passes (`rate`), the producer script's arguments from arbitrary
//! strings (`push`), and keyed messages through their scripts (`keyed`,
//! `keyed_push`), also over many keys and several claimers (`keyed_wide`),
//! and their leases index on a Redis Cluster, which the callers keep there
//! (`keyed_cluster`, on a three-node cluster).
//!
//! Each history runs on keys of its own, on one server (or cluster) per test. After
//! every step the answers of Redis and what it holds are compared with the
//! model's; proptest shrinks a failing history to the shortest one that
//! fails, prints it with its seed, and saves the seed under
//! `tests/proptest-regressions/main.txt` so the next run replays it first. CI runs the
//! default number of histories per property (see [`config`]);
//! `PROPTEST_CASES=5000 cargo test --all-features --test model` runs more.

#[path = "../support/mod.rs"]
mod support;

mod keyed;
mod keyed_cluster;
mod keyed_push;
mod keyed_wide;
mod line;
mod lock;
mod push;
mod queue;
mod rate;

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// What goes wrong around a step of a history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// The reply is lost and the same call is made again.
    Resent,
    /// The server closes the client's connection just before the call.
    Dropped,
    /// The reply of a call the library resends unchanged when no answer
    /// comes (a claim, an acknowledgement's hand-over, see [`Twice`]) is
    /// lost and the call sent again; a fault of no other call.
    Repeated,
}

/// One step in ten resent, one in ten over a dropped connection, one in
/// ten repeated.
fn fault() -> impl proptest::strategy::Strategy<Value = Fault> {
    use proptest::prelude::*;
    prop_oneof![
        7 => Just(Fault::None),
        1 => Just(Fault::Resent),
        1 => Just(Fault::Dropped),
        1 => Just(Fault::Repeated),
    ]
}

/// A connection that, while armed, sends every call naming a call's record
/// (a key with `:claims:` in it: the claim scripts, the keyed settlement)
/// twice and answers the second reply: the first lost on the way, the call
/// resent unchanged, as the library does when no answer comes.
#[derive(Clone)]
struct Twice {
    inner: redis::aio::ConnectionManager,
    armed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Twice {
    fn new(inner: redis::aio::ConnectionManager) -> Self {
        let armed = Default::default();
        Twice { inner, armed }
    }

    /// Runs `f` with the repeats armed when `on`.
    async fn armed<T>(&self, on: bool, f: impl AsyncFnOnce() -> T) -> T {
        self.armed.store(on, Ordering::Relaxed);
        let out = f().await;
        self.armed.store(false, Ordering::Relaxed);
        out
    }

    fn repeats(&self, cmd: &redis::Cmd) -> bool {
        let record = |arg: redis::Arg<&[u8]>| match arg {
            redis::Arg::Simple(bytes) => bytes.windows(8).any(|w| w == b":claims:"),
            _ => false,
        };
        self.armed.load(Ordering::Relaxed) && cmd.args_iter().any(record)
    }
}

impl redis::aio::ConnectionLike for Twice {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            if self.repeats(cmd) {
                let _lost = self.inner.req_packed_command(cmd).await;
            }
            self.inner.req_packed_command(cmd).await
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            if pipeline.cmd_iter().any(|cmd| self.repeats(cmd)) {
                let _lost = (self.inner)
                    .req_packed_commands(pipeline, offset, count)
                    .await;
            }
            self.inner
                .req_packed_commands(pipeline, offset, count)
                .await
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

/// `cases` histories per property, unless `PROPTEST_CASES` says otherwise.
fn config(cases: u32) -> Config {
    Config {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|n| n.parse().ok())
            .unwrap_or(cases),
        // Where failing seeds are saved (`tests/proptest-regressions/main.txt`).
        source_file: Some(file!()),
        ..Config::default()
    }
}

/// How much a property ran: histories, steps, and the longest history.
#[derive(Default)]
struct Tally {
    histories: AtomicUsize,
    steps: AtomicUsize,
    longest: AtomicUsize,
}

impl Tally {
    /// Counts a history of `len` steps; returns its number (from 0).
    fn count(&self, len: usize) -> usize {
        self.steps.fetch_add(len, Ordering::Relaxed);
        self.longest.fetch_max(len, Ordering::Relaxed);
        self.histories.fetch_add(1, Ordering::Relaxed)
    }

    fn report(&self, what: &str) {
        eprintln!(
            "{what}: {} histories, {} steps, the longest {} steps",
            self.histories.load(Ordering::Relaxed),
            self.steps.load(Ordering::Relaxed),
            self.longest.load(Ordering::Relaxed)
        );
    }
}

/// A single-threaded runtime for the histories (one server round trip at a
/// time: the models are sequential).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Runs `check` over histories drawn from `strategy`, panicking with the
/// shrunk failing history, and reports how much ran.
fn run<S, F>(what: &str, cases: u32, strategy: S, check: F)
where
    S: proptest::strategy::Strategy,
    S::Value: std::fmt::Debug,
    F: Fn(S::Value, usize) -> Result<(), TestCaseError>,
    S::Value: HistoryLen,
{
    let tally = Tally::default();
    let mut runner = TestRunner::new(config(cases));
    let result = runner.run(&strategy, |history| {
        let n = tally.count(history.history_len());
        check(history, n)
    });
    tally.report(what);
    if let Err(failure) = result {
        panic!("{what}: {failure}");
    }
}

/// The number of steps in a drawn history.
trait HistoryLen {
    fn history_len(&self) -> usize;
}

impl<T> HistoryLen for Vec<T> {
    fn history_len(&self) -> usize {
        self.len()
    }
}

/// Has the server close every client connection but the one asking (the
/// histories' connections: their next call finds it closed).
fn drop_connections(server: &lockgate::testing::RedisServer) -> redis::RedisResult<i64> {
    let kill = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .clone();
    server.query(&kill)
}

/// Whether a lockgate error is a connection that was closed under the
/// call (which then never reached the server) rather than an answer.
fn dropped(e: &lockgate::Error) -> bool {
    e.redis_error()
        .is_some_and(|e| e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal())
}

/// Retries a call while the connection is being re-opened.
async fn retried<T, F, Fut>(at: &str, call: F) -> Result<T, TestCaseError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = lockgate::Result<T>>,
{
    for _ in 0..100 {
        match call().await {
            Ok(reply) => return Ok(reply),
            Err(e) if dropped(&e) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            Err(e) => {
                return Err(TestCaseError::fail(format!("{at}: {e}")));
            }
        }
    }
    Err(TestCaseError::fail(format!("{at}: no connection")))
}

/// The server's clock in µs (`TIME`), asked again while the connection is
/// being re-opened.
async fn server_us(
    conn: &mut redis::aio::ConnectionManager,
) -> Result<i64, proptest::test_runner::TestCaseError> {
    for _ in 0..100 {
        let time: redis::RedisResult<(i64, i64)> = redis::cmd("TIME").query_async(conn).await;
        match time {
            Ok((s, us)) => return Ok(s * 1_000_000 + us),
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
        }
    }
    Err(TestCaseError::fail("the server's clock could not be read"))
}
