//! Issue 38: a Lua script runs alone on its server, so its work must be
//! bounded by its own arguments, never by the data. Each test prepares
//! large data on a server of its own (a million dead letters, event
//! entries of a thousand ids, a million stale rate-log entries or expired
//! permit holders, long lines of dead waiters), runs one operation, and
//! reads the server's `SLOWLOG`: its longest command must stay under
//! [`BOUND`].
//!
//! A command's time in the slow log is wall time, so a busy machine can
//! stretch one: each operation is tried up to [`ATTEMPTS`] times (on
//! freshly prepared data where the operation consumes it) and passes when
//! one attempt stays under the bound. Work that grows with the data is
//! slow on every attempt.

mod support;

use std::sync::LazyLock;
use std::time::Duration;

use lockgate::lock::permits::MAX_PERMITS;
use lockgate::lock::rate::{Admission, Rate};
use lockgate::queue::DeadCursor;
use lockgate::{Locker, PushOptions, Queue};
use redis::AsyncConnectionConfig;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use support::{ms, secs};

/// The longest a single command may run during an operation.
const BOUND: Duration = ms(3);
/// Tries per operation (see the module docs).
const ATTEMPTS: usize = 3;
/// A million: the size of the prepared data.
const MILLION: u64 = 1_000_000;

/// One test at a time: two servers preparing a million entries each on two
/// cores would stretch each other's commands.
static ONE_AT_A_TIME: LazyLock<tokio::sync::Mutex<()>> =
    LazyLock::new(|| tokio::sync::Mutex::new(()));

/// Adds members `<prefix><i><suffix>` for i in `from..to` (zero-padded to
/// 10 digits, so they sort as numbers) to the sorted set KEYS[1], scored
/// `base + i * step`, 1,000 per `ZADD`.
const FILL_ZSET: &str = r"
local prefix, from, to = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local base, step, suffix = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local args = {}
for i = from, to - 1 do
  args[#args + 1] = string.format('%.0f', base + i * step)
  args[#args + 1] = prefix .. string.format('%010d', i) .. suffix
  if #args == 2000 or i == to - 1 then
    redis.call('ZADD', KEYS[1], unpack(args))
    args = {}
  end
end
return 1
";

/// Adds ARGV[1] entries to the stream KEYS[1], each a `done` event of
/// ARGV[2] ids (the library's entry format, `e done t <ms> <id> <attempt>
/// ...`), at the server's time.
const FILL_EVENTS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields = {'e', 'done', 't', now}
for i = 1, tonumber(ARGV[2]) do
  fields[#fields + 1] = string.format('m%010d', i)
  fields[#fields + 1] = 1
end
for _ = 1, tonumber(ARGV[1]) do
  redis.call('XADD', KEYS[1], '*', unpack(fields))
end
return 1
";

/// A server of its own, and a connection to it that waits as long as a
/// slow command takes (the old scripts took seconds).
async fn server() -> (lockgate::testing::RedisServer, MultiplexedConnection) {
    let server = support::server();
    let config = AsyncConnectionConfig::new().set_response_timeout(Some(secs(60)));
    let mut conn = (server.client())
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "slowlog-max-len", "4096"])
        .query_async(&mut conn)
        .await
        .unwrap();
    (server, conn)
}

/// Has the slow log record every command (`on`), or none.
async fn slowlog(conn: &mut MultiplexedConnection, on: bool) {
    let slower_than = if on { "0" } else { "-1" };
    let _: () = redis::cmd("CONFIG")
        .arg(&["SET", "slowlog-log-slower-than", slower_than])
        .query_async(conn)
        .await
        .unwrap();
}

/// How [`fill_zset`] names and scores its members.
struct Members<'a> {
    prefix: &'a str,
    suffix: &'a str,
    /// The first member's score, and the step to the next.
    base: f64,
    step: f64,
}

/// Fills `key` (a sorted set) with `n` members in chunks of 10,000 (one
/// script call each: the preparation may block the server, the
/// measurement starts after it).
async fn fill_zset(conn: &mut MultiplexedConnection, key: &str, n: u64, members: Members<'_>) {
    let script = redis::Script::new(FILL_ZSET);
    let mut from = 0;
    while from < n {
        let to = (from + 10_000).min(n);
        let _: i64 = script
            .key(key)
            .arg(members.prefix)
            .arg(from)
            .arg(to)
            .arg(members.base)
            .arg(members.step)
            .arg(members.suffix)
            .invoke_async(conn)
            .await
            .unwrap();
        from = to;
    }
}

/// A connection manager that waits as long as a slow command takes (the
/// default gives up after 500 ms: the old scripts took seconds).
async fn patient(server: &lockgate::testing::RedisServer) -> ConnectionManager {
    let config = ConnectionManagerConfig::new().set_response_timeout(Some(secs(60)));
    server
        .client()
        .get_connection_manager_with_config(config)
        .await
        .unwrap()
}

/// The server's time in µs.
async fn server_us(conn: &mut MultiplexedConnection) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.unwrap();
    s * 1_000_000 + us
}

