//! Lifecycle events: what happens to a queue's messages, appended by the
//! queue's scripts to a capped Redis Stream, `<prefix>:{<queue>}:events`,
//! and followed by any process with [`Queue::events`](super::Queue::events).
//!
//! A stream rather than pub/sub: a follower that starts late, or lost its
//! connection for a moment, reads back what the stream still holds (the
//! last `max_len` or so entries) instead of missing it, and a dashboard can
//! show the last minutes as soon as it opens.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use futures_util::Stream;
use redis::Value;

use super::wait::{BLOCK, Connector, MARGIN};
use crate::error::{Error, Result};

/// What happened to a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// Pushed (a push of an id that existed already adds no event).
    Pushed,
    /// Claimed by a worker for an attempt.
    Claimed,
    /// Handled and acknowledged.
    Done,
    /// Its attempt failed; scheduled again ([`Event::error`] says why).
    Retried,
    /// Deferred because its key was busy.
    Deferred,
    /// Handed back unhandled by a worker shutting down.
    Released,
    /// Moved to the dead letters ([`Event::error`] says why).
    Dead,
    /// Its lease ran out (its worker died or stalled): scheduled again.
    Recovered,
    /// Re-driven from the dead letters.
    Redriven,
    /// Removed by hand.
    Removed,
    /// A keyed message's turn ended and its key's lock (or permit) was let
    /// go ([`Event::id`] is the message, [`Event::key`] the key). A key
    /// handed to its next message at once, or whose holder died, has none.
    KeyReleased,
}

/// Each kind and the name the scripts write.
const KINDS: [(EventKind, &str); 11] = [
    (EventKind::Pushed, "pushed"),
    (EventKind::Claimed, "claimed"),
    (EventKind::Done, "done"),
    (EventKind::Retried, "retried"),
    (EventKind::Deferred, "deferred"),
    (EventKind::Released, "released"),
    (EventKind::Dead, "dead"),
    (EventKind::Recovered, "recovered"),
    (EventKind::Redriven, "redriven"),
    (EventKind::Removed, "removed"),
    (EventKind::KeyReleased, "key-released"),
];

impl EventKind {
    fn parse(name: &[u8]) -> Option<Self> {
        KINDS
            .iter()
            .find(|(_, n)| n.as_bytes() == name)
            .map(|(kind, _)| *kind)
    }

    /// The name the scripts write (`"pushed"`, `"claimed"`, ...).
    pub fn as_str(&self) -> &'static str {
        KINDS
            .iter()
            .find(|(kind, _)| kind == self)
            .map_or("", |(_, name)| name)
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One change of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// What happened.
    pub kind: EventKind,
    /// The message id.
    pub id: String,
    /// The delivery attempt it concerns: 1 for a message never tried (for
    /// [`Retried`](EventKind::Retried) and [`Dead`](EventKind::Dead), the
    /// attempt that failed).
    pub attempt: u32,
    /// When, by the server's clock.
    pub at: SystemTime,
    /// The error, for [`Retried`](EventKind::Retried) and
    /// [`Dead`](EventKind::Dead).
    pub error: Option<String>,
    /// The message's key, for a message pushed with one
    /// ([`PushOptions::key`](super::PushOptions::key)), on every event but
    /// [`Redriven`](EventKind::Redriven) and [`Removed`](EventKind::Removed).
    pub key: Option<String>,
    /// The stream entry it came in (several events share one when a script
    /// changed several messages): resume after it with
    /// [`EventsFrom::After`].
    pub entry: String,
}

/// Where [`Queue::events`](super::Queue::events) starts reading.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventsFrom {
    /// Only what happens from now on.
    Now,
    /// Everything the stream still holds, then what happens from now on.
    Beginning,
    /// After this stream entry ([`Event::entry`]): to resume where an
    /// earlier reader stopped.
    After(String),
}

/// The state of an event stream between items.
struct Reader<K: Connector> {
    connector: K,
    key: String,
    conn: Option<K::Connection>,
    /// The last entry read.
    last: String,
    ready: VecDeque<Event>,
    failures: u32,
}

