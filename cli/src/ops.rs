//! Every command but `bench`: what each does, on a server's or a cluster's
//! connection.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::time::{Duration, SystemTime};

use lockgate::queue::Stats;
use lockgate::{Locker, PushOptions, Queue};
use redis::aio::ConnectionLike;
use serde_json::{Value, json};

use crate::{Failure, Output, TOP_KEYS, confirm, dashboard, not_found, unix_ms};

/// What the commands work with.
pub(crate) struct Ops<C> {
    pub(crate) conn: C,
    /// A cluster's masters' URLs, for the listings of locks and permits
    /// (`SCAN` walks one node's keys); none on one server.
    pub(crate) nodes: Vec<String>,
    pub(crate) prefix: String,
    pub(crate) out: Output,
}

/// A message to push, from `lockgate push`.
pub(crate) struct NewMessage {
    pub(crate) json: String,
    pub(crate) delay: Option<Duration>,
    pub(crate) at: Option<SystemTime>,
    pub(crate) id: Option<String>,
}

impl<C> Ops<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Queue `name`, with the shard count it was created with.
    async fn queue(&self, name: &str) -> Result<Queue<Value, C>, Failure> {
        let queue = Queue::new(self.conn.clone(), name)?.prefix(&self.prefix)?;
        Ok(queue.with_recorded_shards().await?)
    }

    /// Queue `name`, if it has any key in Redis.
    pub(crate) async fn existing(&self, name: &str) -> Result<Queue<Value, C>, Failure> {
        let queue = self.queue(name).await?;
        match queue.exists().await? {
            true => Ok(queue),
            false => Err(not_found(format!("no queue named {name}"))),
        }
    }

    pub(crate) fn locker(&self) -> Result<Locker<C>, Failure> {
        Ok(Locker::new(self.conn.clone()).prefix(&self.prefix)?)
    }

    /// A connection to each of the cluster's masters (none on one server).
    async fn node_connections(&self) -> Result<Vec<redis::aio::ConnectionManager>, Failure> {
        crate::node_connections(&self.nodes).await
    }

    /// `lockgate queues`.
    pub(crate) async fn queues(&self) -> Result<(), Failure> {
        let names = lockgate::queue::queue_names(&self.conn, &self.prefix).await?;
        let mut rows = Vec::new();
        for name in names {
            let stats = self.queue(&name).await?.stats().await?;
            rows.push((name, stats));
        }
        self.out.queues(&rows);
        Ok(())
    }

    /// `lockgate stats`, once or every `watch`.
    pub(crate) async fn stats(
        &self,
        name: &str,
        watch: Option<Duration>,
        shards: bool,
    ) -> Result<(), Failure> {
        let q = self.existing(name).await?;
        let Some(every) = watch else {
            let (stats, each) = stats_and_shards(&q, shards).await?;
            let keys = q.key_stats(TOP_KEYS).await?;
            self.out.stats(name, &stats, &keys, &each);
            return Ok(());
        };
        let mut ticks = tokio::time::interval(every);
        // One listener for the whole watch: a Ctrl-C that comes while a
        // refresh waits on the server is seen at the next tick instead of
        // lost.
        let mut interrupted = std::pin::pin!(tokio::signal::ctrl_c());
        // Polled once now, which installs its handler: until then a Ctrl-C
        // gets the default one, which kills the process (a loaded machine
        // may not poll the loop's select before the first Ctrl-C comes).
        tokio::select! {
            biased;
            _ = &mut interrupted => return Ok(()),
            () = std::future::ready(()) => {}
        }
        let mut rates = Rates::new(&q).await?;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = &mut interrupted => return Ok(()),
            }
            let (stats, each) = stats_and_shards(&q, shards).await?;
            let keys = q.key_stats(TOP_KEYS).await?;
            let (counts, elapsed) = rates.since_last(&q).await?;
            if !self.out.json && std::io::stdout().is_terminal() {
                crate::say_inline!("\x1b[H\x1b[2J"); // refresh in place
            }
            self.out.stats(name, &stats, &keys, &each);
            self.out.rates(rates.seen.is_some(), &counts, elapsed);
        }
    }

    /// `lockgate requeue`: every dead letter, or the one of `id`.
    pub(crate) async fn requeue(
        &self,
        name: &str,
        id: Option<String>,
        all: bool,
    ) -> Result<(), Failure> {
        let q = self.existing(name).await?;
        if all {
            let n = q.requeue_all_dead().await?;
            let text = format!("re-drove {n} dead letters");
            self.out.done(json!({"requeued": n}), &text);
        } else if let Some(id) = id {
            if !q.requeue_dead(&id).await? {
                return Err(not_found(format!("{id} is not a dead letter of {name}")));
            }
            let text = format!("re-drove {id}");
            self.out.done(json!({"requeued": 1, "id": id}), &text);
        }
        Ok(())
    }

    /// `lockgate remove`: a scheduled or dead message.
    pub(crate) async fn remove(&self, name: &str, id: &str) -> Result<(), Failure> {
        if !self.existing(name).await?.remove(id).await? {
            return Err(not_found(format!(
                "{id} is not a scheduled or dead message of {name} (absent, or being handled)"
            )));
        }
        self.out
            .done(json!({"removed": id}), &format!("removed {id}"));
        Ok(())
    }

    /// `lockgate purge`, once confirmed.
    pub(crate) async fn purge(&self, name: &str, yes: bool) -> Result<(), Failure> {
        let q = self.existing(name).await?;
        if !yes && !confirm(&format!("delete every message of queue {name}?"))? {
            return Err("not purged (confirm, or pass --yes)".into());
        }
        q.purge().await?;
        self.out
            .done(json!({"purged": name}), &format!("purged {name}"));
        Ok(())
    }

    /// `lockgate push`.
    pub(crate) async fn push(&self, name: &str, message: NewMessage) -> Result<(), Failure> {
        let value: Value = serde_json::from_str(&message.json)
            .map_err(|e| Failure::Failed(format!("malformed JSON message: {e}").into()))?;
        let mut options = PushOptions::new();
        if let Some(delay) = message.delay {
            options = options.after(delay);
        }
        if let Some(at) = message.at {
            options = options.at(at);
        }
        if let Some(id) = message.id {
            options = options.id(id);
        }
        let pushed = self.queue(name).await?.push_with(value, options).await?;
        let state = match pushed.created {
            true => "pushed",
            false => "exists already",
        };
        self.out.done(
            json!({"id": pushed.id, "created": pushed.created, "due": pushed.due.map(unix_ms)}),
            &format!("{state}: {}", pushed.id),
        );
        Ok(())
    }

    /// `lockgate locks`: held locks matching `pattern`, on every master.
    pub(crate) async fn locks(&self, pattern: &str) -> Result<(), Failure> {
        let mut held = Vec::new();
        if self.nodes.is_empty() {
            held = self.locker()?.held_locks(pattern).await?;
        }
        for node in self.node_connections().await? {
            let locker = Locker::new(node).prefix(&self.prefix)?;
            held.extend(locker.held_locks(pattern).await?);
        }
        held.sort_by(|a, b| a.0.cmp(&b.0));
        self.out.locks(&held);
        Ok(())
    }

    /// `lockgate lock`: its holder, or its last fence when free.
    pub(crate) async fn lock(&self, key: String) -> Result<(), Failure> {
        let locker = self.locker()?;
        if let Some(holder) = locker.inspect(&key).await? {
            self.out.locks(&[(key, holder)]);
            return Ok(());
        }
        let last: Option<u64> = redis::cmd("GET")
            .arg(locker.fence_key(&key))
            .query_async(&mut self.conn.clone())
            .await?;
        let note = match last {
            Some(fence) => format!("{key}: free; last fence {fence}"),
            None => format!(
                "{key}: free; no fence on record (none issued, or over {:?} ago)",
                lockgate::lock::FENCE_GRACE
            ),
        };
        let doc = json!({"key": key, "held": false, "last_fence": last});
        self.out.done(doc, &note);
        Ok(())
    }

    /// `lockgate unlock`: deletes a held lock whatever its holder.
    pub(crate) async fn unlock(&self, key: String) -> Result<(), Failure> {
        if !self.locker()?.force_unlock(&key).await? {
            return Err(not_found(format!("lock {key} is not held")));
        }
        self.out.done(
            json!({"unlocked": key}),
            &format!(
                "deleted lock {key}: its holder runs on without it until its next renewal fails, and another caller may take the key meanwhile"
            ),
        );
        Ok(())
    }

    /// `lockgate functions`: the libraries, after deleting the stale ones
    /// when asked.
    pub(crate) async fn functions(&self, delete_stale: bool) -> Result<(), Failure> {
        let deleted = match delete_stale {
            true => Some(lockgate::delete_stale_functions(&self.conn).await?),
            false => None,
        };
        let libraries = lockgate::function_libraries(&self.conn).await?;
        self.out.functions(&libraries, deleted.as_deref());
        Ok(())
    }

    /// `lockgate dashboard`.
    pub(crate) async fn dashboard(
        &self,
        bind: std::net::SocketAddr,
        token: Option<String>,
        allowed_hosts: Vec<dashboard::Authority>,
    ) -> Result<(), Failure> {
        let csrf: String = (0..32)
            .map(|_| char::from_digit(rand::random_range(0..16), 16).unwrap_or('0'))
            .collect();
        let board = dashboard::Dashboard {
            conn: self.conn.clone(),
            nodes: self.node_connections().await?,
            prefix: self.prefix.clone(),
            bind,
            allowed_hosts,
            token: token.filter(|t| !t.is_empty()),
            sessions: dashboard::Sessions::new(dashboard::SESSION_LIFETIME),
            csrf,
            names: std::sync::Mutex::new(None),
        };
        Ok(dashboard::serve(board).await?)
    }
}