/// The commands in the slow log since it was last reset, less the test's
/// own around the operation and the library loading a script on its first
/// call (once per server, whatever the data): their durations and names.
async fn logged(conn: &mut MultiplexedConnection) -> Vec<(Duration, String)> {
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg(&["GET", "4096"])
        .query_async(conn)
        .await
        .unwrap();
    let mut out = Vec::new();
    for entry in entries {
        let redis::Value::Array(fields) = entry else {
            continue;
        };
        let micros = match fields.get(2) {
            Some(redis::Value::Int(us)) => *us as u64,
            _ => continue,
        };
        let name = match fields.get(3) {
            Some(redis::Value::Array(args)) => args
                .iter()
                .take(2)
                .map(|a| match a {
                    redis::Value::BulkString(b) => {
                        String::from_utf8_lossy(b).chars().take(40).collect()
                    }
                    other => format!("{other:?}"),
                })
                .collect::<Vec<String>>()
                .join(" "),
            _ => String::new(),
        };
        let own = ["CONFIG", "SLOWLOG", "SCRIPT"]
            .iter()
            .any(|c| name.starts_with(c));
        if !own {
            out.push((Duration::from_micros(micros), name));
        }
    }
    out
}

/// The longest command in the slow log since it was last reset (see
/// [`logged`]): its duration and its name.
async fn slowest(conn: &mut MultiplexedConnection) -> (Duration, String) {
    let logged = logged(conn).await;
    logged
        .into_iter()
        .max_by_key(|(took, _)| *took)
        .unwrap_or_default()
}

async fn reset_slowlog(conn: &mut MultiplexedConnection) {
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(conn)
        .await
        .unwrap();
}

/// Runs `prepare` then `op` up to [`ATTEMPTS`] times, measuring the
/// longest command `op` caused; passes at the first attempt under
/// [`BOUND`], and panics with every attempt's figure otherwise.
async fn within_bound<P, O>(what: &str, conn: &mut MultiplexedConnection, mut prepare: P, mut op: O)
where
    P: AsyncFnMut(&mut MultiplexedConnection),
    O: AsyncFnMut(),
{
    let mut seen = Vec::new();
    for _ in 0..ATTEMPTS {
        // Only the operation's commands are logged.
        slowlog(conn, false).await;
        prepare(conn).await;
        reset_slowlog(conn).await;
        slowlog(conn, true).await;
        op().await;
        slowlog(conn, false).await;
        let (longest, command) = slowest(conn).await;
        eprintln!("{what}: longest command {longest:?} ({command})");
        if longest < BOUND {
            return;
        }
        seen.push(format!("{longest:?} ({command})"));
        // Far above the bound is the data's doing, not the machine's: no
        // need to wait for it again.
        if longest > 20 * BOUND {
            break;
        }
    }
    panic!(
        "{what}: the longest command took {} (bound {BOUND:?})",
        seen.join(", then ")
    );
}

/// The dead letters of one set, `d<i>` buried at `BURIED + i` ms.
const BURIED: f64 = 1_700_000_000_000.0;

/// Members `<prefix><i>`, scored `base + i * step`.
fn members(prefix: &str, base: f64, step: f64) -> Members<'_> {
    Members {
        prefix,
        suffix: "",
        base,
        step,
    }
}

