//! A primary and its replica, for failover tests.

use std::time::{Duration, Instant};

use super::{RedisServer, ServerBuilder, StartError};

/// How long a fresh replica may take to finish its first sync.
const SYNC_TIMEOUT: Duration = Duration::from_secs(20);

/// A private primary `redis-server` with one replica (`--replicaof`), both
/// [`RedisServer`]s on loopback ports, killed when the pair is dropped (also
/// while frozen by [`pause_replica`](Self::pause_replica)).
///
/// The steps of a failover that loses writes, as Redis Sentinel or a
/// managed service would run it after the primary died:
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use lockgate_testing::ReplicaPair;
///
/// let mut pair = ReplicaPair::start()?; // waits until the replica is in sync
/// // ... writes that reach the replica ...
/// pair.wait_for_sync()?;
/// pair.pause_replica()?; // frozen and cut off: it misses what follows
/// // ... writes on the primary only ...
/// pair.kill_primary();
/// pair.resume_replica()?;
/// pair.promote_replica()?; // REPLICAOF NO ONE: the replica now takes writes
/// let conn = pair.replica().connection_manager().await?;
/// # Ok(()) }
/// ```
///
/// The primary is started with `--repl-diskless-sync-delay 0`, so that the
/// first sync does not wait the default 5 s for more replicas.
#[derive(Debug)]
pub struct ReplicaPair {
    /// The server that takes writes at the start.
    primary: RedisServer,
    /// The server that replicates it (until promoted).
    replica: RedisServer,
}

impl ReplicaPair {
    /// Starts a primary and a replica with lockgate's default arguments and
    /// waits until the replica is in sync.
    pub fn start() -> Result<Self, StartError> {
        Self::start_with(RedisServer::builder())
    }

    /// Starts both servers with the arguments of `builder` (for example
    /// `RedisServer::builder().arg("--maxmemory-policy").arg("noeviction")`),
    /// and waits until the replica is in sync.
    pub fn start_with(builder: ServerBuilder) -> Result<Self, StartError> {
        let primary = builder
            .clone()
            .args(["--repl-diskless-sync-delay", "0"])
            .start()?;
        let replica = builder
            .args(["--replicaof", "127.0.0.1"])
            .arg(primary.port().to_string())
            .start()?;
        let pair = Self { primary, replica };
        pair.wait_for_sync()?;
        Ok(pair)
    }

    /// The primary (the server that took writes at the start).
    pub fn primary(&self) -> &RedisServer {
        &self.primary
    }

    /// The primary, mutably (to [`restart`](RedisServer::restart) it, say).
    pub fn primary_mut(&mut self) -> &mut RedisServer {
        &mut self.primary
    }

    /// The replica (a primary itself once [promoted](Self::promote_replica)).
    pub fn replica(&self) -> &RedisServer {
        &self.replica
    }

    /// The replica, mutably.
    pub fn replica_mut(&mut self) -> &mut RedisServer {
        &mut self.replica
    }

    /// Waits (up to 20 s) until the replica's link to the primary is up and
    /// it has received everything the primary has written so far
    /// (`master_link_status:up` and equal replication offsets).
    pub fn wait_for_sync(&self) -> Result<(), StartError> {
        let deadline = Instant::now() + SYNC_TIMEOUT;
        loop {
            let state = self.sync_state();
            match &state {
                Ok(None) => return Ok(()),
                Ok(Some(_)) | Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Ok(Some(reason)) | Err(reason) => {
                    return Err(StartError::NotReady {
                        port: self.replica.port(),
                        reason: format!(
                            "the replica did not sync within {SYNC_TIMEOUT:?}: {reason}"
                        ),
                        log: std::fs::read_to_string(self.replica.dir.join("redis.log"))
                            .unwrap_or_default(),
                    });
                }
            }
        }
    }

    /// `None` when in sync, else what is still missing.
    fn sync_state(&self) -> Result<Option<String>, String> {
        let info = |server: &RedisServer| {
            server
                .query::<String>(redis::cmd("INFO").arg("replication"))
                .map_err(|e| format!("INFO replication on port {}: {e}", server.port()))
        };
        let (primary, replica) = (info(&self.primary)?, info(&self.replica)?);
        let link = field(&replica, "master_link_status");
        let sent = field(&primary, "master_repl_offset");
        let received = field(&replica, "slave_repl_offset");
        if link == Some("up") && sent.is_some() && sent == received {
            Ok(None)
        } else {
            Ok(Some(format!(
                "link {link:?}, primary offset {sent:?}, replica offset {received:?}"
            )))
        }
    }

    /// Freezes the replica (SIGSTOP) and cuts its link (`CLIENT KILL TYPE
    /// replica` on the primary), so that every write the primary takes from
    /// now on misses it, even after a [`resume`](Self::resume_replica) once the
    /// primary is dead. (Freezing alone is not enough: writes would pile up in
    /// the frozen replica's socket buffer and be read after the resume.)
    /// While it is cut off, `WAIT` on the primary counts no replica.
    pub fn pause_replica(&mut self) -> std::io::Result<()> {
        self.replica.pause()?;
        self.primary
            .query::<i64>(redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("replica"))
            .map_err(std::io::Error::other)?;
        Ok(())
    }

    /// Lets a paused replica run again (SIGCONT). If the primary still runs,
    /// the replica reconnects and catches up (see
    /// [`wait_for_sync`](Self::wait_for_sync)); if it was killed, the replica
    /// keeps what it had before the pause.
    pub fn resume_replica(&mut self) -> std::io::Result<()> {
        self.replica.resume()
    }

    /// Kills the primary (SIGKILL).
    pub fn kill_primary(&mut self) {
        self.primary.stop();
    }

    /// Makes the replica a primary (`REPLICAOF NO ONE`), as a failover does;
    /// it keeps the data it had and takes writes from now on.
    pub fn promote_replica(&mut self) -> redis::RedisResult<()> {
        self.replica
            .query(redis::cmd("REPLICAOF").arg("NO").arg("ONE"))
    }
}

/// The value of `name:value` in an `INFO` reply.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}
