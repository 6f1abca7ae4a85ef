//! Waking lock waiters on release, in any process: see [`ReleaseListener`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::error::{Error, Result};

/// How long a channel stays subscribed after its last waiter left.
const LINGER: Duration = Duration::from_secs(1);
/// How often idle channels are dropped and the connection is checked.
const TICK: Duration = Duration::from_secs(1);
/// The longest a connection attempt or a check of the connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `names` with their presence channels, `<channel>#<process tag>` (the tag
/// starts every token this process makes), which tell release scripts this
/// process still listens on `channel`. Subscribed and unsubscribed with it;
/// Redis drops them by itself when the process's connection closes (it died).
fn with_presence(names: &[String]) -> Vec<String> {
    let tag = super::process_tag();
    names
        .iter()
        .flat_map(|name| [name.clone(), format!("{name}#{tag}")])
        .collect()
}

/// Wakes this process's lock waiters when the lock they wait for is released,
/// by any process: one subscriber connection for all keys (one per process).
///
/// Give it to [`LockLayer::wake_on_release`](crate::LockLayer::wake_on_release);
/// waiters under `OnConflict::retry` then sleep until the release (or the
/// holder's TTL) instead of polling with backoff. Clones share the
/// connection, closed when the last clone (and the last waiter) is dropped.
///
/// A waiter listens on a channel named like the lock key while it waits (and
/// a second longer): see docs/layer.md, "The LockLayer", for the line and the
/// hand-off. The listener reconnects with backoff when its connection drops,
/// waking every waiter: a lost message only means a waiter wakes on the
/// holder's TTL, or the hand-off's end, instead.
#[derive(Clone)]
pub struct ReleaseListener {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ReleaseListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleaseListener")
            .field("channels", &self.shared.channels().len())
            .finish_non_exhaustive()
    }
}

struct Shared {
    /// The channels this process listens on (or is about to), by name.
    channels: Mutex<HashMap<String, Channel>>,
    /// Asks the connection task to subscribe to a channel.
    subscribe: mpsc::UnboundedSender<String>,
}

#[derive(Default)]
struct Channel {
    /// Waiters of this process that listen on it now.
    waiters: usize,
    /// Their tokens, and whether a release handed them the lock (or a permit)
    /// that they have yet to see.
    handed: HashMap<String, bool>,
    /// Since when nobody listens (it is unsubscribed after `LINGER`).
    idle_since: Option<Instant>,
    /// What waiters watch: each change wakes them.
    state: watch::Sender<State>,
}

#[derive(Debug, Clone, Default)]
struct State {
    /// The server confirmed the subscription, and the connection is up.
    confirmed: bool,
    /// Whether the last release handed the lock to a waiter of another
    /// process (false: to nobody, or a reconnection).
    handed_elsewhere: bool,
}

/// What woke a waiter (see [`Watch::woken`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Woken {
    /// A release handed the lock (or a permit) to this waiter.
    Mine,
    /// A release handed it to a waiter of another process.
    Elsewhere,
    /// A release to nobody, or a reconnection: every waiter tries again.
    Anyone,
}