#[tokio::test]
async fn a_deep_dead_letter_page_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let manager = patient(&server).await;
    let queue: Queue<u64> = Queue::new(manager, "deep").unwrap();
    let dead = "lockgate:{deep}:dead";
    fill_zset(&mut conn, dead, MILLION, members("d", BURIED, 1.0)).await;
    for (what, at) in [
        ("page at 100,000", 100_000),
        ("last page", MILLION as usize - 25),
    ] {
        within_bound(
            &format!("dead letters, {what} of 1,000,000"),
            &mut conn,
            async |_| {},
            async || {
                // The page after the letter before position `at`.
                let before = at as i64 - 1;
                let cursor = DeadCursor::new(BURIED as i64 + before, format!("d{before:010}"));
                let page = queue.dead_letters(Some(&cursor), 25).await.unwrap();
                assert_eq!(page.letters.len(), 25);
                assert_eq!(page.letters[0].id, format!("d{at:010}"));
            },
        )
        .await;
    }
}

#[tokio::test]
async fn activity_over_large_event_entries_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let manager = patient(&server).await;
    let queue: Queue<u64> = Queue::new(manager, "busy")
        .unwrap()
        .record_events(100_000)
        .unwrap();
    // 1,000 entries of 1,000 ids each: what ack batches of 1,000 write.
    let _: i64 = redis::Script::new(FILL_EVENTS)
        .key("lockgate:{busy}:events")
        .arg(1000)
        .arg(1000)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    within_bound(
        "activity over 1,000 entries of 1,000 ids",
        &mut conn,
        async |_| {},
        async || {
            let activity = queue.activity(secs(300), 30).await.unwrap();
            assert!(activity.recorded);
        },
    )
    .await;
}

#[tokio::test]
async fn an_admission_after_a_pause_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let locker = Locker::new(patient(&server).await);
    let rate = Rate::new(100, secs(1)).unwrap();
    let log = locker.rate_key("hot");
    within_bound(
        "admit with 1,000,000 stale log entries",
        &mut conn,
        async |conn| {
            // Admissions of a busy minute ago: all older than the period.
            let long_ago = (server_us(conn).await - 60_000_000) as f64;
            unlink(conn, &log).await;
            fill_zset(conn, &log, MILLION, members("a", long_ago, 1.0)).await;
        },
        async || {
            let admission = locker.admit("hot", &rate).await.unwrap();
            assert!(matches!(admission, Admission::Admitted(_)), "{admission:?}");
        },
    )
    .await;
}

#[tokio::test]
async fn a_full_permit_set_of_expired_holders_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let locker = Locker::new(patient(&server).await);
    let limit = MAX_PERMITS;
    let set = locker.permits_key("wide");
    within_bound(
        "acquire_permit with all 2^20 holders expired",
        &mut conn,
        async |conn| {
            let long_ago = (server_us(conn).await / 1000 - 60_000) as f64;
            unlink(conn, &set).await;
            fill_zset(conn, &set, u64::from(limit), members("t", long_ago, 0.0)).await;
        },
        async || {
            let acquired = locker.acquire_permit("wide", limit).await.unwrap();
            assert!(acquired.lease().is_some());
        },
    )
    .await;
}

async fn unlink(conn: &mut MultiplexedConnection, key: &str) {
    let _: i64 = redis::cmd("UNLINK")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap();
}

/// Puts `processes` dead processes' waiters in `line`, `each` apiece:
/// tokens `dead<p>xx…x<i>` (32 characters, the process tag `dead<p>`
/// first, as a live process's tokens have theirs) followed by `suffix`;
/// each process's waiters one after the other, or the processes'
/// waiters `interleaved` (the first waiters in line belong to different
/// processes). No process listens on its presence channel.
async fn dead_line(
    conn: &mut MultiplexedConnection,
    line: &str,
    (processes, each): (u64, u64),
    suffix: &str,
    interleaved: bool,
) {
    unlink(conn, line).await;
    for p in 0..processes {
        let prefix = format!("dead{p:04}{}", "x".repeat(14));
        let (base, step) = match interleaved {
            true => (p as f64, processes as f64),
            false => ((p * each) as f64, 1.0),
        };
        let members = Members {
            prefix: &prefix,
            suffix,
            base: base + 1.0,
            step,
        };
        fill_zset(conn, line, each, members).await;
    }
}