/// The queue's stats, and each shard's when `shards` (none otherwise).
async fn stats_and_shards<C>(
    queue: &Queue<Value, C>,
    shards: bool,
) -> Result<(Stats, Vec<Stats>), Failure>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    Ok(match shards {
        true => queue.stats_by_shard().await?,
        false => (queue.stats().await?, Vec::new()),
    })
}

/// What `stats --watch` has read of the queue's lifecycle events, for its
/// rates: what happened since the last look, when the queue's handles
/// record events.
struct Rates {
    /// The last entry read (none while the queue has no events).
    seen: Option<String>,
    since: std::time::Instant,
}

impl Rates {
    async fn new<C>(queue: &Queue<Value, C>) -> Result<Self, Failure>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        Ok(Self {
            seen: queue.last_event_entry().await?,
            since: std::time::Instant::now(),
        })
    }

    /// The events of each kind since the last call, and the seconds since.
    async fn since_last<C>(
        &mut self,
        queue: &Queue<Value, C>,
    ) -> Result<(BTreeMap<&'static str, u64>, f64), Failure>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let mut counts: BTreeMap<&'static str, u64> = BTreeMap::new();
        if self.seen.is_none() {
            self.seen = queue.last_event_entry().await?;
        } else {
            // Bounded: a queue busier than this is shown as far as it was
            // read.
            for _ in 0..100 {
                let Some(after) = self.seen.clone() else {
                    break;
                };
                let events = queue.events_after(&after, 1000).await?;
                let Some(last) = events.last() else { break };
                self.seen = Some(last.entry.clone());
                for event in &events {
                    *counts.entry(event.kind.as_str()).or_default() += 1;
                }
            }
        }
        let elapsed = self.since.elapsed().as_secs_f64().max(0.001);
        self.since = std::time::Instant::now();
        Ok((counts, elapsed))
    }
}