impl Shared {
    /// The state, and the receiver of subscribe requests (for the task).
    fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<String>) {
        let (subscribe, requests) = mpsc::unbounded_channel();
        let channels = Mutex::default();
        let shared = Shared {
            channels,
            subscribe,
        };
        (Arc::new(shared), requests)
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        // Every critical section is a few map operations: nothing to poison.
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ReleaseListener {
    /// Connects a subscriber to `client`'s server, and starts the task that
    /// dispatches releases to waiters (on the current tokio runtime). Errors
    /// when the first connection fails; later ones are retried meanwhile.
    pub async fn connect(client: redis::Client) -> Result<Self> {
        let pubsub = connect(&client).await?;
        let (shared, requests) = Shared::new();
        tokio::spawn(run(client, pubsub, Arc::downgrade(&shared), requests));
        Ok(Self { shared })
    }

    /// Connects a subscriber to a Redis Cluster with the settings of `builder`
    /// (nodes, TLS, credentials), switched to RESP3 with a push channel of its
    /// own: it subscribes with `SSUBSCRIBE` on the node that owns each lock
    /// key. redis-rs resubscribes after reconnections and slot moves; waiters
    /// are woken at each disconnection, since a release may have been missed.
    pub async fn connect_cluster(builder: redis::cluster::ClusterClientBuilder) -> Result<Self> {
        let attempted = "connecting the release listener to the cluster";
        let (pushes, received) = mpsc::unbounded_channel();
        let client = builder
            .use_protocol(redis::ProtocolVersion::RESP3)
            .push_sender(pushes)
            .build()
            .map_err(Error::redis(attempted))?;
        let conn = timely(client.get_async_connection(), "timed out")
            .await
            .map_err(Error::redis(attempted))?;
        let (shared, requests) = Shared::new();
        let listening = run_cluster(conn, received, Arc::downgrade(&shared), requests);
        tokio::spawn(listening);
        Ok(Self { shared })
    }

    /// Starts listening on `channel` (a lock key) for the waiter with `token`:
    /// the [`Watch`] is woken by each release published there.
    pub(crate) fn watch(&self, channel: &str, token: &str) -> Watch {
        let mut channels = self.shared.channels();
        let entry = channels.entry(channel.to_owned()).or_insert_with(|| {
            // Ordered after any unsubscribe of the same channel: the
            // connection task handles one request at a time.
            let _ = self.shared.subscribe.send(channel.to_owned());
            Channel::default()
        });
        entry.waiters += 1;
        entry.idle_since = None;
        entry.handed.insert(token.to_owned(), false);
        let receiver = entry.state.subscribe();
        Watch {
            shared: self.shared.clone(),
            channel: channel.to_owned(),
            token: token.to_owned(),
            receiver,
        }
    }
}

/// A waiter's subscription to one lock's releases.
pub(crate) struct Watch {
    shared: Arc<Shared>,
    channel: String,
    token: String,
    receiver: watch::Receiver<State>,
}

impl Watch {
    /// Waits until the subscription is confirmed, at most until `deadline`.
    /// False when not (the connection is down): the waiter must then poll.
    pub(crate) async fn ready(&mut self, deadline: Option<Instant>) -> bool {
        let confirmed = self.receiver.wait_for(|state| state.confirmed);
        let confirmed = match deadline {
            Some(deadline) => tokio::time::timeout_at(deadline, confirmed)
                .await
                .is_ok_and(|state| state.is_ok()),
            None => confirmed.await.is_ok(),
        };
        // Wake-ups before the confirmation say nothing about this waiter.
        self.receiver.mark_unchanged();
        confirmed
    }

    /// Whether the subscription is confirmed now.
    pub(crate) fn is_ready(&self) -> bool {
        self.receiver.borrow().confirmed
    }

    /// Completes at the next wake-up (a release published on the channel, or a
    /// lost connection): whether a release handed the lock to this waiter
    /// since the last wake-up it saw (quick ones may be seen as one), else
    /// whether the last one handed it elsewhere.
    pub(crate) async fn woken(&mut self) -> Woken {
        if self.receiver.changed().await.is_err() {
            // The listener is gone: nothing will wake us.
            std::future::pending::<()>().await;
        }
        let elsewhere = self.receiver.borrow_and_update().handed_elsewhere;
        let mut channels = self.shared.channels();
        let mine = channels
            .get_mut(&self.channel)
            .and_then(|entry| entry.handed.get_mut(&self.token))
            .is_some_and(std::mem::take);
        match (mine, elsewhere) {
            (true, _) => Woken::Mine,
            (false, true) => Woken::Elsewhere,
            (false, false) => Woken::Anyone,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut channels = self.shared.channels();
        if let Some(entry) = channels.get_mut(&self.channel) {
            entry.waiters -= 1;
            entry.handed.remove(&self.token);
            if entry.waiters == 0 {
                entry.idle_since = Some(Instant::now());
            }
        }
    }
}

async fn connect(client: &redis::Client) -> Result<redis::aio::PubSub> {
    timely(client.get_async_pubsub(), "timed out")
        .await
        .map_err(Error::redis("connecting the release listener"))
}

/// `request`, given at most `CONNECT_TIMEOUT` (a hung server must not stall
/// the listener): an I/O error saying `silence` when it takes longer.
async fn timely<T>(
    request: impl Future<Output = redis::RedisResult<T>>,
    silence: &'static str,
) -> redis::RedisResult<T> {
    tokio::time::timeout(CONNECT_TIMEOUT, request)
        .await
        .unwrap_or_else(|_| Err(redis::RedisError::from((redis::ErrorKind::Io, silence))))
}

/// The connection task: subscribes as asked, dispatches releases, drops
/// idle channels, and reconnects when the connection is lost. Ends when
/// the listener and all its waiters are gone.
async fn run(
    client: redis::Client,
    pubsub: redis::aio::PubSub,
    shared: Weak<Shared>,
    mut requests: mpsc::UnboundedReceiver<String>,
) {
    let mut pubsub = Some(pubsub);
    let mut retry = RETRY_FIRST;
    loop {
        let (mut sink, mut stream) = match reopen(&client, pubsub.take(), &shared).await {
            Ok(Some(listening)) => listening,
            Ok(None) => return,
            Err(error) => {
                // Refused (say, by an ACL) or no answer: try again later, on
                // a new connection, without spinning.
                tracing::warn!(%error, ?retry, "release listener: reconnecting");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(RETRY_MAX);
                continue;
            }
        };
        retry = RETRY_FIRST;
        let Some(lost) = listen(&mut sink, &mut stream, &shared, &mut requests).await else {
            return;
        };
        tracing::warn!(error = %lost, "release listener: connection lost; waiters poll until it is back");
        // Nothing can be heard until the subscriptions are back: wake every
        // waiter, so that none sleeps through a release it missed.
        wake_all(&shared, false);
    }
}

/// The first and the longest pause before the listener connects again.
const RETRY_FIRST: Duration = Duration::from_millis(50);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Takes `pubsub` (the first connection) or opens a new one, and subscribes
/// again to every channel waiters listen on. `None`: the listener is gone.
async fn reopen(
    client: &redis::Client,
    pubsub: Option<redis::aio::PubSub>,
    shared: &Weak<Shared>,
) -> Result<Option<(redis::aio::PubSubSink, redis::aio::PubSubStream)>> {
    let pubsub = match pubsub {
        Some(pubsub) => pubsub,
        None => match connect(client).await {
            Err(_) if shared.strong_count() == 0 => return Ok(None),
            connected => connected?,
        },
    };
    let (mut sink, stream) = pubsub.split();
    let Some(names) = names(shared, |_| true) else {
        return Ok(None);
    };
    if !names.is_empty() {
        subscribe(&mut sink, &names)
            .await
            .map_err(Error::redis("subscribing the release listener again"))?;
        confirm(shared, &names);
    }
    Ok(Some((sink, stream)))
}

/// Serves the connection: subscribes what waiters ask for, wakes them on
/// releases, and every tick drops idle channels and checks the connection.
/// Returns why the connection was lost, or `None` once the listener is gone.
async fn listen(
    sink: &mut redis::aio::PubSubSink,
    stream: &mut redis::aio::PubSubStream,
    shared: &Weak<Shared>,
    requests: &mut mpsc::UnboundedReceiver<String>,
) -> Option<redis::RedisError> {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            request = requests.recv() => {
                if let Err(error) = subscribe_requested(sink, shared, requests, request?).await? {
                    return Some(error);
                }
            }
            message = stream.next() => {
                let Some(message) = message else {
                    return Some(redis::RedisError::from((redis::ErrorKind::Io, "connection closed")));
                };
                if !wake(shared, message.get_channel_name(), message.get_payload_bytes()) {
                    return None;
                }
            }
            _ = tick.tick() => {
                let idle = take_idle(shared)?;
                let checked = async {
                    if !idle.is_empty() {
                        sink.unsubscribe(with_presence(&idle)).await?;
                    }
                    sink.ping::<redis::Value>().await
                };
                if let Err(error) = timely(checked, "no answer to PING").await {
                    return Some(error);
                }
            }
        }
    }
}

