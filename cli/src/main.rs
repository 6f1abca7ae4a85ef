//! `lockgate`: inspect and operate lockgate queues and locks from a shell.
//!
//! Every command prints a human table, or one JSON document with `--json`
//! (field names are stable). Errors are one line on stderr and a non-zero
//! exit: 3 when the queue, message or lock asked for does not exist, 1 for
//! any other failure, 2 for a malformed command line.

mod bench;
mod dashboard;
mod ops;

use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::{Parser, Subcommand};
use lockgate::queue::{DeadCursor, DeadLetter, KeyLoad, KeyStats, Stats};
use lockgate::{BoxError, Locker};
use redis::aio::{ConnectionLike, ConnectionManager};
use serde::Serialize;
use serde_json::{Value, json};

use ops::{NewMessage, Ops};

/// Inspect and operate lockgate queues and locks.
#[derive(Parser)]
#[command(name = "lockgate", version, about)]
struct Cli {
    /// The Redis server (`redis://` or `rediss://`); for a Redis Cluster,
    /// its seed nodes, comma-separated or repeated.
    #[arg(
        long,
        env = "REDIS_URL",
        default_value = "redis://127.0.0.1:6379/",
        value_delimiter = ',',
        global = true
    )]
    url: Vec<String>,
    /// The servers are a Redis Cluster (implied by more than one URL).
    #[arg(long, global = true)]
    cluster: bool,
    /// The key prefix the queues and locks live under.
    #[arg(long, default_value = "lockgate", global = true, value_parser = non_empty)]
    prefix: String,
    /// Print one JSON document instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every queue under the prefix (from its list of queues), with its counts.
    Queues,
    /// A queue's counts: due, later, active, dead, oldest due age.
    Stats {
        #[arg(value_parser = non_empty)]
        queue: String,
        /// Refresh in place every INTERVAL (default 1s) until Ctrl-C.
        #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "1s", value_parser = positive_duration)]
        watch: Option<Duration>,
        /// Also each shard's counts of messages without a key (a queue over
        /// shards, `Queue::shards`).
        #[arg(long)]
        shards: bool,
    },
    /// Dead letters, oldest first, with their errors and payloads.
    Dead {
        #[arg(value_parser = non_empty)]
        queue: String,
        /// At most this many (1 to 1000).
        #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=1000))]
        limit: u16,
        /// Start after this cursor, `<buried ms>-<id>`: the `next` of the
        /// page before (the first page without it).
        #[arg(long)]
        after: Option<DeadCursor>,
    },
    /// Re-drives dead letters: due now, with their counts reset.
    Requeue {
        #[arg(value_parser = non_empty)]
        queue: String,
        /// The dead letter's id.
        #[arg(required_unless_present = "all", conflicts_with = "all", value_parser = non_empty)]
        id: Option<String>,
        /// Every dead letter of the queue.
        #[arg(long)]
        all: bool,
    },
    /// Deletes a scheduled or dead message.
    Remove {
        #[arg(value_parser = non_empty)]
        queue: String,
        #[arg(value_parser = non_empty)]
        id: String,
    },
    /// Deletes every message of a queue (asks first, unless `--yes`).
    Purge {
        #[arg(value_parser = non_empty)]
        queue: String,
        #[arg(long)]
        yes: bool,
    },
    /// Pushes a JSON message.
    Push {
        #[arg(value_parser = non_empty)]
        queue: String,
        /// The message, as JSON.
        #[arg(value_name = "JSON")]
        message: String,
        /// Due after this long (`5s`, `2m`, `1h 30m`).
        #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "at")]
        delay: Option<Duration>,
        /// Due at this time (RFC 3339, `2026-11-23T18:00:00Z`).
        #[arg(long, value_parser = humantime::parse_rfc3339_weak)]
        at: Option<SystemTime>,
        /// The message's id (a second push with the same id changes nothing).
        #[arg(long, value_parser = non_empty)]
        id: Option<String>,
    },
    /// Held locks with their remaining TTL and fence.
    Locks {
        /// Only keys matching this glob (`order:*`).
        #[arg(long = "match", default_value = "*", value_parser = non_empty)]
        pattern: String,
    },
    /// One lock: its holder, remaining TTL and fence, or the last fence.
    Lock {
        #[arg(value_parser = non_empty)]
        key: String,
    },
    /// Deletes a lock whoever holds it: an operator's emergency.
    Unlock {
        #[arg(value_parser = non_empty)]
        key: String,
        /// Required: the holder keeps running without the lock, and another
        /// caller may take the key meanwhile.
        #[arg(long, required = true)]
        force: bool,
    },
    /// The holders of a key's permits: leases left, fences.
    Permits {
        #[arg(value_parser = non_empty)]
        key: String,
    },
    /// lockgate's function libraries on the server, this version's and
    /// older ones an upgrade left behind.
    Functions {
        /// Delete the other versions' libraries (on a cluster, from every
        /// primary). A process of another version still running loads its
        /// own again when it next calls it.
        #[arg(long)]
        delete_stale: bool,
    },
    /// Runs BENCHMARKS.md's workloads against this Redis, each beside its
    /// same-run comparator, under a throwaway prefix that is deleted
    /// afterwards (also on Ctrl-C).
    Bench {
        /// How long each timed workload runs.
        #[arg(long, default_value = "3s", value_parser = positive_duration)]
        duration: Duration,
        /// Messages through the worker (and, up to 10,000, delayed ones).
        #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
        messages: u64,
        /// Run even when the server's maxmemory-policy may evict keys.
        #[arg(long)]
        allow_eviction: bool,
    },
    /// Serves a web dashboard: queues, dead letters, locks, live rates.
    Dashboard {
        /// Where to listen. Loopback by default; any other address needs
        /// `--token`, and every address (0.0.0.0, ::) `--allowed-host` too.
        #[arg(long, default_value = "127.0.0.1:7070")]
        bind: std::net::SocketAddr,
        /// A secret the browser must present (once, at `/login?token=…`)
        /// before it sees anything or changes anything.
        #[arg(long, env = "LOCKGATE_DASHBOARD_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// A name browsers reach the dashboard by (a DNS name, a reverse
        /// proxy's), besides localhost, 127.0.0.1 and [::1] on its port and
        /// its own address: requests sent to any other name are refused.
        /// NAME takes any port, NAME:PORT that port. Repeatable; the
        /// variable takes them comma-separated.
        #[arg(
            long = "allowed-host",
            value_name = "NAME",
            env = "LOCKGATE_DASHBOARD_ALLOWED_HOSTS",
            value_delimiter = ',',
            value_parser = allowed_host
        )]
        allowed_hosts: Vec<dashboard::Authority>,
    },
}

