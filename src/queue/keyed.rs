//! The keyed queue's storage (see docs/keyed.md, "Keyed messages"): a message
//! pushed with a key waits in its key's line, in a partition of the queue
//! (`<prefix>:{<slot tag>}:<queue>:…`, keys in `lua/keyed.lua`); it is
//! claimed only together with the key's lock, the one a
//! [`Locker`](crate::Locker) takes. On one server every key's line is in
//! one partition, the queue's own slot's, so that a claim or a run's end
//! over many keys pays one partition's bookkeeping; on a Redis Cluster a
//! key's partition is in the hash slot of its lock, so that one script
//! sees the lock and the line. A slot's tag is the first decimal number
//! whose text hashes to the slot. The queue's index of partitions,
//! `<prefix>:{<queue>}:partitions`, is a hint written after a push: a
//! partition missing from it is found on the next push to it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, Script};
use tokio::time::Instant;

use super::scripts::Lazy;
use super::{ClaimToken, EventKind, QueueKeys, Recording};
use crate::ReleaseListener;
use crate::error::{Error, Result};
use crate::keys;
use crate::lock::listen::AutoListener;
use crate::lock::{Token, detect_publish};
use crate::script::{Function, Program, run};

mod claim;
pub(crate) use claim::Terms;
mod done;
pub(crate) use done::Ending;
mod mirror;
mod partitions;
pub(crate) use partitions::Sweep;

/// A keyed script's source as loaded: the queue's prelude, the keyed
/// helpers, the script.
fn source(body: &str) -> String {
    super::scripts::with_prelude(&format!("{}\n{body}", include_str!("lua/keyed.lua")))
}

fn script(body: &str) -> Script {
    Script::new(&source(body))
}

/// The body of a keyed script that changes its partition's sets: it runs
/// as a function, and whichever way it returns, `tally` then writes what
/// it changed to the counts and the partition's earliest ready time to
/// `oldest` (see `lua/keyed.lua`), so that reading them costs no scan of
/// the partitions.
fn counted(body: &str) -> String {
    format!(
        "local function changes()\n{body}\nend\nlocal reply = changes()\ntally()\nreturn reply\n"
    )
}

/// A keyed script that takes or gives back permits and admits under rate
/// limits: the permit and rate functions first (see
/// `lock/permits/permits.lua`, `lock/rate/rate.lua`).
fn with_limits(body: &str) -> Script {
    use crate::lock::{permits::PERMITS_LUA, rate::RATE_LUA};
    Script::new(&format!("{PERMITS_LUA}\n{RATE_LUA}\n{}", source(body)))
}

/// A keyed script run as a function of a library of its own (see
/// `crate::script::Function`), with the permit and rate functions as
/// [`with_limits`] has them: its source defines `main`, which each call
/// runs after `begin_call` (a library's state outlives its calls, see
/// `lua/keyed_call.lua`), then `tally`, as [`counted`] does.
fn function(kind: &str, body: &str) -> Function {
    use crate::lock::{permits::PERMITS_LUA, rate::RATE_LUA};
    let begin = include_str!("lua/keyed_call.lua");
    let call = "return function(keys, args)\n  begin_call()\n  local reply = main(keys, args)\n  tally()\n  return reply\nend";
    let source = source(&format!("{begin}\n{body}\n{call}\n"));
    Function::new(kind, &format!("{PERMITS_LUA}\n{RATE_LUA}\n{source}"))
}

/// The keyed push as a script, the same source the library calls as a
/// function: `scripts/push_keyed.lua` (for producers in other languages)
/// must be exactly this (a test checks it).
#[cfg(test)]
pub(crate) fn push_source() -> String {
    let push = include_str!("lua/keyed_push.lua");
    source(&counted(&format!("{push}\nreturn main()")))
}

// The push, a keyed message's claim and its settlement, the calls made
// per message, run as functions: a call runs the function alone, not the
// 170 helpers it needs.
static PUSH: LazyLock<Function> =
    LazyLock::new(|| function("keyed_push", include_str!("lua/keyed_push.lua")));
static CLAIM: LazyLock<Function> =
    LazyLock::new(|| function("keyed_claim", include_str!("lua/keyed_claim.lua")));
static DONE: LazyLock<Function> =
    LazyLock::new(|| function("keyed_done", include_str!("lua/keyed_done.lua")));