/// Subscribes `first` and every request queued behind it (a burst of waiters
/// subscribes at once), but only channels still wanted: one dropped meanwhile
/// would stay subscribed for good. `None` once the listener is gone.
async fn subscribe_requested(
    sink: &mut redis::aio::PubSubSink,
    shared: &Weak<Shared>,
    requests: &mut mpsc::UnboundedReceiver<String>,
    first: String,
) -> Option<redis::RedisResult<()>> {
    let mut names = vec![first];
    while let Ok(name) = requests.try_recv() {
        names.push(name);
    }
    let strong = shared.upgrade()?;
    names.retain(|name| strong.channels().contains_key(name));
    drop(strong);
    if names.is_empty() {
        return Some(Ok(()));
    }
    let subscribed = subscribe(sink, &names).await;
    if subscribed.is_ok() {
        confirm(shared, &names);
    }
    Some(subscribed)
}

/// The connection task on a cluster: subscribes as asked (one channel at a
/// time: they live on different nodes), dispatches releases, drops idle
/// channels; redis-rs reconnects and resubscribes by itself.
async fn run_cluster(
    mut conn: redis::cluster_async::ClusterConnection,
    mut pushes: mpsc::UnboundedReceiver<redis::PushInfo>,
    shared: Weak<Shared>,
    mut requests: mpsc::UnboundedReceiver<String>,
) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            request = requests.recv() => {
                let Some(name) = request else { return };
                let Some(wanted) = shared.upgrade().map(|s| s.channels().contains_key(&name)) else {
                    return;
                };
                if wanted {
                    subscribe_one(&mut conn, &shared, name).await;
                }
            }
            push = pushes.recv() => {
                let Some(push) = push else { return };
                match push.kind {
                    redis::PushKind::SMessage | redis::PushKind::Message => {
                        let channel = text(push.data.first()).and_then(|c| std::str::from_utf8(c).ok());
                        let payload = text(push.data.get(1)).unwrap_or_default();
                        if let Some(channel) = channel
                            && !wake(&shared, channel, payload)
                        {
                            return;
                        }
                    }
                    // A node's connection dropped: its releases may have been
                    // missed until redis-rs resubscribed.
                    redis::PushKind::Disconnection => wake_all(&shared, true),
                    _ => {}
                }
            }
            _ = tick.tick() => {
                let Some(idle) = take_idle(&shared) else { return };
                for name in idle {
                    if let Err(error) = conn.sunsubscribe(with_presence(std::slice::from_ref(&name))).await {
                        tracing::debug!(%error, channel = %name, "release listener: could not unsubscribe");
                    }
                }
                // Channels whose subscription failed are asked again.
                let Some(unconfirmed) = names(&shared, |c| !c.state.borrow().confirmed) else {
                    return;
                };
                for name in unconfirmed {
                    subscribe_one(&mut conn, &shared, name).await;
                }
            }
        }
    }
}