/// Prints to stdout like `println!`, but a closed pipe (`lockgate … |
/// head`) ends the command quietly, as it ends `ls`, instead of panicking.
macro_rules! say {
    ($($arg:tt)*) => { crate::emit(format_args!("{}\n", format_args!($($arg)*))) };
}
/// `print!` as [`say!`] does `println!`.
macro_rules! say_inline {
    ($($arg:tt)*) => { crate::emit(format_args!($($arg)*)) };
}
pub(crate) use say;
pub(crate) use say_inline;

/// Writes to stdout and flushes (so that `--watch` notices a closed pipe at
/// once). A reader that went away ends the process with success: it chose
/// to stop reading. Any other write error ends it with a message.
fn emit(text: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    if let Err(error) = out.write_fmt(text).and_then(|()| out.flush()) {
        if error.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        let _ = writeln!(std::io::stderr(), "lockgate: writing to stdout: {error}");
        std::process::exit(1);
    }
}

/// A name that is not empty (nor only white space): queues, keys, ids,
/// prefixes, globs.
fn non_empty(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("must not be empty".into());
    }
    Ok(text.to_owned())
}

/// A name for `--allowed-host`: `NAME` or `NAME:PORT`, no scheme or path.
fn allowed_host(text: &str) -> Result<dashboard::Authority, String> {
    text.trim().parse()
}

/// Why `lockgate dashboard` may not listen on `bind` as asked, as its usage
/// error says it; `None` when it may. Beyond loopback anyone on the network
/// reaches it: it needs its token. On every address (0.0.0.0, ::) it
/// cannot tell which names are its own (its addresses can change, and a
/// rebound name reaches it on any of them): it needs them spelled out.
fn dashboard_lacks(bind: std::net::SocketAddr, token: bool, names: bool) -> Option<String> {
    let mut lacks = Vec::new();
    if !bind.ip().is_loopback() && !token {
        lacks.push(format!(
            "the dashboard listens on {bind}, beyond this machine: give it --token (or LOCKGATE_DASHBOARD_TOKEN)"
        ));
    }
    if bind.ip().is_unspecified() && !names {
        lacks.push(format!(
            "the dashboard listens on every address of this machine ({bind}): give it --allowed-host NAME for each name browsers reach it by (or LOCKGATE_DASHBOARD_ALLOWED_HOSTS=NAME,NAME); requests sent to other names are refused"
        ));
    }
    (!lacks.is_empty()).then(|| lacks.join("\n"))
}

