//! Where an example (or a manual try) finds its servers: the ones the
//! environment names, else throwaway ones started for it. Never a server
//! that merely answers on a well-known port: on a developer's machine, the
//! Redis on `127.0.0.1:6379` is theirs, with their data in it.

use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::{BoxError, NatsServer, RedisServer};

/// The server `REDIS_URL` names when it is set (and not empty), else a
/// throwaway [`RedisServer`], returned too so that it lives as long as the
/// caller keeps it (`None` when the server is not the caller's own).
///
/// A Redis that merely answers on `127.0.0.1:6379` is never used.
pub fn redis_url_or_throwaway() -> Result<(redis::Client, Option<RedisServer>), BoxError> {
    if let Some(url) = env("REDIS_URL") {
        return Ok((redis::Client::open(url)?, None));
    }
    let server = RedisServer::start()?;
    Ok((server.client(), Some(server)))
}

/// The server `NATS_URL` names when it is set (and not empty), else a
/// throwaway [`NatsServer`], as [`redis_url_or_throwaway`] does for Redis.
/// A NATS server that merely listens on `127.0.0.1:4222` is never used.
pub fn nats_url_or_throwaway() -> Result<(String, Option<NatsServer>), BoxError> {
    if let Some(url) = env("NATS_URL") {
        return Ok((url, None));
    }
    let server = NatsServer::start()?;
    Ok((server.url(), Some(server)))
}

/// An environment variable that is set and not empty.
fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Redis for an example that runs in one process, and the key prefix its
/// keys go under, so that it never touches keys it did not make.
///
/// On a throwaway server (no `REDIS_URL`) the prefix is lockgate's default,
/// `lockgate`: the server holds nothing else. On the server `REDIS_URL`
/// names (yours) the prefix is made for this run, `<example>-<run id>`, so
/// that nothing of yours is read, changed or deleted, and two runs do not
/// meet; [`clean_up`](Self::clean_up) deletes this run's keys at the end.
/// Nothing else is ever purged or flushed on a server the example did not
/// start.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let redis = lockgate_testing::ExampleRedis::from_env("demo")?;
/// println!("using {redis}");
/// let conn = redis.client().get_connection_manager().await?;
/// // ... Queue::new(conn, "orders")?.prefix(redis.prefix())? ...
/// redis.clean_up().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ExampleRedis {
    /// A client for the server.
    client: redis::Client,
    /// The throwaway server, `None` on the server `REDIS_URL` names.
    server: Option<RedisServer>,
    /// The prefix of every key the example makes.
    prefix: String,
}

impl ExampleRedis {
    /// The server `REDIS_URL` names, else a throwaway one (see
    /// [`redis_url_or_throwaway`]), for the example called `example`.
    pub fn from_env(example: &str) -> Result<Self, BoxError> {
        let (client, server) = redis_url_or_throwaway()?;
        let prefix = match server {
            Some(_) => "lockgate".to_owned(),
            None => format!("{example}-{}", run_id()),
        };
        Ok(Self {
            client,
            server,
            prefix,
        })
    }

    /// A client for the server (a clone: cheap).
    pub fn client(&self) -> redis::Client {
        self.client.clone()
    }

    /// The prefix every key of the example must go under (give it to
    /// `Queue::prefix` and `Locker::prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The throwaway server, `None` when the server is the one `REDIS_URL`
    /// names.
    pub fn server(&self) -> Option<&RedisServer> {
        self.server.as_ref()
    }

    /// Deletes the keys this run made (`SCAN` of its prefix, then `UNLINK`)
    /// on the server `REDIS_URL` names, and answers how many went; on a
    /// throwaway server, which dies with `self`, does nothing. Keys under
    /// any other prefix are never looked at.
    pub async fn clean_up(&self) -> Result<usize, BoxError> {
        if self.server.is_some() {
            return Ok(0);
        }
        let mut conn = self.client.get_multiplexed_async_connection().await?;
        let pattern = format!("{}:*", glob_escape(&self.prefix));
        let mut cursor: u64 = 0;
        let mut deleted = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            if !keys.is_empty() {
                let n: usize = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut conn)
                    .await?;
                deleted += n;
            }
            if next == 0 {
                return Ok(deleted);
            }
            cursor = next;
        }
    }
}

/// Says which server, and on yours which prefix: `a throwaway
/// redis-server at 127.0.0.1:<port>` or `the Redis at <address>
/// (REDIS_URL), this run's keys under <prefix>:`.
impl fmt::Display for ExampleRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let address = self.client.get_connection_info().addr();
        match &self.server {
            Some(_) => write!(f, "a throwaway redis-server at {address}"),
            None => write!(
                f,
                "the Redis at {address} (REDIS_URL), this run's keys under `{}:`",
                self.prefix
            ),
        }
    }
}

/// A run id: this process's id and the time, in hex (unique enough for two
/// runs on one server never to share a prefix).
fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{:x}", std::process::id(), nanos & 0xffff_ffff_ffff)
}

/// `text` with the glob characters of `SCAN MATCH` escaped.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
