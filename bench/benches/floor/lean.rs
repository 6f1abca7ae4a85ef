//! The lean layout: the declared floor with the keyed queue's duties that
//! a lone key's turn pays (`lean_claim.lua`, `lean_ack.lua`), laid out as
//! a redesign of the keyed queue would be (issue 35, item 9):
//!
//! * a key's line is a sorted set of its own, its messages' ids by push
//!   order (a place in line found in O(log n), where a list would need a
//!   scan to put a deferred message back at its place);
//! * a message at work stays at the head of its line until settled, under
//!   the key's lock, which is the lease: no set of messages at work, and a
//!   run is the line's first messages, whatever the worker's fate;
//! * a key's score in `keys` says ready from when, or at work until when
//!   (`BUSY` + its lease deadline): a key whose lease ran out is named by
//!   the claims, and the claim that finds its lock free takes its head
//!   again, counting a stall; recovery needs no sweep and no index;
//! * runs of a key's first messages under one lock, and an acknowledgement
//!   that hands the key over to its next run;
//! * the counts, the earliest ready time, the candidates' limits (a key's
//!   in one field) and a resend record once per call;
//! * a turn's token of its own (the call's claim number), an
//!   acknowledgement that hands over only a turn whose messages were
//!   still in line, and a resend answered from its call's record.
//!
//! Not the keyed queue's other duties (hash slots for a cluster, the paths
//! of keys with permits or a rate, delays, retries and dead letters,
//! fences, a lock handed to waiters, read ahead): what a keyed queue laid
//! out this way would cost, to weigh a redesign by, not a design to ship.
//! Its worker is a bare loop (no service, no renewals), so its msg/s at
//! few keys is its client's; the server's µs per message compare.

use std::sync::LazyLock;

use lockgate::BoxError;
use redis::Script;
use redis::aio::ConnectionManager;

const KEYS: [&str; 4] = ["lean:keys", "lean:data", "lean:counts", "lean:oldest"];
/// The claim's keys after its record: the keys' limits, the delayed messages.
const CLAIM_KEYS: [&str; 2] = ["lean:limits", "lean:schedule"];
/// A turn's lease (ms): longer than the run, so nothing comes back.
const LEASE_MS: u64 = 30_000;
/// The most turns a claim takes, and the most messages a turn runs.
const TURNS: usize = 8;
const RUN: usize = 8;
/// How many ready keys a claim names for the next.
const NAMES: usize = 16;

static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lean_claim.lua")));
static ACK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lean_ack.lua")));

/// A turn: its key, its token, and its run's messages (id, payload).
struct Turn {
    key: String,
    token: String,
    run: Vec<(String, String)>,
}

/// The names of `key`'s lock and line.
fn lock_and_line(key: &str) -> [String; 2] {
    [format!("lean:lock:{key}"), format!("lean:line:{key}")]
}

/// Pushes `messages` (key, payload), in order, in pipelines of 1,000, then
/// sets the counts.
pub async fn push(conn: &ConnectionManager, messages: &[(String, String)]) -> Result<(), BoxError> {
    for (chunk_at, chunk) in messages.chunks(1000).enumerate() {
        let mut pipe = redis::pipe();
        for (i, (key, payload)) in chunk.iter().enumerate() {
            let id = format!("m{}", chunk_at * 1000 + i);
            pipe.hset(KEYS[1], &id, payload).ignore();
            let seq = chunk_at * 1000 + i;
            pipe.zadd(lock_and_line(key)[1].as_str(), &id, seq).ignore();
            pipe.cmd("ZADD")
                .arg(KEYS[0])
                .arg("NX")
                .arg(0)
                .arg(key)
                .ignore();
        }
        pipe.query_async::<()>(&mut conn.clone()).await?;
    }
    let keys: u64 = redis::cmd("ZCARD")
        .arg(KEYS[0])
        .query_async(&mut conn.clone())
        .await?;
    redis::cmd("HSET")
        .arg(KEYS[2])
        .arg("lines")
        .arg(messages.len())
        .arg("keys")
        .arg(keys)
        .query_async::<()>(&mut conn.clone())
        .await?;
    Ok(())
}