/// A duration above zero (`500ms`, `2s`).
fn positive_duration(text: &str) -> Result<Duration, String> {
    match humantime::parse_duration(text) {
        Ok(d) if d.is_zero() => Err("must be above zero".into()),
        Ok(d) => Ok(d),
        Err(e) => Err(e.to_string()),
    }
}

/// A failure, with its exit code.
enum Failure {
    /// What was asked for does not exist (exit 3).
    NotFound(String),
    /// Anything else (exit 1).
    Failed(BoxError),
    /// Ctrl-C (exit 130).
    Interrupted,
}

impl<E: Into<BoxError>> From<E> for Failure {
    fn from(error: E) -> Self {
        Failure::Failed(error.into())
    }
}

fn not_found(what: impl Into<String>) -> Failure {
    Failure::NotFound(what.into())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Dashboard {
        bind,
        token,
        allowed_hosts,
    } = &cli.command
        // An empty token is none: the dashboard would run without one.
        && let Some(lacks) = dashboard_lacks(
            *bind,
            token.as_ref().is_some_and(|t| !t.is_empty()),
            !allowed_hosts.is_empty(),
        )
    {
        use clap::CommandFactory;
        Cli::command()
            .error(clap::error::ErrorKind::MissingRequiredArgument, lacks)
            .exit();
    }
    // rediss:// runs on rustls, with ring's cryptography. (Fails only if a
    // provider is installed already: then that one serves.)
    let _ = rustls::crypto::ring::default_provider().install_default();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::NotFound(what)) => {
            eprintln!("lockgate: {what}");
            ExitCode::from(3)
        }
        Err(Failure::Failed(error)) => {
            eprintln!("lockgate: {}", one_line(&*error));
            ExitCode::FAILURE
        }
        Err(Failure::Interrupted) => ExitCode::from(130),
    }
}

/// An error and its causes, on one line.
fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line.push_str(": ");
            line.push_str(&cause);
        }
        source = cause_of(source);
    }
    line.replace('\n', " ")
}

fn cause_of<'a>(
    error: Option<&'a (dyn std::error::Error + 'static)>,
) -> Option<&'a (dyn std::error::Error + 'static)> {
    error.and_then(|e| e.source())
}

async fn connect(url: &str) -> Result<ConnectionManager, Failure> {
    let client = redis::Client::open(url)?;
    let config = redis::aio::ConnectionManagerConfig::new()
        .set_number_of_retries(1)
        .set_connection_timeout(Some(Duration::from_secs(5)));
    client
        .get_connection_manager_with_config(config)
        .await
        .map_err(|e| Failure::Failed(format!("cannot connect to {url}: {e}").into()))
}

/// Connects to the cluster whose seed nodes are `urls`.
async fn connect_cluster(
    urls: &[String],
) -> Result<redis::cluster_async::ClusterConnection, Failure> {
    let client = redis::cluster::ClusterClient::builder(urls.iter().cloned())
        .connection_timeout(Duration::from_secs(5))
        .build()?;
    client.get_async_connection().await.map_err(|e| {
        Failure::Failed(format!("cannot connect to the cluster at {urls:?}: {e}").into())
    })
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if cli.cluster || cli.url.len() > 1 {
        let conn = connect_cluster(&cli.url).await?;
        let nodes = masters(&cli.url[0], &mut conn.clone()).await?;
        if let Command::Bench {
            messages,
            allow_eviction,
            duration,
        } = cli.command
        {
            let size = bench_size(duration, messages);
            return run_cluster_bench(&cli, conn, &nodes, size, allow_eviction).await;
        }
        return commands(cli, conn, nodes).await;
    }
    let url = cli
        .url
        .first()
        .map_or("redis://127.0.0.1:6379/", String::as_str);
    let conn = connect(url).await?;
    if let Command::Bench {
        duration,
        messages,
        allow_eviction,
    } = cli.command
    {
        let size = bench_size(duration, messages);
        return run_bench(&cli, url, conn, size, allow_eviction).await;
    }
    commands(cli, conn, Vec::new()).await
}