#[tokio::test]
async fn a_release_before_a_line_of_dead_waiters_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let locker = Locker::new(patient(&server).await).ttl(secs(30)).unwrap();
    let line = format!("{}:waiters", locker.lock_key("k"));
    let lease = std::cell::RefCell::new(None);
    within_bound(
        "release before 32 dead processes x 2,000 waiters",
        &mut conn,
        async |conn| {
            dead_line(conn, &line, (32, 2000), "", false).await;
            let held = support::acquired(&locker, "k").await;
            // Marked: someone waits, so the release looks down the line.
            let _: i64 = redis::cmd("APPEND")
                .arg(locker.lock_key("k"))
                .arg("!")
                .query_async(conn)
                .await
                .unwrap();
            *lease.borrow_mut() = Some(held);
        },
        async || {
            let held = lease.borrow_mut().take().unwrap();
            assert!(locker.release(&held).await.unwrap());
        },
    )
    .await;
}

#[tokio::test]
async fn a_permit_release_before_a_line_of_dead_waiters_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let locker = Locker::new(patient(&server).await).ttl(secs(30)).unwrap();
    let line = format!("{}:waiters", locker.permits_key("k"));
    let lease = std::cell::RefCell::new(None);
    within_bound(
        "permit release before 32 dead processes x 2,000 waiters",
        &mut conn,
        async |conn| {
            // Waiters for 2 permits: members `<token>/2`.
            dead_line(conn, &line, (32, 2000), "/2", true).await;
            let held = locker
                .acquire_permit("k", 2)
                .await
                .unwrap()
                .lease()
                .unwrap();
            *lease.borrow_mut() = Some(held);
        },
        async || {
            let held = lease.borrow_mut().take().unwrap();
            assert!(locker.release(&held).await.unwrap());
        },
    )
    .await;
}

#[tokio::test]
async fn force_unlock_of_a_long_line_does_not_block_the_server() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut conn) = server().await;
    let locker = Locker::new(patient(&server).await).ttl(secs(30)).unwrap();
    let line = format!("{}:waiters", locker.lock_key("k"));
    within_bound(
        "force_unlock with 1,000,000 waiters",
        &mut conn,
        async |conn| {
            fill_zset(conn, &line, MILLION, members("w", 1.0, 1.0)).await;
            let _ = support::acquired(&locker, "k").await;
        },
        async || {
            assert!(locker.force_unlock("k").await.unwrap());
        },
    )
    .await;
}

// ---------------------------------------------------------------------------
// The rule, read from the scripts themselves (docs/internals.md, "Key layout"):
// every script's work is bounded by its arguments (a batch size, a LIMIT or
// COUNT, a constant stated next to it), never by the data.

/// Commands whose work grows with the data whatever their arguments.
const UNBOUNDED: &[&str] = &[
    "ZREMRANGEBYSCORE",
    "ZREMRANGEBYLEX",
    "HGETALL",
    "HKEYS",
    "HVALS",
    "SMEMBERS",
    "SUNION",
    "SINTER",
    "SDIFF",
    "KEYS",
    "SORT",
];

/// Range commands that must carry a `LIMIT` (or `COUNT`) argument.
const NEED_LIMIT: &[(&str, &str)] = &[
    ("ZRANGEBYSCORE", "LIMIT"),
    ("ZREVRANGEBYSCORE", "LIMIT"),
    ("ZRANGEBYLEX", "LIMIT"),
    ("ZREVRANGEBYLEX", "LIMIT"),
    ("XRANGE", "COUNT"),
    ("XREVRANGE", "COUNT"),
    ("XTRIM", "LIMIT"),
];

/// Known exceptions, each with its reason; each must still be found (a
/// stale entry fails too).
const EXCEPTIONS: &[(&str, &str, &str)] = &[(
    "src/queue/lua/prelude.lua",
    "XTRIM",
    "keep_completed trims the completed stream exactly to its age limit (no LIMIT: \
     Redis takes one only with `~`); one entry added per call, so a call removes one \
     in steady state, more only after an operator lowered the limit",
)];

