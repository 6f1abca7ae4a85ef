//! Helpers shared by the integration tests: servers, connections, polling,
//! queue and lock shortcuts. Each test file includes it with `mod support;`.

// Every test crate compiles this module but uses only part of it.
#![allow(dead_code)]

use std::fmt::Debug;
use std::time::Duration;

use lockgate::queue::Stats;
use lockgate::testing::RedisServer;
use lockgate::{Acquisition, Backoff, Lease, Locker, Queue};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, timeout};

/// Upper bound for anything a test waits for; never reached when all is well.
pub const BOUNDED: Duration = secs(10);

/// `n` milliseconds.
pub const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// `n` seconds.
pub const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// The path of example `name`'s binary, the examples built once per test
/// process (`cargo build --examples`, from the workspace's root, with the
/// features this test was built with: all of them when `tls` is on, as
/// the README's test command builds, else `test-util`). After that
/// command built every target this builds nothing: the test runs what
/// that build made, rather than building the library again under other
/// features while the other tests run.
pub fn example(name: &str) -> std::path::PathBuf {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let dir = BUILT.get_or_init(|| {
        let features: &[&str] = match cfg!(feature = "tls") {
            true => &["--all-features"],
            false => &["--features", "test-util"],
        };
        let status = cargo()
            .args(["build", "--quiet", "--examples"])
            .args(features)
            .status()
            .expect("running cargo build");
        assert!(status.success(), "building the examples failed");
        // target/<profile>/deps/<this test> -> target/<profile>/examples
        let exe = std::env::current_exe().expect("the test's own path");
        let profile = (exe.parent().and_then(|deps| deps.parent())).expect("target/<profile>");
        profile.join("examples")
    });
    dir.join(name)
}

/// `cargo`, to build or run an example, in the package's directory and
/// without the variables Cargo set for this test: build scripts that watch
/// one (ring's watches `CARGO_MANIFEST_DIR`) would run again, and every
/// crate above them be rebuilt, here and in the next build.
pub fn cargo() -> std::process::Command {
    const SET: &[&str] = &[
        "CARGO_PKG_",
        "CARGO_MANIFEST_",
        "CARGO_CRATE_",
        "CARGO_PRIMARY_",
    ];
    const EXACT: &[&str] = &["CARGO_TARGET_TMPDIR", "CARGO_RUSTC_CURRENT_DIR", "OUT_DIR"];
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo.current_dir(env!("CARGO_MANIFEST_DIR"));
    for (var, _) in std::env::vars_os() {
        let set_by_cargo = var.to_str().is_some_and(|var| {
            SET.iter().any(|prefix| var.starts_with(prefix)) || EXACT.contains(&var)
        });
        if set_by_cargo {
            cargo.env_remove(var);
        }
    }
    cargo
}

/// A private redis-server for one test, killed when dropped.
pub fn server() -> RedisServer {
    RedisServer::start().unwrap_or_else(|e| panic!("could not start redis-server: {e}"))
}

/// A connection manager with redis-rs's default configuration.
pub async fn manager(server: &RedisServer) -> ConnectionManager {
    server
        .connection_manager()
        .await
        .expect("connection manager to the test server")
}

/// A connection manager that gives up reconnecting quickly, so tests against
/// a dead server stay short (the default retries for several seconds).
pub async fn impatient_manager(server: &RedisServer) -> ConnectionManager {
    let config = ConnectionManagerConfig::new()
        .set_number_of_retries(1)
        .set_min_delay(ms(10))
        .set_max_delay(ms(50))
        .set_connection_timeout(Some(ms(500)))
        .set_response_timeout(Some(ms(500)));
    with_config(server, config).await
}

/// A connection manager that reconnects quickly after a restart or a kill.
pub async fn reconnecting_manager(server: &RedisServer) -> ConnectionManager {
    let config = ConnectionManagerConfig::new()
        .set_number_of_retries(5)
        .set_min_delay(ms(20))
        .set_max_delay(ms(200));
    with_config(server, config).await
}

async fn with_config(server: &RedisServer, config: ConnectionManagerConfig) -> ConnectionManager {
    server
        .client()
        .get_connection_manager_with_config(config)
        .await
        .expect("connection manager to the test server")
}

