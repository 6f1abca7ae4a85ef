//! Waiting for work without polling.
//!
//! A [`Waiter`] blocks with `BLPOP`, on a connection of its own, on the
//! queue's doorbell (a one-element list producers ring when they add a
//! message due before everything scheduled) and on a poke list of its own
//! (`<prefix>:{<queue>}:poke:<uuid>`, in the bell's slot, expiring after
//! 10 s). A tokio timer times the due moment (Redis times out blocked
//! clients only on its `hz` tick), so the `BLPOP` only wakes it early; it
//! blocks at most [`BLOCK`] and is abandoned after [`BLOCK`] + [`MARGIN`].
//!
//! Redis hands a ring to the client blocked longest, so no `BLPOP` may stay
//! blocked while its worker is busy: a `wait` that returns on its deadline
//! first pokes its own list (confirmed, one round trip) to end its `BLPOP`,
//! and the next `wait` collects the answer, so a ring is never lost.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use redis::RedisResult;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// How long a `BLPOP` blocks on the server.
pub(crate) const BLOCK: Duration = Duration::from_secs(2);
/// How much longer than [`BLOCK`] the client waits for its answer before it
/// gives the connection up as dead.
pub(crate) const MARGIN: Duration = Duration::from_millis(1500);

/// Opens the dedicated connections that blocking commands need.
///
/// Implemented for [`redis::Client`] (a multiplexed connection without
/// redis-rs' response timeout, which would cut every block short) and for
/// [`redis::cluster::ClusterClient`].
pub trait Connector: Send + Sync + 'static {
    /// The connection type it opens.
    type Connection: ConnectionLike + Clone + Send + Sync + 'static;

    /// Opens a new connection.
    fn connect(&self) -> impl Future<Output = RedisResult<Self::Connection>> + Send;
}

impl Connector for redis::Client {
    type Connection = redis::aio::MultiplexedConnection;

    fn connect(&self) -> impl Future<Output = RedisResult<Self::Connection>> + Send {
        // Our own deadline (BLOCK + MARGIN) replaces the response timeout.
        let config = redis::AsyncConnectionConfig::new().set_response_timeout(None);
        async move {
            self.get_multiplexed_async_connection_with_config(&config)
                .await
        }
    }
}

impl Connector for redis::cluster::ClusterClient {
    type Connection = redis::cluster_async::ClusterConnection;

    fn connect(&self) -> impl Future<Output = RedisResult<Self::Connection>> + Send {
        let config = redis::cluster::ClusterConfig::new().set_response_timeout(BLOCK + MARGIN * 2);
        async move { self.get_async_connection_with_config(config).await }
    }
}

impl<K: Connector> Connector for std::sync::Arc<K> {
    type Connection = K::Connection;

    fn connect(&self) -> impl Future<Output = RedisResult<Self::Connection>> + Send {
        (**self).connect()
    }
}

/// Why [`Waiter::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wake {
    /// The doorbell rang: a message due earlier than the previous head was
    /// added. Claim, and look at the new next due time.
    Rung,
    /// The deadline passed.
    Deadline,
}

type Pending = Pin<Box<dyn Future<Output = RedisResult<bool>> + Send>>;

/// Blocks until a queue's doorbell rings or a deadline passes, on a
/// connection of its own. Made by [`Queue::waiter`](super::Queue::waiter).
pub struct Waiter<K: Connector, C> {
    /// Opens the dedicated connection (again, after a failure).
    connector: K,
    /// The queue's shared connection, to poke our own `BLPOP`.
    control: C,
    /// The doorbell key.
    bell: String,
    /// This waiter's own poke list (same hash slot as the bell).
    poke: String,
    /// The dedicated connection; `None` until opened, and after a failure.
    conn: Option<K::Connection>,
    /// The `BLPOP` in flight, if any.
    pending: Option<Pending>,
}

impl<K: Connector, C> std::fmt::Debug for Waiter<K, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("bell", &self.bell)
            .field("connected", &self.conn.is_some())
            .field("blocked", &self.pending.is_some())
            .finish_non_exhaustive()
    }
}