/// Every `redis.call(...)`/`redis.pcall(...)` in `source` whose command is
/// a literal: (line number, command, the whole call's text).
fn calls(source: &str) -> Vec<(usize, String, String)> {
    let mut found = Vec::new();
    for (at, _) in source.match_indices("redis.") {
        let rest = &source[at..];
        let Some(open) = ["redis.call(", "redis.pcall("]
            .iter()
            .find_map(|p| rest.starts_with(p).then_some(p.len()))
        else {
            continue;
        };
        // To the matching parenthesis, quotes skipped.
        let (mut depth, mut quote, mut end) = (1, None, open);
        for (i, c) in rest[open..].char_indices() {
            match (quote, c) {
                (Some(q), c) if c == q => quote = None,
                (Some(_), _) => {}
                (None, '\'' | '"') => quote = Some(c),
                (None, '(') => depth += 1,
                (None, ')') => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + i;
                break;
            }
        }
        let call = &rest[open..end];
        let command = call.trim_start();
        if let Some(name) = command
            .strip_prefix('\'')
            .and_then(|c| c.split('\'').next())
        {
            let line = source[..at].lines().count() + 1;
            found.push((line, name.to_uppercase(), call.to_owned()));
        }
    }
    found
}

fn lua_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            lua_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "lua") {
            out.push(path);
        }
    }
}

#[test]
fn every_script_s_work_is_bounded_by_its_arguments() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    lua_files(&root.join("src"), &mut files);
    assert!(files.len() > 20, "the scripts: {files:?}");
    let mut broken = Vec::new();
    let mut excepted = std::collections::BTreeSet::new();
    for file in &files {
        let name = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let source = std::fs::read_to_string(file).unwrap();
        for (line, command, call) in calls(&source) {
            let limit = NEED_LIMIT.iter().find(|(c, _)| *c == command);
            let wrong = if UNBOUNDED.contains(&command.as_str()) {
                Some("grows with the data".to_owned())
            } else if let Some((_, word)) = limit.filter(|(_, word)| !call.contains(*word)) {
                Some(format!("no {word}"))
            } else if command == "ZRANGE" && call.replace(' ', "").ends_with(",-1") {
                Some("a range to the end".to_owned())
            } else if command == "ZRANGE"
                && ["BYSCORE", "BYLEX"].iter().any(|b| call.contains(b))
                && !call.contains("LIMIT")
            {
                Some("no LIMIT".to_owned())
            } else {
                None
            };
            let Some(wrong) = wrong else { continue };
            let exception = EXCEPTIONS
                .iter()
                .find(|(f, c, _)| *f == name && *c == command);
            match exception {
                Some(exception) => {
                    excepted.insert(*exception);
                }
                None => broken.push(format!("{name}:{line}: {command}: {wrong}")),
            }
        }
    }
    assert!(
        broken.is_empty(),
        "unbounded script work:\n{}",
        broken.join("\n")
    );
    let stale: Vec<_> = EXCEPTIONS
        .iter()
        .filter(|e| !excepted.contains(e))
        .collect();
    assert!(stale.is_empty(), "exceptions no longer found: {stale:?}");
}