/// Runs a raw command (`args[0]` is its name), as another client would.
pub async fn raw<T: redis::FromRedisValue>(
    conn: &(impl ConnectionLike + Clone),
    args: &[&str],
) -> T {
    redis::cmd(args[0])
        .arg(&args[1..])
        .query_async(&mut conn.clone())
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

/// Whether `key` exists on the server.
pub async fn exists(conn: &(impl ConnectionLike + Clone), key: &str) -> bool {
    raw::<i64>(conn, &["EXISTS", key]).await == 1
}

/// Whether the key `lock_key` (a lock, or a fence record) exists.
pub async fn held(conn: &(impl ConnectionLike + Clone), lock_key: &str) -> bool {
    raw::<Option<String>>(conn, &["GET", lock_key])
        .await
        .is_some()
}

/// The part of `key` Redis Cluster hashes: the content between the first `{`
/// and the first `}` after it when that is non-empty, else the whole key.
pub fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{') {
        let rest = &key[open + 1..];
        if let Some(close) = rest.find('}')
            && close > 0
        {
            return &rest[..close];
        }
    }
    key
}

/// Polls `check` until it returns `Ok`, for at most `within`; panics with
/// `what` and the last state `check` described otherwise.
pub async fn eventually(
    what: &str,
    within: Duration,
    mut check: impl AsyncFnMut() -> Result<(), String>,
) {
    let deadline = Instant::now() + within;
    loop {
        let state = match check().await {
            Ok(()) => return,
            Err(state) => state,
        };
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting until {what}; last state: {state}");
        }
        sleep(ms(10)).await;
    }
}

/// The answer of an [`eventually`] check: done when `done`, else not yet,
/// with `state` as what was seen.
pub fn done_if(done: bool, state: impl Debug) -> Result<(), String> {
    if done {
        Ok(())
    } else {
        Err(format!("{state:?}"))
    }
}

/// A locker with a lease TTL of `ttl`.
pub fn locker<C>(conn: C, ttl: Duration) -> Locker<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    Locker::new(conn).ttl(ttl).expect("valid TTL")
}

/// Acquires `key`, which must be free.
pub async fn acquired<C>(locker: &Locker<C>, key: &str) -> Lease
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    match locker.acquire(key).await.expect("acquire") {
        Acquisition::Acquired(lease) => lease,
        Acquisition::Contended(c) => panic!("expected to acquire {key:?}, got {c}"),
    }
}

/// Exponential backoff from `base` to `max` milliseconds.
pub fn backoff(base: u64, max: u64) -> Backoff {
    Backoff::exponential(ms(base), ms(max)).expect("valid backoff")
}

/// Queue stats, retried through connection faults for up to 20 s.
pub async fn stats<T, C>(queue: &Queue<T, C>) -> Stats
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let deadline = Instant::now() + secs(20);
    loop {
        match queue.stats().await {
            Ok(stats) => return stats,
            Err(error) if Instant::now() < deadline => {
                eprintln!("stats failed ({error}); retrying");
                sleep(ms(50)).await;
            }
            Err(error) => panic!("could not read queue stats for 20 s: {error}"),
        }
    }
}

/// `(due, later, active, dead)`: the message counts of `stats`.
pub fn counts(stats: &Stats) -> (u64, u64, u64, u64) {
    (stats.due, stats.later, stats.active, stats.dead)
}

/// Waits (up to 20 s) until `queue` holds no message in any state.
pub async fn queue_drained<T, C>(queue: &Queue<T, C>)
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    eventually("the queue is empty", secs(20), async || {
        let s = stats(queue).await;
        done_if(counts(&s) == (0, 0, 0, 0), s)
    })
    .await;
}

/// Triggers a worker's graceful shutdown and waits (bounded) for `run_until`
/// to return; panics unless it returned `Ok`.
/// A shutdown signal for `Worker::run_until`: send on the sender (or hand
/// it to [`stop`]) to end the worker.
pub fn shutdown_signal() -> (
    oneshot::Sender<()>,
    impl std::future::Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = oneshot::channel::<()>();
    (tx, async move {
        let _ = rx.await;
    })
}

pub async fn stop(stop: oneshot::Sender<()>, run: JoinHandle<lockgate::Result<()>>) {
    let _ = stop.send(());
    match timeout(secs(20), run).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => panic!("run_until returned an error: {error}"),
        Ok(Err(error)) => panic!("the worker task failed: {error}"),
        Err(_) => panic!("run_until did not return within 20 s of the shutdown signal"),
    }
}

/// What handlers record while they run: who held which key when, and how
/// often each message was handled. For mutual-exclusion and exactly-once
/// assertions. Cloning shares the record.
#[derive(Clone, Default)]
pub struct Holds(std::sync::Arc<std::sync::Mutex<HoldsInner>>);