/// Follows a queue's events after entry `last` (see
/// [`Queue::events`](super::Queue::events), which resolves `EventsFrom`).
pub(crate) fn follow<K: Connector>(
    connector: K,
    key: String,
    last: String,
) -> impl Stream<Item = Result<Event>> + Send + 'static {
    let reader = Reader {
        connector,
        key,
        conn: None,
        last,
        ready: VecDeque::new(),
        failures: 0,
    };
    futures_util::stream::unfold(Some(reader), |state| async move {
        let mut reader = state?;
        loop {
            if let Some(event) = reader.ready.pop_front() {
                return Some((Ok(event), Some(reader)));
            }
            match reader.read().await {
                Ok(()) => reader.failures = 0,
                Err(error) if !error.is_retryable() => {
                    // A refusal or a bad reply lasts: say so, and end.
                    return Some((Err(error), None));
                }
                Err(error) => {
                    // Reconnect and resume after the last entry seen.
                    reader.conn = None;
                    let pause = Duration::from_millis(100 * 2u64.pow(reader.failures.min(5)));
                    reader.failures += 1;
                    tracing::warn!(%error, ?pause, stream = %reader.key, "queue events: reconnecting");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    })
}

impl<K: Connector> Reader<K> {
    /// One blocking read (or a reconnect and the read).
    async fn read(&mut self) -> Result<()> {
        let attempted = || format!("reading the events of `{}`", self.key);
        let conn = match &mut self.conn {
            Some(conn) => conn,
            None => {
                let connect = tokio::time::timeout(BLOCK + MARGIN, self.connector.connect()).await;
                let conn = match connect {
                    Ok(conn) => conn.map_err(Error::redis(attempted()))?,
                    Err(_) => return Err(timed_out(attempted(), "connecting")),
                };
                self.conn.insert(conn)
            }
        };
        let block = BLOCK.as_millis().to_string();
        let mut xread = redis::cmd("XREAD");
        xread.arg(&["COUNT", "1000", "BLOCK", &block]);
        xread.arg("STREAMS").arg(&self.key).arg(&self.last);
        let read = xread.query_async::<Value>(conn);
        let reply = match tokio::time::timeout(BLOCK + MARGIN, read).await {
            Ok(reply) => reply.map_err(Error::redis(attempted()))?,
            Err(_) => return Err(timed_out(attempted(), "XREAD")),
        };
        // Nil on a timeout; else [[key, entries]] (a map under RESP3).
        let streams: Vec<Value> = match reply {
            Value::Array(streams) => streams
                .into_iter()
                .filter_map(|stream| match stream {
                    Value::Array(mut pair) if pair.len() == 2 => pair.pop(),
                    _ => None,
                })
                .collect(),
            Value::Map(streams) => streams.into_iter().map(|(_, entries)| entries).collect(),
            _ => return Ok(()),
        };
        for stream in streams {
            for (id, fields) in entries(stream) {
                self.ready.extend(decode(&id, fields));
                self.last = id;
            }
        }
        Ok(())
    }
}

fn as_bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        _ => None,
    }
}

/// A retryable error for a command that got no answer in time.
fn timed_out(attempted: String, what: &'static str) -> Error {
    Error::redis(attempted)(redis::RedisError::from((
        redis::ErrorKind::Io,
        "no answer in time",
        what.to_owned(),
    )))
}

/// Whether `id` is a stream entry id, `<ms>-<seq>` (or `<ms>`).
pub(crate) fn is_entry_id(id: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    match id.split_once('-') {
        Some((ms, seq)) => digits(ms) && digits(seq),
        None => digits(id),
    }
}

/// A stream entry id as numbers (ms, seq), to order entries of several
/// streams (a malformed one first).
pub(crate) fn entry_order(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

/// The entries of an `XRANGE`/`XREAD` reply: (id, flat fields).
pub(crate) fn entries(reply: Value) -> Vec<(String, Vec<Value>)> {
    let Value::Array(entries) = reply else {
        return Vec::new();
    };
    entries
        .into_iter()
        .filter_map(|entry| {
            let Value::Array(mut parts) = entry else {
                return None;
            };
            if parts.len() != 2 {
                return None;
            }
            let fields = match parts.pop()? {
                Value::Array(fields) => fields,
                Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
                _ => return None,
            };
            let id = as_bytes(parts.pop()?)?;
            Some((String::from_utf8(id).ok()?, fields))
        })
        .collect()
}

/// The events of one entry: `e <kind> [k <key>] t <ms> [x <error>] <id>
/// <attempt> ...`. An entry lockgate did not write is skipped (and logged).
pub(crate) fn decode(entry: &str, fields: Vec<Value>) -> Vec<Event> {
    let mut fields = fields.into_iter().map(as_bytes);
    let mut next = || fields.next().flatten();
    let (e, kind, mut t) = (next(), next(), next());
    let mut key = None;
    if t.as_deref() == Some(b"k") {
        key = next().map(|k| String::from_utf8_lossy(&k).into_owned());
        t = next();
    }
    let kind = kind.as_deref().and_then(EventKind::parse);
    let ms = next().and_then(|ms| std::str::from_utf8(&ms).ok()?.parse::<u64>().ok());
    let (Some(kind), Some(ms), Some(b"e"), Some(b"t")) = (kind, ms, e.as_deref(), t.as_deref())
    else {
        tracing::warn!(entry, "queue events: malformed entry");
        return Vec::new();
    };
    let error = match kind {
        EventKind::Retried | EventKind::Dead => {
            let (_x, error) = (next(), next());
            error.map(|e| String::from_utf8_lossy(&e).into_owned())
        }
        _ => None,
    };
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
    let mut events = Vec::new();
    while let (Some(id), Some(attempt)) = (next(), next()) {
        let attempt = std::str::from_utf8(&attempt)
            .ok()
            .and_then(|a| a.parse().ok())
            .unwrap_or(0);
        events.push(Event {
            kind,
            id: String::from_utf8_lossy(&id).into_owned(),
            attempt,
            at,
            error: error.clone(),
            key: key.clone(),
            entry: entry.to_owned(),
        });
    }
    events
}