/// A connection that counts its round trips one after another (a pipeline
/// is one; so are requests sent together, before any of them is answered).
#[derive(Clone, Default)]
struct Counting {
    inner: Option<ConnectionManager>,
    in_flight: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    waves: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl Counting {
    fn new(inner: ConnectionManager) -> Self {
        let inner = Some(inner);
        Counting {
            inner,
            ..Counting::default()
        }
    }

    fn inner(&mut self) -> &mut ConnectionManager {
        self.inner.as_mut().expect("a connection")
    }

    /// A request goes out: it starts a round trip unless others are out.
    fn start(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.in_flight.fetch_add(1, Relaxed) == 0 {
            self.waves.fetch_add(1, Relaxed);
        }
        self.in_flight.clone()
    }

    /// The round trips, one after another, that `op` makes.
    async fn trips_of(&self, op: impl AsyncFnOnce()) -> usize {
        let before = self.waves.load(std::sync::atomic::Ordering::Relaxed);
        op().await;
        self.waves.load(std::sync::atomic::Ordering::Relaxed) - before
    }
}

impl redis::aio::ConnectionLike for Counting {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        let out = self.start();
        let reply = self.inner().req_packed_command(cmd);
        Box::pin(async move {
            let reply = reply.await;
            out.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            reply
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        let out = self.start();
        let replies = self.inner().req_packed_commands(pipeline, offset, count);
        Box::pin(async move {
            let replies = replies.await;
            out.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            replies
        })
    }

    fn get_db(&self) -> i64 {
        self.inner.as_ref().map_or(0, |inner| inner.get_db())
    }
}

/// The other half of the rule: no hot path makes a round trip per message.
/// Each operation makes as many round trips for 999 messages as for 10
/// (one batch: a script takes up to `MAX_BATCH`, 1,000): pushes, claims,
/// acknowledgements, recoveries, re-drives, a page of dead letters, and
/// the activity of an hour as of a minute.
#[tokio::test]
async fn hot_paths_make_as_many_round_trips_for_a_large_batch_as_for_a_small_one() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, _) = server().await;
    let conn = Counting::new(patient(&server).await);
    let q: Queue<u64, Counting> = Queue::new(conn.clone(), "batches")
        .unwrap()
        .record_events(100_000)
        .unwrap();
    let mut counts = Vec::new();
    // The queue's first recovery of every 5 minutes visits every keyed
    // partition; the rounds below take the ones after it.
    q.recover(1).await.unwrap();
    // The first round loads the scripts (a round trip more for each).
    for n in [10u64, 10, 999] {
        let push = conn
            .trips_of(async || drop(q.push_many(0..n).await.unwrap()))
            .await;
        let mut jobs = Vec::new();
        let claim = conn
            .trips_of(async || jobs = q.claim(n as usize, ms(50)).await.unwrap().jobs)
            .await;
        assert_eq!(jobs.len() as u64, n);
        tokio::time::sleep(ms(100)).await;
        let recover = conn
            .trips_of(async || assert_eq!(q.recover(1).await.unwrap().buried, n as usize))
            .await;
        let page = conn
            .trips_of(async || drop(q.dead_letters(None, n as usize).await.unwrap()))
            .await;
        let redrive = conn
            .trips_of(async || assert_eq!(q.requeue_all_dead().await.unwrap(), n as usize))
            .await;
        let jobs = q.claim(n as usize, secs(60)).await.unwrap().jobs;
        let ack = conn
            .trips_of(async || drop(q.ack_many(&jobs).await.unwrap()))
            .await;
        let window = secs(if n == 10 { 60 } else { 3600 });
        let activity = conn
            .trips_of(async || drop(q.activity(window, 60).await.unwrap()))
            .await;
        counts.push([push, claim, recover, page, redrive, ack, activity]);
    }
    eprintln!("round trips (push, claim, recover, dead page, re-drive, ack, activity): {counts:?}");
    assert_eq!(
        counts[1], counts[2],
        "round trips for batches of 10 and of 1,000"
    );
}

/// Issue 35, item 7: a claim over many keyed partitions asks them all at
/// once, each for its share of the batch (then those that filled their
/// share, for the room left), not one after another: a claim of 64 keyed
/// messages over 64 keys in partitions of their own takes a few round
/// trips, where it took one or two per partition it visited, and on one
/// server one claim call over the partitions, where it took one or two
/// per partition.
#[tokio::test]
async fn a_keyed_claim_over_many_partitions_asks_them_at_once() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, mut plain) = server().await;
    let conn = Counting::new(patient(&server).await);
    // The scripts loaded first, by a claim of another queue.
    let warm: Queue<u64, Counting> = Queue::new(conn.clone(), "warm-up").unwrap();
    let warming = PushOptions::new().key("warm-up");
    warm.push_many_with([(0, warming)]).await.unwrap();
    assert_eq!(warm.claim(1, secs(60)).await.unwrap().jobs.len(), 1);
    let keyed: Queue<u64, Counting> = Queue::new(conn.clone(), "keyed-claims").unwrap();
    let messages = (0..64u64).map(|i| (i, PushOptions::new().key(format!("account-{i}"))));
    keyed.push_many_with(messages).await.unwrap();
    let scripts = async |conn: &mut MultiplexedConnection| {
        let calls = lockgate::testing::command_calls(conn).await.unwrap();
        ["evalsha", "fcall"]
            .iter()
            .filter_map(|c| calls.get(*c))
            .sum::<u64>()
    };
    let before = scripts(&mut plain).await;
    let mut jobs = Vec::new();
    let trips = conn
        .trips_of(async || jobs = keyed.claim(64, secs(60)).await.unwrap().jobs)
        .await;
    let calls = scripts(&mut plain).await - before;
    eprintln!(
        "a keyed claim of {}: {trips} round trips, {calls} script calls",
        jobs.len()
    );
    assert!(jobs.len() >= 32, "{} claimed", jobs.len());
    assert!(
        trips <= 8,
        "{trips} round trips for a claim of {} over as many partitions",
        jobs.len()
    );
    // On one server one claim call takes the heads of all the partitions
    // it visits (where it took one or two calls per partition), beside
    // the queue's own claim and the index's settlement.
    assert!(
        calls <= 4,
        "{calls} script calls for a claim of {} over as many partitions",
        jobs.len()
    );
}