/// The function libraries this version loads (see `crate::functions`).
pub(crate) fn libraries() -> [&'static str; 3] {
    [PUSH.name(), CLAIM.name(), DONE.name()]
}

// The other keyed scripts, each hashed once per process.
// (The prelude and the activity counts' functions, without the keyed
// helpers, which it does not use: it runs after every keyed call that
// records events, and a script makes its helpers on every call, see
// `crate::script`.)
static EVENTS: Lazy = LazyLock::new(|| {
    let counting = super::scripts::ACTIVITY_LUA;
    let events = include_str!("lua/keyed_events.lua");
    Script::new(&super::scripts::with_prelude(&format!(
        "{counting}\n{events}"
    )))
});
static EXTEND: Lazy = LazyLock::new(|| with_limits(include_str!("lua/keyed_extend.lua")));
// (It tallies itself, when anything expired.)
static RECOVER: Lazy = LazyLock::new(|| script(include_str!("lua/keyed_recover.lua")));
static KEY_LOADS: Lazy = LazyLock::new(|| script(include_str!("lua/keyed_keys.lua")));
static TAKE_IN: Lazy = LazyLock::new(|| script(&counted(include_str!("lua/keyed_take_in.lua"))));
static PEEK: Lazy = LazyLock::new(|| script(include_str!("lua/keyed_peek.lua")));
static REMOVE: Lazy = LazyLock::new(|| script(&counted(include_str!("lua/keyed_remove.lua"))));
static PURGE: Lazy = LazyLock::new(|| script(&counted(include_str!("lua/keyed_purge.lua"))));
static INDEX_SETTLE: Lazy = LazyLock::new(|| Script::new(include_str!("lua/index_settle.lua")));
static INDEX_HEAL: Lazy = LazyLock::new(|| Script::new(include_str!("lua/index_heal.lua")));
static LEASES_DUE: Lazy = LazyLock::new(|| Script::new(include_str!("lua/keyed_leases_due.lua")));
static LEASES_SETTLE: Lazy = LazyLock::new(|| Script::new(include_str!("lua/leases_settle.lua")));

/// Indexes into [`Partition`]'s keys (the keyed scripts' `KEYS` order).
const DATA: usize = 0;
const LINES: usize = 6;
const READY: usize = 7;
const KEYOF: usize = 8;

const COUNTS: usize = 11;
const OLDEST: usize = 12;
const LEASES: usize = 13;
/// The keys of a partition (its scripts' own keys follow them).
const MORE: usize = 14;
/// The keys of a partition a push names: all but `leases` (it leases
/// nothing), the 13 that producers in other languages send.
const PUSH_KEYS: usize = LEASES;

/// What serves the queue: where its partitions' scripts keep the counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    /// One server: the queue's counts, over every partition.
    Server,
    /// A Redis Cluster: each partition's own.
    Cluster,
}

/// The keys of one partition, in the keyed scripts' order: its own, then
/// where the scripts keep the counts and each partition's earliest ready
/// time (see `lua/keyed.lua`).
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Partition {
    pub(crate) slot: u16,
    keys: [String; MORE],
}

/// The keys the dead-letter scripts (`dead.lua`, `requeue_dead.lua`) work
/// on, `<base>:data`, `<base>:dead`, ...: the queue's own, or a partition's.
#[derive(Debug)]
pub(crate) struct DeadSet {
    pub(crate) base: String,
    /// The partition's slot (re-driven letters make it ready), its `keyof`
    /// hash (where the letters' keys are) and its counts (see
    /// `lua/keyed.lua`); `None` for a shard's.
    pub(crate) partition: Option<(u16, [String; 2])>,
    /// The shard whose set it is (0 for a partition).
    pub(crate) shard: usize,
}

impl Partition {
    /// Slot `slot`'s partition of the queue with keys `queue`. On one
    /// server (`Layout::Server`) its scripts keep the queue's counts, in
    /// the queue's slot; on a cluster, where a script reaches one slot, the
    /// partition's own.
    fn new(queue: &QueueKeys, slot: u16, layout: Layout) -> Self {
        let tag = keys::slot_tag(slot);
        let base = format!("{}:{{{tag}}}:{}", queue.prefix, keys::tag(&queue.name));
        let keys = [
            "data", "schedule", "active", "dead", "errors", "claims", "lines", "ready", "keyof",
            "seq", "limits", "counts", "oldest", "leases",
        ]
        .map(|name| match (name, layout) {
            // On one server the queue's own: read and written once per
            // call, whatever partitions it goes over.
            ("claims" | "seq" | "counts" | "oldest" | "leases", Layout::Server) => {
                format!("{}:keyed:{name}", queue.base)
            }
            _ => format!("{base}:{name}"),
        });
        Self { slot, keys }
    }