fn bench_size(duration: Duration, messages: u64) -> bench::Size {
    // At most 100,000,000: fits any usize this builds for.
    let messages = usize::try_from(messages).unwrap_or(usize::MAX);
    bench::Size { duration, messages }
}

/// The URLs of a cluster's masters (from `CLUSTER NODES`), with the seed
/// URL's scheme and credentials: `SCAN` walks one node's keys, so the
/// listings of locks and permits ask each master.
async fn masters(
    seed: &str,
    conn: &mut redis::cluster_async::ClusterConnection,
) -> Result<Vec<String>, Failure> {
    let nodes: String = redis::cmd("CLUSTER").arg("NODES").query_async(conn).await?;
    let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
    let credentials = rest.split_once('@').map_or("", |(c, _)| c);
    let at = if credentials.is_empty() { "" } else { "@" };
    Ok(nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let address = fields.nth(1)?.split(['@', ',']).next()?;
            let flags = fields.next()?;
            let live_master =
                flags.split(',').any(|f| f == "master") && !flags.split(',').any(|f| f == "fail");
            live_master.then(|| format!("{scheme}://{credentials}{at}{address}/"))
        })
        .collect())
}

/// A connection to each of `nodes`.
async fn node_connections(nodes: &[String]) -> Result<Vec<ConnectionManager>, Failure> {
    let mut conns = Vec::with_capacity(nodes.len());
    for node in nodes {
        conns.push(connect(node).await?);
    }
    Ok(conns)
}

/// Every command but `bench`, on a server's or a cluster's connection (then
/// `nodes` are its masters' URLs, for the listings).
async fn commands<C>(cli: Cli, conn: C, nodes: Vec<String>) -> Result<(), Failure>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let ops = Ops {
        conn,
        nodes,
        prefix: cli.prefix,
        out: Output { json: cli.json },
    };
    match cli.command {
        Command::Queues => ops.queues().await,
        Command::Stats {
            queue,
            watch,
            shards,
        } => ops.stats(&queue, watch, shards).await,
        Command::Dead {
            queue,
            limit,
            after,
        } => {
            let page = ops
                .existing(&queue)
                .await?
                .dead_letters(after.as_ref(), usize::from(limit))
                .await?;
            ops.out.dead(&page.letters, page.next.as_ref());
            Ok(())
        }
        Command::Requeue { queue, id, all } => ops.requeue(&queue, id, all).await,
        Command::Remove { queue, id } => ops.remove(&queue, &id).await,
        Command::Purge { queue, yes } => ops.purge(&queue, yes).await,
        Command::Push {
            queue,
            message,
            delay,
            at,
            id,
        } => {
            let message = NewMessage {
                json: message,
                delay,
                at,
                id,
            };
            ops.push(&queue, message).await
        }
        Command::Locks { pattern } => ops.locks(&pattern).await,
        Command::Lock { key } => ops.lock(key).await,
        Command::Unlock { key, force: _ } => ops.unlock(key).await,
        Command::Permits { key } => {
            let holders = ops.locker()?.permit_holders(&key).await?;
            ops.out.permits(&key, &holders);
            Ok(())
        }
        Command::Functions { delete_stale } => ops.functions(delete_stale).await,
        Command::Bench { .. } => unreachable!("run by run_bench or run_cluster_bench"),
        Command::Dashboard {
            bind,
            token,
            allowed_hosts,
        } => ops.dashboard(bind, token, allowed_hosts).await,
    }
}

/// `lockgate bench` on one server.
async fn run_bench(
    cli: &Cli,
    url: &str,
    conn: ConnectionManager,
    size: bench::Size,
    allow_eviction: bool,
) -> Result<(), Failure> {
    refuse_eviction(&conn, allow_eviction).await?;
    let client = redis::Client::open(url)?;
    let servers = [conn.clone()];
    let run = |prefix: String, progress: indicatif::ProgressBar| async move {
        bench::run(&client, &conn, &prefix, size, &progress).await
    };
    bench_under_prefix(cli, &servers, run).await
}