/// The same rule where a batch spreads: messages over as many keys as
/// messages (a partition each, nearly), and over the shards of a sharded
/// queue. Pushes and acknowledgements of 999 keyed messages go out 64
/// calls at a time (a thousand at once passed a 500 ms response timeout on
/// a loaded machine): a round trip per 64 partitions, not one per
/// partition. A claim of 999 messages spread over 16 shards makes about as
/// many round trips as for 10.
#[tokio::test]
async fn batches_over_many_keys_or_shards_go_out_together_64_calls_at_a_time() {
    let _one = ONE_AT_A_TIME.lock().await;
    let (server, _) = server().await;
    let conn = Counting::new(patient(&server).await);
    let keyed: Queue<u64, Counting> = Queue::new(conn.clone(), "keyed-batches").unwrap();
    let sharded = Queue::<u64, Counting>::new(conn.clone(), "sharded-batches").unwrap();
    let sharded = sharded.shards(16).unwrap();
    let mut counts = Vec::new();
    for n in [10u64, 10, 999] {
        let messages = (0..n).map(|i| (i, PushOptions::new().key(format!("account-{i}"))));
        let push = conn
            .trips_of(async || drop(keyed.push_many_with(messages).await.unwrap()))
            .await;
        let mut jobs = Vec::new();
        while (jobs.len() as u64) < n {
            jobs.extend(keyed.claim(1000, secs(60)).await.unwrap().jobs);
        }
        let ack = conn
            .trips_of(async || assert!(keyed.ack_many(&jobs).await.unwrap().iter().all(|a| *a)))
            .await;
        // Ids of its own (the generated ones are random): the same spread
        // over the shards on every run.
        let ids = (0..n).map(|i| (i, PushOptions::new().id(format!("m{i}"))));
        sharded.push_many_with(ids).await.unwrap();
        let mut jobs = Vec::new();
        let claim = conn
            .trips_of(async || jobs = sharded.claim(n as usize, secs(60)).await.unwrap().jobs)
            .await;
        assert_eq!(jobs.len() as u64, n, "a claim of all that is due");
        let sharded_ack = conn
            .trips_of(async || assert!(sharded.ack_many(&jobs).await.unwrap().iter().all(|a| *a)))
            .await;
        counts.push([push, ack, claim, sharded_ack]);
    }
    eprintln!("round trips (keyed push, keyed ack, sharded claim, sharded ack): {counts:?}");
    let [ten, many] = [counts[1], counts[2]].map(|[push, ack, claim, acks]| {
        // A sharded claim asks the shard in turn first, then the others
        // at once, then those that had more than their share (how many
        // rounds depends on how the ids fell, and on which replies come
        // first): a few, not one or two per shard (16 to 32 before).
        assert!(
            claim <= 12,
            "{claim} round trips for a sharded claim: {counts:?}"
        );
        [push, ack, acks]
    });
    // 999 keys in about 970 partitions: on one server one push call for
    // all of them, as for 10 keys; acknowledgements in 16 groups of 64
    // calls, where 10 keys take one.
    assert_eq!(many[0], ten[0], "a keyed push as for 10 keys: {counts:?}");
    let groups = 999usize.div_ceil(64);
    assert!(
        many[1] < ten[1] + groups,
        "round trips for 10 and for 999 messages: {counts:?}"
    );
    assert_eq!(many[2], ten[2], "a sharded ack as for 10: {counts:?}");
}