    /// Its dead letters' keys. A re-driven letter waits on the schedule
    /// (the queue's format) and the next claim puts it in its key's line;
    /// the bell, priorities and events are names in the partition's slot
    /// that keyed messages leave empty.
    fn dead_set(&self) -> DeadSet {
        // Stripped once: a queue's own name may end in `:data`.
        let data = &self.keys[DATA];
        let base = data.strip_suffix(":data").unwrap_or(data).to_owned();
        let kept = [self.keys[KEYOF].clone(), self.keys[COUNTS].clone()];
        let partition = Some((self.slot, kept));
        DeadSet {
            base,
            partition,
            shard: 0,
        }
    }

    /// An `EVALSHA` of `script` over this partition and `more` keys.
    /// A fresh key for one call's record (see `script::resending`), in
    /// the partition's slot.
    fn record(&self) -> String {
        self.record_of(&Token::random())
    }

    /// The key of the record of the call that draws `token`.
    fn record_of(&self, token: &Token) -> String {
        format!("{}:{}", self.keys[5], token.as_str())
    }

    fn call(&self, script: &Script, more: usize) -> Cmd {
        let mut cmd = script.call(self.keys.len() + more);
        cmd.arg(&self.keys[..]);
        cmd
    }
}

/// A keyed message being pushed ([`Keyed::push`]); `limits` and `when` as
/// the push script takes them (see `lua/keyed_push.lua`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pushing<'a> {
    pub(crate) key: &'a str,
    pub(crate) limits: &'a str,
    pub(crate) id: &'a str,
    pub(crate) when: &'a str,
    pub(crate) payload: &'a [u8],
}

/// What a keyed message's turn at work ends with ([`Keyed::done`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome<'a> {
    /// Handled: the message goes.
    Ack,
    /// A failed attempt: it stays first in line, its key waits `delay`.
    Retry { delay: Duration, error: &'a str },
    /// Put off without using an attempt: first in line, its key waits.
    Defer { delay: Duration },
    /// Back as it was (a worker shutting down).
    Release,
    /// A dead letter; its key's next message comes up.
    Bury { error: &'a str },
    /// Nothing for the message: it goes on at work (the rest of its run
    /// is settled, see [`Keyed::settle_run`]).
    Return,
    /// As `Return`, and the key's next messages claimed into the run while
    /// the message goes on (see [`Keyed::read_ahead`]).
    Ahead,
}

/// How [`Keyed::done`] went.
#[derive(Debug, PartialEq)]
pub(crate) enum Settled {
    /// The claim was no longer held: nothing changed.
    Lost,
    /// Settled; the key's lock was let go.
    Done,
    /// Acknowledged, and the key's next messages (a run, in line order)
    /// claimed under its lock.
    Next(Vec<Turn>),
}

/// A run of a key's messages under one hold (see `lua/keyed_done.lua`): how
/// many next messages a hand-over may claim at once, and the run's other
/// messages this call settles: those handled before this one
/// (acknowledged) and those that will not start (back in line).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunArgs<'a> {
    pub(crate) max: u32,
    pub(crate) handled: &'a [ClaimToken],
    pub(crate) unstarted: &'a [ClaimToken],
}

impl RunArgs<'_> {
    /// One message at a time, no other message settled.
    pub(crate) const ONE: RunArgs<'static> = RunArgs {
        max: 1,
        handled: &[],
        unstarted: &[],
    };

    /// Adds the two lists to a done script's block: a count, then each
    /// message's stored id and seq.
    fn add_to(&self, args: &mut Vec<String>, key: &str) {
        for list in [self.handled, self.unstarted] {
            args.push(list.len().to_string());
            for token in list {
                let seq = token.held.as_ref().map_or("", |held| held.seq.as_str());
                args.extend([stored_id(key, &token.id), seq.to_owned()]);
            }
        }
    }
}