/// `lockgate bench --cluster`: one queue in one slot, then across the
/// masters (`nodes`, their URLs).
async fn run_cluster_bench(
    cli: &Cli,
    conn: redis::cluster_async::ClusterConnection,
    nodes: &[String],
    size: bench::Size,
    allow_eviction: bool,
) -> Result<(), Failure> {
    let masters = node_connections(nodes).await?;
    for master in &masters {
        refuse_eviction(master, allow_eviction).await?;
    }
    let client = redis::cluster::ClusterClient::builder(cli.url.iter().cloned()).build()?;
    let run = |prefix: String, progress: indicatif::ProgressBar| {
        let masters = masters.clone();
        async move { bench::run_cluster(&client, &conn, &masters, &prefix, size, &progress).await }
    };
    bench_under_prefix(cli, &masters, run).await
}

/// Refuses to run a benchmark on a server that may evict its keys, unless
/// `allow` says to.
async fn refuse_eviction(conn: &ConnectionManager, allow: bool) -> Result<(), Failure> {
    let policy = Locker::new(conn.clone()).check_eviction().await?;
    if policy.may_evict_locks() && !allow {
        return Err(format!(
            "the server's maxmemory-policy is {}: it may evict the benchmark's keys (and any lock); pass --allow-eviction to run anyway",
            policy.name()
        )
        .into());
    }
    Ok(())
}

/// Runs `run` under a throwaway prefix, deletes the keys under it on every
/// server of `servers` afterwards (also on Ctrl-C), and prints the rows.
async fn bench_under_prefix<F, Fut>(
    cli: &Cli,
    servers: &[ConnectionManager],
    run: F,
) -> Result<(), Failure>
where
    F: FnOnce(String, indicatif::ProgressBar) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<bench::Row>, lockgate::BoxError>>,
{
    let nonce = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
        ^ u128::from(std::process::id());
    let prefix = format!("{}-bench-{:x}", cli.prefix, nonce & 0xffff_ffff_ffff);
    let progress = if cli.json || !std::io::stdout().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(0)
    };
    let outcome = tokio::select! {
        rows = run(prefix.clone(), progress.clone()) => Some(rows),
        _ = tokio::signal::ctrl_c() => None,
    };
    progress.finish_and_clear();
    let mut cleaned = Ok(0);
    for server in servers {
        let deleted = lockgate::delete_prefix(server, &prefix).await;
        cleaned = cleaned.and_then(|n| deleted.map(|m| n + m));
    }
    let Some(rows) = outcome else {
        match cleaned {
            Ok(_) => {
                eprintln!("lockgate: interrupted; the benchmark's keys under {prefix}: are deleted")
            }
            Err(error) => eprintln!(
                "lockgate: interrupted, and could not delete the benchmark's keys under {prefix}: ({error})"
            ),
        }
        return Err(Failure::Interrupted);
    };
    let rows = rows?;
    cleaned?;
    if cli.json {
        Output { json: true }.print(&json!({ "prefix": prefix, "results": rows }));
        return Ok(());
    }
    say!("| workload | lockgate | same-run comparator | ratio |");
    say!("|---|---|---|---|");
    for row in rows {
        let ratio = row
            .ratio
            .map_or("—".into(), |r| format!("{:.1} %", 100.0 * r));
        say!(
            "| {} | {} | {} | {ratio} |",
            row.workload,
            row.lockgate,
            row.comparator
        );
    }
    say!("(keys under {prefix}: deleted)");
    Ok(())
}

/// Asks on the terminal; refuses (false) when stdin is not one.
fn confirm(question: &str) -> Result<bool, Failure> {
    if !std::io::stdin().is_terminal() {
        return Ok(false);
    }
    say_inline!("{question} [y/N] ");
    std::io::stdout().flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// How many busy keys and longest lines `stats` shows.
const TOP_KEYS: usize = 5;

/// A key of a keyed queue, as `stats` shows it.
#[derive(Serialize)]
struct KeyRow<'a> {
    key: &'a str,
    waiting: u64,
    at_work: u64,
    oldest_waiting_ms: Option<u64>,
}

impl<'a> KeyRow<'a> {
    fn new(load: &'a KeyLoad) -> Self {
        Self {
            key: &load.key,
            waiting: load.waiting,
            at_work: load.at_work,
            oldest_waiting_ms: millis(load.oldest_waiting),
        }
    }

    /// `key: 1 at work, 20 in line, the first waiting 350 ms`.
    fn line(&self) -> String {
        let oldest = self
            .oldest_waiting_ms
            .map_or(String::new(), |ms| format!(", the first waiting {ms} ms"));
        format!(
            "{}: {} at work, {} in line{oldest}",
            self.key, self.at_work, self.waiting
        )
    }
}