/// `SSUBSCRIBE` to one channel; a failure is logged, and tried next tick.
async fn subscribe_one(
    conn: &mut redis::cluster_async::ClusterConnection,
    shared: &Weak<Shared>,
    name: String,
) {
    // The presence channel has the channel's hash tag: the same node.
    let names = with_presence(std::slice::from_ref(&name));
    match tokio::time::timeout(CONNECT_TIMEOUT, conn.ssubscribe(&names)).await {
        Ok(Ok(())) => confirm(shared, std::slice::from_ref(&name)),
        Ok(Err(error)) => {
            tracing::warn!(%error, channel = %name, "release listener: could not subscribe")
        }
        Err(_) => tracing::warn!(channel = %name, "release listener: no answer to SSUBSCRIBE"),
    }
}

/// The bytes of a string in a push message.
fn text(value: Option<&redis::Value>) -> Option<&[u8]> {
    match value {
        Some(redis::Value::BulkString(bytes)) => Some(bytes),
        Some(redis::Value::SimpleString(s)) => Some(s.as_bytes()),
        _ => None,
    }
}

/// Wakes the waiters of `channel` with a release's `payload`: the token of
/// the waiter it handed the lock to, or nothing. False: the listener is gone.
fn wake(shared: &Weak<Shared>, channel: &str, payload: &[u8]) -> bool {
    let Some(shared) = shared.upgrade() else {
        return false;
    };
    if let Some(entry) = shared.channels().get_mut(channel) {
        // A waiter of this process handed the lock is told, whatever
        // wake-ups come before it looks.
        let handed = std::str::from_utf8(payload)
            .ok()
            .and_then(|token| entry.handed.get_mut(token));
        let elsewhere = handed.is_none() && !payload.is_empty();
        if let Some(handed) = handed {
            *handed = true;
        }
        entry
            .state
            .send_modify(|state| state.handed_elsewhere = elsewhere);
    }
    true
}

/// Wakes every waiter; `confirmed` says whether subscriptions still hold.
fn wake_all(shared: &Weak<Shared>, confirmed: bool) {
    if let Some(shared) = shared.upgrade() {
        for entry in shared.channels().values() {
            entry.state.send_modify(|state| {
                state.confirmed &= confirmed;
                state.handed_elsewhere = false;
            });
        }
    }
}

/// The names of the channels `which` picks; `None` when the listener is gone.
fn names(shared: &Weak<Shared>, which: impl Fn(&Channel) -> bool) -> Option<Vec<String>> {
    let shared = shared.upgrade()?;
    let channels = shared.channels();
    let picked = channels.iter().filter(|(_, channel)| which(channel));
    Some(picked.map(|(name, _)| name.clone()).collect())
}

/// Removes the channels nobody has listened on for `LINGER`, and returns
/// them (to unsubscribe); `None` when the listener is gone.
fn take_idle(shared: &Weak<Shared>) -> Option<Vec<String>> {
    let shared = shared.upgrade()?;
    let now = Instant::now();
    let idle = shared
        .channels()
        .extract_if(|_, c| c.idle_since.is_some_and(|t| now - t >= LINGER))
        .map(|(name, _)| name)
        .collect();
    Some(idle)
}

/// `SUBSCRIBE`s to `names` (and their presence channels), waiting at most
/// `CONNECT_TIMEOUT` for the confirmation.
async fn subscribe(sink: &mut redis::aio::PubSubSink, names: &[String]) -> redis::RedisResult<()> {
    let names = with_presence(names);
    timely(sink.subscribe(&names), "no answer to SUBSCRIBE").await
}

/// Marks `names` as subscribed, which lets their waiters go on.
fn confirm(shared: &Weak<Shared>, names: &[String]) {
    if let Some(shared) = shared.upgrade() {
        let channels = shared.channels();
        for entry in names.iter().filter_map(|name| channels.get(name)) {
            entry.state.send_modify(|state| state.confirmed = true);
        }
    }
}