/// How many messages are not acknowledged yet.
pub async fn left(conn: &ConnectionManager) -> Result<u64, BoxError> {
    super::records_left(conn, KEYS[1]).await
}

/// One worker loop: claims among the keys its last claim named, hands
/// each payload to `handle` (no-op handlers) and acknowledges the turns in
/// one call, which hands busy keys over to their next runs; until `stop`.
pub async fn work(
    conn: ConnectionManager,
    mut handle: impl FnMut(&str),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), BoxError> {
    let prefix = format!("{:032x}:", rand::random::<u128>());
    let mut conn = conn;
    let mut named: Vec<String> = Vec::new();
    while !*stop.borrow() {
        let (next, turns) = claim(&mut conn, &prefix, &named).await?;
        let idle = turns.is_empty() && (named.is_empty() || next.is_empty());
        named = next;
        if idle {
            super::pause(&mut stop).await;
            continue;
        }
        let mut turns = turns;
        while !turns.is_empty() {
            for turn in &turns {
                turn.run.iter().for_each(|(_, payload)| handle(payload));
            }
            turns = acknowledge(&mut conn, &turns).await?;
        }
    }
    Ok(())
}

/// A claim among the keys `named`: the keys it names for the next, and
/// the turns it took.
async fn claim(
    conn: &mut ConnectionManager,
    prefix: &str,
    named: &[String],
) -> Result<(Vec<String>, Vec<Turn>), BoxError> {
    let mut claim = CLAIM.key(&KEYS[..]);
    claim.key(format!("lean:record:{prefix}{}", rand::random::<u64>()));
    claim.key(&CLAIM_KEYS[..]);
    for key in named {
        claim.key(&lock_and_line(key)[..]);
    }
    claim
        .arg(LEASE_MS)
        .arg(TURNS)
        .arg(RUN)
        .arg(prefix)
        .arg(NAMES)
        .arg(rand::random::<u32>())
        .arg(named);
    let (next, flat): (Vec<String>, Vec<String>) = claim.invoke_async(conn).await?;
    let mut turns = Vec::new();
    let mut at = flat.into_iter();
    while let (Some(key), Some(token), Some(_stalled)) = (at.next(), at.next(), at.next()) {
        let mut run = Vec::new();
        loop {
            match at.next() {
                Some(id) if !id.is_empty() => {
                    let payload = at.next().ok_or("the lean claim answered a partial run")?;
                    run.push((id, payload));
                }
                _ => break,
            }
        }
        turns.push(Turn { key, token, run });
    }
    Ok((next, turns))
}

/// Acknowledges `turns` in one call: the turns handed over to their keys'
/// next runs.
async fn acknowledge(conn: &mut ConnectionManager, turns: &[Turn]) -> Result<Vec<Turn>, BoxError> {
    let mut ack = ACK.key(&KEYS[..]);
    ack.key(format!("lean:record:{:032x}", rand::random::<u128>()));
    ack.arg(LEASE_MS).arg(RUN);
    for turn in turns {
        ack.key(&lock_and_line(&turn.key)[..]);
        ack.arg(&turn.key).arg(&turn.token).arg(turn.run.len());
        for (id, _) in &turn.run {
            ack.arg(id);
        }
    }
    let replies: Vec<Vec<String>> = ack.invoke_async(conn).await?;
    let mut next = Vec::new();
    for (turn, reply) in turns.iter().zip(replies) {
        match reply.get(1).map(String::as_str) {
            Some("2") => {
                let run = (reply[2..].chunks(2))
                    .map(|pair| (pair[0].clone(), pair.get(1).cloned().unwrap_or_default()))
                    .collect();
                let (key, token) = (turn.key.clone(), turn.token.clone());
                next.push(Turn { key, token, run });
            }
            Some("1") => {}
            _ => return Err(format!("the lean acknowledgement lost key {}", turn.key).into()),
        }
    }
    Ok(next)
}