impl<K, C> Waiter<K, C>
where
    K: Connector,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub(crate) fn new(connector: K, control: C, bell: String, poke: String) -> Self {
        Self {
            connector,
            control,
            bell,
            poke,
            conn: None,
            pending: None,
        }
    }

    /// Waits until the doorbell rings or `deadline` passes (forever, for a
    /// ring, when `None`). Returning on the deadline first pokes this
    /// waiter's own `BLPOP` (see the module's documentation): on a hung
    /// server that adds at most 1.5 s. A Redis failure returns an error
    /// after dropping the connection; the next call opens a new one, and
    /// backing off between failures is the caller's choice.
    pub async fn wait(&mut self, deadline: Option<Instant>) -> Result<Wake> {
        let mut retried = false;
        loop {
            // A connection that sat unused may have been closed by the
            // server's idle `timeout`; its first failure is retried once.
            let reused = self.pending.is_none() && self.conn.is_some();
            // A deadline already past needs no BLPOP: one sent now could reach
            // the server after the caller's next claim and take the ring that
            // claim passes on to another waiter.
            if self.pending.is_none() && deadline.is_some_and(|d| d <= Instant::now()) {
                return Ok(Wake::Deadline);
            }
            if self.pending.is_none() {
                self.pending = Some(self.block().await?);
            }
            let Some(pending) = self.pending.as_mut() else {
                continue;
            };
            let answer = match deadline {
                Some(deadline) => tokio::select! {
                    biased;
                    answer = pending => answer,
                    () = tokio::time::sleep_until(deadline) => {
                        // Not `&self` across the await: the waiter is not
                        // `Sync` (its pending BLPOP is not).
                        unblock(self.control.clone(), &self.poke).await;
                        return Ok(Wake::Deadline);
                    }
                },
                None => pending.await,
            };
            self.pending = None;
            match answer {
                Ok(true) => return Ok(Wake::Rung),
                // The server-side block ran out, or we unblocked it.
                Ok(false) => continue,
                Err(e) => {
                    self.conn = None;
                    if reused && !retried && (e.is_connection_dropped() || e.is_io_error()) {
                        retried = true;
                        continue;
                    }
                    return Err(Error::redis("waiting on the queue's doorbell")(e));
                }
            }
        }
    }

    /// Starts a `BLPOP` on the dedicated connection, opening it if needed.
    async fn block(&mut self) -> Result<Pending> {
        let mut conn = match &self.conn {
            Some(conn) => conn.clone(),
            None => {
                let opened = self.connector.connect().await;
                let conn = opened.map_err(Error::redis("opening the waiter's connection"))?;
                self.conn.insert(conn).clone()
            }
        };
        let mut cmd = redis::cmd("BLPOP");
        cmd.arg(&self.bell).arg(&self.poke).arg(BLOCK.as_secs_f64());
        let bell = self.bell.clone();
        Ok(Box::pin(async move {
            let popped = cmd.query_async::<Option<(String, String)>>(&mut conn);
            match tokio::time::timeout(BLOCK + MARGIN, popped).await {
                // A ring, or our own poke (which is no ring).
                Ok(answer) => answer.map(|popped| popped.is_some_and(|(key, _)| key == bell)),
                Err(_) => Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no answer to a blocking BLPOP within its deadline",
                )
                .into()),
            }
        }))
    }
}

/// Ends the in-flight `BLPOP` early: returns once the server ran the
/// poke (so the server serves it to our `BLPOP` before it runs any
/// command the caller sends next), without waiting for the `BLPOP`'s
/// answer. Bounded by [`MARGIN`]: a poke that fails or hangs only means
/// our `BLPOP` ends on its own, within [`BLOCK`], as it would anyway.
async fn unblock<C: ConnectionLike + Send>(mut control: C, poke_key: &str) {
    let mut poke = redis::pipe();
    poke.lpush(poke_key, 1)
        .ignore()
        .pexpire(poke_key, 10_000)
        .ignore();
    match tokio::time::timeout(MARGIN, poke.exec_async(&mut control)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::debug!(%error, "could not poke the waiter's BLPOP"),
        Err(_) => tracing::debug!("no answer to the poke of the waiter's BLPOP in time"),
    }
}