/// A key's lock (or one of its permits), held for a keyed message at work.
#[derive(Debug, PartialEq, Eq, Hash)]
pub(crate) struct Held {
    pub(crate) key: String,
    pub(crate) token: Token,
    /// The key's permits: 0 for its lock.
    pub(crate) permits: u32,
    /// Whether the key has a rate limit (the hand-over to its next asks it).
    pub(crate) rated: bool,
    pub(crate) partition: Arc<Partition>,
    /// How many messages of the key ran under this hold before this one.
    pub(crate) run: u32,
    /// The message's place in its key's line.
    pub(crate) seq: String,
}

impl Held {
    /// The Redis key it holds: the key's lock, or its permits' set.
    fn lock_key(&self, prefix: &str) -> String {
        match self.permits {
            0 => keys::lock_key(prefix, &self.key),
            _ => crate::lock::permits::permits_key(prefix, &self.key),
        }
    }
}

/// A turn the claim script took: key, id, seq, permits, whether the key has
/// a rate limit, and the record.
type Taken = (Vec<u8>, Vec<u8>, Vec<u8>, u32, bool, Vec<u8>);

/// The done script's reply (see `lua/keyed_done.lua`): status, the
/// acknowledged record, the next messages claimed, and which of the run's
/// messages handled before this one it acknowledged (`None`: a resend,
/// whose first call did).
type DoneReply = (u8, Vec<u8>, Next, Option<String>);

/// The next messages a done script's call claimed: whether under a new
/// token, and each one's stored id, seq and record.
type Next = Option<(u8, Vec<(String, String, Vec<u8>)>)>;

/// A key runs at most this many messages back to back under one hold
/// (claimed by acknowledgements, one or a run at a time) while its worker
/// has no slot free; then it lets go and queues behind the keys that wait
/// for a slot.
pub const MAX_RUN: u32 = 32;

/// A keyed message claimed with its key's lock.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Turn {
    pub(crate) held: Arc<Held>,
    pub(crate) id: String,
    pub(crate) claim: u64,
    /// The stored record (the queue's format).
    pub(crate) record: Vec<u8>,
}

/// What a partition holds, as a claim saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// No message at all.
    Nothing,
    /// A message at work.
    AtWork,
    /// Messages, none at work (dead letters, say).
    Waiting,
}

/// Turns claimed across partitions.
#[derive(Debug, Default)]
pub(crate) struct Claimed {
    pub(crate) turns: Vec<Turn>,
    /// When a waiting key or a delayed message is due next (server ms).
    pub(crate) next_at: Option<i64>,
}

impl Claimed {
    /// How many keys' turns it holds (a run's messages count once).
    pub(crate) fn turns_taken(&self) -> usize {
        self.turns.iter().filter(|turn| turn.held.run == 0).count()
    }
}

impl Claimed {
    /// Adds what another claim call took.
    fn absorb(&mut self, more: Claimed) {
        self.turns.extend(more.turns);
        self.due_next(more.next_at);
    }

    /// Keeps `at` if it comes before the next due time known.
    fn due_next(&mut self, at: Option<i64>) {
        if let Some(at) = at {
            self.next_at = Some(self.next_at.map_or(at, |next| next.min(at)));
        }
    }
}

/// `room` split into `n` shares that differ by one at most, the larger first.
pub(crate) fn shares(room: usize, n: usize) -> Vec<usize> {
    (0..n)
        .map(|k| room / n + usize::from(k < room % n))
        .collect()
}

/// How many due partitions a claim names (the queue's claim script) and visits.
pub(crate) const PARTITIONS_PER_CLAIM: usize = 32;

/// A partition (or a shard: see `shards.rs`) is looked at again at the
/// latest this long after a claim found nothing ready in it: the index is a
/// hint.
pub(crate) const RECHECK_MS: i64 = 30_000;

/// How long a claim hides the partitions it visits from other claims: their
/// index entries are raised this far ahead before its scripts and settled
/// after them. A claim that never comes back (its reply timed out, the
/// server froze, the claimer died between the raise and the scripts)
/// hides them no longer than this, about a claim's own timeout (issue 35).
pub(crate) const CLAIMING_MS: i64 = 2_000;