fn millis(duration: Option<Duration>) -> Option<u64> {
    duration.map(|d| d.as_millis() as u64)
}

/// Prints tables, or JSON documents.
struct Output {
    json: bool,
}

#[derive(Serialize)]
struct QueueRow<'a> {
    queue: &'a str,
    due: u64,
    later: u64,
    active: u64,
    dead: u64,
    oldest_due_age_ms: Option<u64>,
    next_due_in_ms: Option<u64>,
}

impl<'a> QueueRow<'a> {
    fn new(queue: &'a str, stats: &Stats) -> Self {
        Self {
            queue,
            due: stats.due,
            later: stats.later,
            active: stats.active,
            dead: stats.dead,
            oldest_due_age_ms: millis(stats.oldest_due_age),
            next_due_in_ms: millis(stats.next_due_in),
        }
    }
}

impl Output {
    fn print(&self, document: &impl Serialize) {
        // Serializing plain data into a string cannot fail.
        say!(
            "{}",
            serde_json::to_string_pretty(document).unwrap_or_default()
        );
    }

    /// A command's result: `document` as JSON, else `line`.
    fn done(&self, document: Value, line: &str) {
        if self.json {
            self.print(&document);
        } else {
            say!("{line}");
        }
    }

    fn queues(&self, rows: &[(String, Stats)]) {
        let rows: Vec<QueueRow> = rows.iter().map(|(q, s)| QueueRow::new(q, s)).collect();
        if self.json {
            return self.print(&json!({ "queues": rows }));
        }
        if rows.is_empty() {
            return say!("no queues");
        }
        say!(
            "{:<24} {:>8} {:>8} {:>8} {:>8}  oldest due",
            "queue",
            "due",
            "later",
            "active",
            "dead"
        );
        for r in rows {
            say!(
                "{:<24} {:>8} {:>8} {:>8} {:>8}  {}",
                r.queue,
                r.due,
                r.later,
                r.active,
                r.dead,
                r.oldest_due_age_ms
                    .map_or("-".into(), |ms| format!("{ms} ms"))
            );
        }
    }

    /// Per-second rates of the events seen since the last refresh.
    fn rates(&self, recorded: bool, counts: &BTreeMap<&'static str, u64>, secs: f64) {
        // The JSON output stays one document per refresh: the stats.
        if self.json {
            return;
        }
        let rates: BTreeMap<&str, f64> =
            counts.iter().map(|(k, n)| (*k, *n as f64 / secs)).collect();
        if !recorded {
            return say!("  rates   (no lifecycle events recorded: Queue::record_events)");
        }
        let line: Vec<String> = ["pushed", "claimed", "done", "retried", "deferred", "dead"]
            .iter()
            .map(|kind| format!("{kind} {:.0}/s", rates.get(kind).copied().unwrap_or(0.0)))
            .collect();
        say!("  rates   {}", line.join("  "));
    }

    /// A queue's counts, its busiest keys and, when asked for, each
    /// shard's counts (`shards`, else empty).
    fn stats(&self, queue: &str, stats: &Stats, keys: &KeyStats, shards: &[Stats]) {
        let row = QueueRow::new(queue, stats);
        let names: Vec<String> = (0..shards.len()).map(|i| format!("shard {i}")).collect();
        let shards: Vec<QueueRow> = (names.iter().zip(shards))
            .map(|(name, stats)| QueueRow::new(name, stats))
            .collect();
        let busy: Vec<KeyRow> = keys.busy.iter().map(KeyRow::new).collect();
        let backlogs: Vec<KeyRow> = keys.backlogs.iter().map(KeyRow::new).collect();
        if self.json {
            let mut document = serde_json::to_value(&row).unwrap_or_default();
            if let Value::Object(fields) = &mut document {
                fields.insert("keys".into(), json!(keys.keys));
                fields.insert("busy_keys".into(), json!(busy));
                fields.insert("longest_lines".into(), json!(backlogs));
                if !shards.is_empty() {
                    fields.insert("shards".into(), json!(shards));
                }
            }
            return self.print(&document);
        }
        say!("{queue}");
        say!("  due     {}", row.due);
        say!("  later   {}", row.later);
        say!("  active  {}", row.active);
        say!("  dead    {}", row.dead);
        if let Some(ms) = row.oldest_due_age_ms {
            say!("  oldest due message waiting for {ms} ms");
        }
        if let Some(ms) = row.next_due_in_ms {
            say!("  next message due in {ms} ms");
        }
        if keys.keys > 0 {
            say!("  keys    {} with messages in line or at work", keys.keys);
        }
        for (title, rows) in [("busy keys", &busy), ("longest lines", &backlogs)] {
            if !rows.is_empty() {
                say!("  {title}");
                for key in rows {
                    say!("    {}", key.line());
                }
            }
        }
        if !shards.is_empty() {
            say!("  shard   due  later  active  dead");
        }
        for (i, row) in shards.iter().enumerate() {
            say!(
                "  {i:<5} {:>5} {:>6} {:>7} {:>5}",
                row.due,
                row.later,
                row.active,
                row.dead
            );
        }
    }