#[derive(Default)]
struct HoldsInner {
    /// Per key: (start, end, message number) of each handler run.
    intervals: std::collections::HashMap<String, Vec<(Instant, Instant, u32)>>,
    /// Per message number: how many times it was handled.
    handled: std::collections::BTreeMap<u32, u32>,
}

impl Holds {
    fn inner(&self) -> std::sync::MutexGuard<'_, HoldsInner> {
        self.0.lock().unwrap()
    }

    /// A handler ran message `n` under `key` from `start` to `end`.
    pub fn record(&self, key: &str, n: u32, start: Instant, end: Instant) {
        let mut inner = self.inner();
        inner
            .intervals
            .entry(key.to_owned())
            .or_default()
            .push((start, end, n));
        *inner.handled.entry(n).or_default() += 1;
    }

    /// How many distinct messages were handled.
    pub fn handled(&self) -> usize {
        self.inner().handled.len()
    }

    /// Asserts that messages `0..total` were each handled exactly once.
    pub fn assert_each_once(&self, total: usize) {
        let inner = self.inner();
        assert_eq!(inner.handled.len(), total);
        let twice: Vec<_> = inner.handled.iter().filter(|(_, c)| **c != 1).collect();
        assert!(twice.is_empty(), "handled more than once: {twice:?}");
    }

    /// Per key, the most handler runs that overlapped at one moment.
    #[allow(dead_code)]
    pub fn most_at_once(&self) -> std::collections::BTreeMap<String, usize> {
        self.inner()
            .intervals
            .iter()
            .map(|(key, list)| {
                let runs = list.iter().map(|(start, end, _)| (*start, *end));
                (key.clone(), most_at_once(runs))
            })
            .collect()
    }

    /// Asserts that each key's messages started in push order (numbered
    /// in the order they were pushed).
    #[allow(dead_code)]
    pub fn assert_push_order(&self) {
        for (key, list) in self.inner().intervals.iter_mut() {
            list.sort_by_key(|(start, _, _)| *start);
            let ns: Vec<u32> = list.iter().map(|(_, _, n)| *n).collect();
            let in_order = ns.windows(2).all(|pair| pair[0] < pair[1]);
            assert!(in_order, "key {key:?} started out of push order: {ns:?}");
        }
    }

    /// Asserts that no two handler runs of one key overlapped.
    pub fn assert_exclusive(&self) {
        for (key, list) in self.inner().intervals.iter_mut() {
            list.sort_by_key(|(start, _, _)| *start);
            for pair in list.windows(2) {
                assert!(
                    pair[0].1 <= pair[1].0,
                    "handlers of key {key:?} overlapped: message {} and {}",
                    pair[0].2,
                    pair[1].2
                );
            }
        }
    }
}

/// Calls made through `EVAL`/`EVALSHA`/`FCALL` on the server so far
/// (`INFO commandstats`): what a waiter that polls would drive up.
pub async fn script_calls(conn: &ConnectionManager) -> u64 {
    let calls = lockgate::testing::command_calls(&mut conn.clone()).await;
    let calls = calls.expect("INFO commandstats");
    ["evalsha", "eval", "fcall"]
        .iter()
        .filter_map(|c| calls.get(*c))
        .sum()
}

/// Wall-clock nanoseconds since the epoch: intervals recorded by several
/// processes of this machine compare.
pub fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The name the test harness gives the test `name` of the module whose
/// `module_path!()` is `module`: its path in the test binary, without the
/// binary's own name (`keyed::keyed_worker_child`), which a child process
/// of the binary runs with `--exact`.
pub fn test_named(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, inside)) => format!("{inside}::{name}"),
        None => name.to_string(),
    }
}

/// Starts this test binary again as a child process that runs only the
/// ignored test `child` of the module whose `module_path!()` is `module`,
/// with `spec` in the environment variable `var`; its stdout is piped to
/// the caller.
pub fn spawn_child(module: &str, var: &str, spec: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            test_named(module, "child").as_str(),
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(var, spec)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("spawning a child process")
}

/// The most of `intervals` (start, end) that overlap at one moment; ends
/// before starts at the same instant (touching is not overlapping).
#[allow(dead_code)]
pub fn most_at_once<T: Ord>(intervals: impl IntoIterator<Item = (T, T)>) -> usize {
    let mut events: Vec<(T, i32)> = Vec::new();
    for (start, end) in intervals {
        events.push((start, 1));
        events.push((end, -1));
    }
    events.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in events {
        now += step;
        most = most.max(now);
    }
    most as usize
}

/// This host's wall clock in ms since 1970, with fractions: for records
/// compared across processes on one machine.
#[allow(dead_code)]
pub fn unix_ms_f64() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64() * 1000.0)
}