/// The keyed side of a queue, shared by its clones.
#[derive(Debug, Default)]
pub(crate) struct KeyedState {
    pub(crate) publish: tokio::sync::OnceCell<&'static str>,
    /// Per partition, the ready keys its last claim named.
    candidates: Mutex<HashMap<u16, Vec<String>>>,
    /// Hears the releases of locks other code held while messages of their
    /// keys waited (a worker's queue has one).
    pub(crate) listener: OnceLock<Arc<AutoListener>>,
    /// The keys whose release is being listened for.
    watched: Mutex<HashSet<String>>,
    /// On a cluster, the partitions changed and not yet copied into the
    /// queue's slot (see `mirror`).
    copies: mirror::Copies,
}

/// A queue's keyed messages.
pub(crate) struct Keyed<'a, C> {
    pub(crate) conn: &'a C,
    pub(crate) keys: &'a Arc<QueueKeys>,
    pub(crate) state: &'a Arc<KeyedState>,
    pub(crate) recording: Recording,
}

/// The events and completed messages a keyed script's change calls for,
/// appended to the queue's streams after it (`lua/keyed_events.lua`): a
/// key's line lives in its lock's hash slot, the streams in the queue's.
#[derive(Debug, Default)]
pub(crate) struct Log {
    entries: Vec<Entry>,
    completed: Vec<(String, Vec<u8>)>,
}

/// One events entry: a kind, the key, the error, (id, attempt) pairs.
#[derive(Debug)]
struct Entry {
    kind: EventKind,
    key: String,
    error: String,
    pairs: Vec<(String, u32)>,
}

impl Log {
    /// Adds what `other` logged after what this one did.
    fn append(&mut self, other: Log) {
        for entry in other.entries {
            for (id, attempt) in &entry.pairs {
                self.with_error(entry.kind, &entry.key, &entry.error, (id, *attempt));
            }
        }
        self.completed.extend(other.completed);
    }

    /// Logs `kind` for message `id` (`attempt`) of `key` ("" for none).
    pub(crate) fn event(&mut self, kind: EventKind, key: &str, (id, attempt): (&str, u32)) {
        self.with_error(kind, key, "", (id, attempt));
    }

    /// Logs `Done` (and the completed entry, of those `completed` holds)
    /// for each of the run's messages `handled` that the done script
    /// acknowledged: by `flags`, one `1` or `0` each, in order (`None`, a
    /// resend's: all of them, the first call did). One listed may have
    /// left its turn before: acknowledged by an earlier call that listed
    /// it, or back in line after its lease ran out.
    fn handled(
        &mut self,
        held: &Held,
        handled: &[ClaimToken],
        flags: Option<&str>,
        mut completed: Vec<(String, Vec<u8>)>,
    ) {
        let acked = |n: usize| flags.is_none_or(|f| f.as_bytes().get(n) == Some(&b'1'));
        let mut skipped = HashSet::new();
        for (n, token) in handled.iter().enumerate() {
            match acked(n) {
                true => self.event(EventKind::Done, &held.key, (&token.id, token.attempt())),
                false => _ = skipped.insert(token.id.as_str()),
            }
        }
        completed.retain(|(id, _)| !skipped.contains(id.as_str()));
        self.completed.extend(completed);
    }

    fn with_error(&mut self, kind: EventKind, key: &str, error: &str, (id, attempt): (&str, u32)) {
        let pair = (id.to_owned(), attempt);
        if let Some(last) = self.entries.last_mut()
            && last.kind == kind
            && last.key == key
            && last.error == error
        {
            last.pairs.push(pair);
            return;
        }
        self.entries.push(Entry {
            kind,
            key: key.to_owned(),
            error: error.to_owned(),
            pairs: vec![pair],
        });
    }
}

/// A keyed message's id as its partition stores it, `<key>\0<id>`: an
/// id is unique within its key (see `stored_id` in `lua/keyed.lua`).
pub(crate) fn stored_id(key: &str, id: &str) -> String {
    format!("{key}\0{id}")
}

/// The message's own id in `stored`, the stored id of a message of `key`.
fn own_id(key: &str, stored: &str) -> String {
    let id = stored
        .strip_prefix(key)
        .and_then(|rest| rest.strip_prefix('\0'));
    id.unwrap_or(stored).to_owned()
}