    fn dead(&self, dead: &[DeadLetter], next: Option<&DeadCursor>) {
        if self.json {
            let letters: Vec<Value> = dead
                .iter()
                .map(|d| {
                    let payload =
                        serde_json::from_slice::<Value>(&d.payload).unwrap_or_else(|_| {
                            Value::String(String::from_utf8_lossy(&d.payload).into_owned())
                        });
                    json!({
                        "id": d.id,
                        "key": d.key,
                        "buried_at_ms": unix_ms(d.buried_at),
                        "error": d.error,
                        "failures": d.failures,
                        "deferrals": d.deferrals,
                        "stalls": d.stalls,
                        "payload": payload,
                    })
                })
                .collect();
            let next = next.map(DeadCursor::to_string);
            return self.print(&json!({ "dead": letters, "next": next }));
        }
        if dead.is_empty() {
            return say!("no dead letters");
        }
        for d in dead {
            let key = d.key.as_ref().map(|k| format!("  key {k}"));
            say!(
                "{}{}  failures {}  deferrals {}  stalls {}  error: {}\n    {}",
                d.id,
                key.unwrap_or_default(),
                d.failures,
                d.deferrals,
                d.stalls,
                d.error.as_deref().unwrap_or("-"),
                String::from_utf8_lossy(&d.payload)
            );
        }
        if let Some(next) = next {
            say!("more: --after {next}");
        }
    }

    fn functions(&self, libraries: &[lockgate::Library], deleted: Option<&[String]>) {
        if self.json {
            let listed: Vec<Value> = (libraries.iter())
                .map(|l| json!({"name": l.name, "current": l.current}))
                .collect();
            return match deleted {
                Some(deleted) => self.print(&json!({"libraries": listed, "deleted": deleted})),
                None => self.print(&json!({ "libraries": listed })),
            };
        }
        for library in libraries {
            let which = if library.current {
                "this version"
            } else {
                "stale"
            };
            say!("{:<64} {which}", library.name);
        }
        match deleted {
            Some([]) => say!("no stale libraries"),
            Some(deleted) => say!("deleted {} stale libraries", deleted.len()),
            None if libraries.is_empty() => say!("no lockgate libraries loaded"),
            None => {}
        }
    }

    fn locks(&self, held: &[(String, lockgate::lock::Holder)]) {
        if self.json {
            let locks: Vec<Value> = held
                .iter()
                .map(|(key, h)| {
                    json!({
                        "key": key,
                        "held": true,
                        "token": h.token,
                        "fence": h.fence,
                        "remaining_ms": millis(h.remaining),
                    })
                })
                .collect();
            return self.print(&json!({ "locks": locks }));
        }
        if held.is_empty() {
            return say!("no locks held");
        }
        for (key, h) in held {
            let fence = h.fence.map_or("none issued yet".into(), |f| f.to_string());
            match h.remaining {
                Some(ttl) => say!("{key}: held, expires in {ttl:?}, fence {fence}"),
                None => say!("{key}: held without expiry (not set by lockgate), fence {fence}"),
            }
        }
    }

    fn permits(&self, key: &str, holders: &[lockgate::lock::permits::PermitHolder]) {
        if self.json {
            let holders: Vec<Value> = holders
                .iter()
                .map(|h| {
                    json!({
                        "token": h.token,
                        "fence": h.fence,
                        "remaining_ms": h.remaining.as_millis() as u64,
                    })
                })
                .collect();
            return self.print(&json!({ "key": key, "holders": holders }));
        }
        say!("{key}: {} permit(s) in use", holders.len());
        for h in holders {
            let fence = h.fence.map_or("none issued".into(), |f| f.to_string());
            say!("  {}  expires in {:?}, fence {fence}", h.token, h.remaining);
        }
    }
}