/// A stored id's key and own id (see [`stored_id`]); `None` for an id
/// stored without its key (a message left by a version before ids were
/// per key).
pub(crate) fn split_stored(stored: &str) -> Option<(&str, &str)> {
    stored.split_once('\0')
}

/// The attempt a record's next delivery is (its failures plus one).
fn attempt_of(record: &[u8]) -> u32 {
    super::job::split_record(record).map_or(1, |r| r.failures.saturating_add(1))
}

/// Locks `mutex`, held for a copy or an update: nothing can poison it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// The partition of `slot`; `key`'s line is in `partition_slot(key)`'s.
    async fn partition(&self, slot: u16) -> Result<Arc<Partition>> {
        Ok(self.partition_in(slot, self.layout().await?))
    }

    /// The slot of the partition that holds `key`'s line: on one server the
    /// queue's own, whatever the key (one partition: a call over many keys
    /// pays one partition's bookkeeping, not one per key's slot); on a
    /// cluster the slot of the key's lock, so that a script reaches both.
    /// (Messages a version before this one pushed on one server are in the
    /// partitions of their locks' slots: they are claimed from there, as
    /// any partition the index names.)
    pub(crate) fn partition_slot(&self, key: &str, layout: Layout) -> u16 {
        match layout {
            Layout::Cluster => keys::lock_slot(key),
            // The slot of the queue's own keys, `{<queue>}`.
            Layout::Server => keys::slot_of(&keys::tag(&self.keys.name)),
        }
    }

    /// The partition of `slot` in `layout`.
    fn partition_in(&self, slot: u16, layout: Layout) -> Arc<Partition> {
        Arc::new(Partition::new(self.keys, slot, layout))
    }

    /// Whether the server is a cluster, found out once per queue handle.
    pub(crate) async fn layout(&self) -> Result<Layout> {
        Ok(match self.is_cluster().await? {
            true => Layout::Cluster,
            false => Layout::Server,
        })
    }

    /// Pushes keyed messages in one script call (see
    /// `lua/keyed_push.lua`): `parts` are each partition's messages (slot,
    /// messages with the caller's place for each), several only on one
    /// server. Returns per message, in order, whether it was added and its
    /// due time (-1 when it is not waiting for one). The caller marks the
    /// partitions ready afterwards ([`mark_ready`](Self::mark_ready)).
    pub(crate) async fn push(
        &self,
        parts: &[(u16, &[(usize, Pushing<'_>)])],
    ) -> Result<Vec<(bool, i64)>> {
        let layout = self.layout().await?;
        let partitions = parts
            .iter()
            .map(|(slot, _)| self.partition_in(*slot, layout));
        let partitions: Vec<Arc<Partition>> = partitions.collect();
        let mut cmd = PUSH.call(partitions.len() * PUSH_KEYS);
        for partition in &partitions {
            cmd.arg(&partition.keys[..PUSH_KEYS]);
        }
        if parts.len() > 1 {
            for (_, messages) in parts {
                cmd.arg(messages.len());
            }
        }
        let messages = parts.iter().flat_map(|(_, messages)| messages.iter());
        let count = messages.clone().count();
        for (_, m) in messages.clone() {
            cmd.arg(m.key)
                .arg(m.limits)
                .arg(m.id)
                .arg(m.when)
                .arg(m.payload);
        }
        let attempted = || format!("pushing keyed messages to queue `{}`", self.keys.name);
        let reply: Result<Vec<i64>> = self.run(&PUSH, &cmd, attempted).await;
        // Whether it ran or not (a reply lost after it ran).
        self.changed(parts.iter().map(|(slot, _)| *slot));
        let reply = reply?;
        if reply.len() != 2 * count {
            return Err(Error::reply(attempted(), format_args!("{reply:?}")));
        }
        let pushed: Vec<(bool, i64)> = reply.chunks(2).map(|r| (r[0] == 1, r[1])).collect();
        if self.recording.events.is_some() {
            let mut log = Log::default();
            for ((_, m), _) in messages.zip(&pushed).filter(|(_, (added, _))| *added) {
                log.event(EventKind::Pushed, m.key, (m.id, 1));
            }
            self.record(log).await;
        }
        Ok(pushed)
    }

    /// Takes message `id` of the queue's own keys (with its `record`) into
    /// `key`'s line after `delay_ms`, counting a deferral; returns whether
    /// it was added (not there already) and its due time.
    pub(crate) async fn take_in(
        &self,
        (key, limits): (&str, &str),
        id: &str,
        delay_ms: u64,
        record: &[u8],
    ) -> Result<(bool, i64)> {
        let layout = self.layout().await?;
        let partition = self.partition_in(self.partition_slot(key, layout), layout);
        let mut cmd = partition.call(&TAKE_IN, 0);
        cmd.arg(key).arg(limits).arg(id).arg(delay_ms).arg(record);
        let attempted = || format!("deferring message `{id}` into the line of key `{key}`");
        let taken = self.run(&TAKE_IN, &cmd, attempted).await;
        self.changed([partition.slot]);
        let (added, due): (i64, i64) = taken?;
        // The mark is what makes the copy found (the partition may be new
        // to the index): tried again a few times before the deferral fails
        // (then the original is retried, and may run beside the copy).
        let mut pause = Duration::from_millis(50);
        for _ in 0..3 {
            match self.mark_ready(partition.slot, attempted).await {
                Ok(()) => return Ok((added == 1, due)),
                Err(error) => {
                    tracing::warn!(%error, "could not mark a keyed partition ready; trying again")
                }
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
        self.mark_ready(partition.slot, attempted).await?;
        Ok((added == 1, due))
    }

    /// Appends what `log` holds to the queue's events stream (when the
    /// handle records events) and completed stream, after the keyed script
    /// that made the change. A failure here leaves the messages as the
    /// script left them: it is logged, not returned.
    pub(crate) async fn record(&self, log: Log) {
        let events = self.recording.events.filter(|_| !log.entries.is_empty());
        if events.is_none() && log.completed.is_empty() {
            return;
        }
        let mut cmd = EVENTS.call(3);
        let (count, age) = self.recording.completed.unwrap_or_default().args();
        cmd.arg(&self.keys.events)
            .arg(&self.keys.completed)
            .arg(&self.keys.activity)
            .arg(events.map_or(String::new(), |cap| cap.to_string()))
            .arg(count)
            .arg(age)
            .arg(events.map_or(0, |_| log.entries.len()));
        for entry in log.entries.iter().filter(|_| events.is_some()) {
            cmd.arg(entry.kind.as_str())
                .arg(&entry.key)
                .arg(&entry.error)
                .arg(entry.pairs.len());
            for (id, attempt) in &entry.pairs {
                cmd.arg(id).arg(attempt);
            }
        }
        for (id, record) in &log.completed {
            cmd.arg(id).arg(record);
        }
        if let Err(error) = run::<()>(&EVENTS, &cmd, &mut self.conn.clone()).await {
            tracing::warn!(queue = %self.keys.name, %error, "could not record the events or completed messages of keyed messages; the messages are unaffected");
        }
    }

    /// Marks a partition as having a ready key after a script changed it
    /// already: a failure is logged, not returned, for the change stands
    /// and its caller must not take it for a failed one (a resend would be
    /// refused, and counted as a lost lease). Unmarked, the partition waits
    /// for its index entry's next look: 2 s at most after a claim found a
    /// message at work there (see [`CLAIMING_MS`]).
    async fn mark_after(&self, slot: u16) {
        self.mark_all_after(&[slot]).await;
    }

    /// Marks partitions as having a ready key after a change (see
    /// [`mark_after`](Self::mark_after)).
    async fn mark_all_after(&self, slots: &[u16]) {
        let attempted = || format!("marking a partition of queue `{}` ready", self.keys.name);
        if let Err(error) = self.mark_all_ready(slots, attempted).await {
            tracing::warn!(queue = %self.keys.name, %error, "could not mark a keyed partition ready after a change; the index's next look finds it");
        }
    }

    /// Marks a partition as having a ready key, and rings the doorbell.
    async fn mark_ready(&self, slot: u16, attempted: impl FnOnce() -> String) -> Result<()> {
        self.mark_all_ready(&[slot], attempted).await
    }

    /// Marks partitions as having a ready key (one command), and rings the
    /// doorbell: one round trip after a push to many partitions.
    pub(crate) async fn mark_all_ready(
        &self,
        slots: &[u16],
        attempted: impl FnOnce() -> String,
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        let mut hint = redis::pipe();
        let index = hint.cmd("ZADD").arg(&self.keys.partitions).arg("LT");
        for slot in slots {
            index.arg(0).arg(slot);
        }
        index.ignore();
        hint.lpush(&self.keys.bell, 1).ignore();
        hint.ltrim(&self.keys.bell, 0, 0).ignore();
        let done = hint.query_async(&mut self.conn.clone()).await;
        done.map_err(|e| Error::redis(attempted())(e))
    }

    /// Sends `cmd`, a call of `program` (see `crate::script::run`).
    async fn run<R: FromRedisValue>(
        &self,
        program: &impl Program,
        cmd: &Cmd,
        attempted: impl FnOnce() -> String,
    ) -> Result<R> {
        let reply = run(program, cmd, &mut self.conn.clone()).await;
        reply.map_err(|e| Error::redis(attempted())(e))
    }

    /// Whether the connection is to a Redis Cluster.
    pub(crate) async fn is_cluster(&self) -> Result<bool> {
        let publish = detect_publish(&self.state.publish, self.conn).await;
        let publish = publish.map_err(Error::redis(format!(
            "looking up queue `{}`",
            self.keys.name
        )))?;
        Ok(publish != "PUBLISH")
    }

    /// Makes `key` ready at once if it waits (for a lock other code held,
    /// whose release was published). On one server, in the partition of its
    /// lock's slot too, where lockgate 0.1 kept a key's line (a key with
    /// messages on both sides of the upgrade may wait there while the other
    /// partition's message holds its lock), marked in the index only if the
    /// key waited there: an empty partition is never put in the index, where
    /// each claim would visit it for nothing.
    pub(crate) async fn unblock(&self, key: &str) -> Result<()> {
        let layout = self.layout().await?;
        let own = self.partition_slot(key, layout);
        let old = (layout == Layout::Server)
            .then(|| keys::lock_slot(key))
            .filter(|slot| *slot != own);
        // LT: a key at work (its score below 0) stays so; CH: whether it
        // waited.
        let mut wake = redis::pipe();
        for slot in std::iter::once(own).chain(old) {
            let partition = self.partition_in(slot, layout);
            let ready = wake.cmd("ZADD").arg(&partition.keys[READY]);
            ready.arg(&["XX", "LT", "CH", "0", key]);
        }
        let attempted = || format!("waking key `{key}`");
        let woken: redis::RedisResult<Vec<i64>> = wake.query_async(&mut self.conn.clone()).await;
        let woken = woken.map_err(|e| Error::redis(attempted())(e))?;
        let mut slots = vec![own];
        slots.extend(old.filter(|_| woken.get(1).is_some_and(|n| *n > 0)));
        self.mark_all_ready(&slots, attempted).await
    }

    /// Extends turns' leases and their keys' locks or permits in one call
    /// (`lua/keyed_extend.lua`): `turns` (each a hold, the message's id
    /// and its claim) all on one server, or all in one slot on a cluster.
    /// Per turn, `false` when its claim or its hold is lost.
    pub(crate) async fn extend(
        &self,
        turns: &[(&Held, &str, u64)],
        lease: Duration,
    ) -> Result<Vec<bool>> {
        let mut cmd = EXTEND.call(turns.len() * (MORE + 1));
        for (held, ..) in turns {
            cmd.arg(&held.partition.keys[..])
                .arg(held.lock_key(&self.keys.prefix));
        }
        cmd.arg(millis(lease));
        for (held, id, claim) in turns {
            let member = format!(
                "{}\0{}\0{}:{claim}",
                held.key,
                held.seq,
                stored_id(&held.key, id)
            );
            cmd.arg(member).arg(held.token.as_str()).arg(held.permits);
        }
        let attempted = || format!("extending {} keyed message(s)", turns.len());
        let held: Vec<i64> = self.run(&EXTEND, &cmd, attempted).await?;
        if held.len() != turns.len() {
            let detail = format_args!("{} values for {} leases", held.len(), turns.len());
            return Err(Error::reply(attempted(), detail));
        }
        Ok(held.into_iter().map(|held| held == 1).collect())
    }
}

/// The release listener once it is open (it opens in the background on
/// first need), or `None` if it is not by `until`.
async fn opened(auto: &Arc<AutoListener>, until: Instant) -> Option<ReleaseListener> {
    loop {
        if let Some(listener) = auto.get() {
            return Some(listener);
        }
        if Instant::now() >= until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
