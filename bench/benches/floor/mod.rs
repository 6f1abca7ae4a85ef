//! The floor of a keyed message's cost on Redis, beside the keyed queue in
//! the many-keys part: the least a queue can do and still run each key's
//! messages one at a time, in push order, under the key's lock (`SET NX
//! PX`), with nothing lost when a worker dies. A key's line is a list; the
//! lock is the lease (a message at work stays at the head of its line until
//! acknowledged, and its key is looked at again when the lease ends); the
//! ready set's score says when to look at a key. Two scripts: a claim takes
//! the heads of up to 8 ready keys, an acknowledgement settles what a claim
//! took. It has none of the keyed queue's other duties (hash slots for a
//! cluster, runs, permits and rate limits, delays, retries and dead
//! letters, fences, resend records, counts and indexes for readers): it
//! shows what those cost, not a design to ship. Its scripts build a key's
//! lock and line names themselves; [`work_declared`]'s are given them, as
//! the keyed queue's scripts must be (every key a script touches declared,
//! for a Redis Cluster and ACLs): a claim takes among the keys its last
//! call named, and names the next call's.

use std::sync::LazyLock;

use lockgate::BoxError;
use redis::Script;
use redis::aio::ConnectionManager;

const KEYS: [&str; 3] = ["floor:ready", "floor:data", "floor:counts"];
/// A claim's lease (ms): longer than the run, so nothing comes back.
const LEASE_MS: u64 = 30_000;
/// The most keys a claim takes.
const BATCH: usize = 8;

static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("claim.lua")));
static ACK: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("ack.lua")));
static CLAIM_DECLARED: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("claim_declared.lua")));
/// How many ready keys a declared claim names for the next (as the keyed
/// queue's claim of 8 turns does).
const NAMES: usize = 16;

/// Pushes `messages` (key, payload), in order, in pipelines of 1,000.
pub async fn push(conn: &ConnectionManager, messages: &[(String, String)]) -> Result<(), BoxError> {
    for (chunk_at, chunk) in messages.chunks(1000).enumerate() {
        let mut pipe = redis::pipe();
        for (i, (key, payload)) in chunk.iter().enumerate() {
            let id = format!("m{}", chunk_at * 1000 + i);
            pipe.hset(KEYS[1], &id, payload).ignore();
            pipe.rpush(format!("floor:line:{key}"), &id).ignore();
            pipe.cmd("ZADD")
                .arg(KEYS[0])
                .arg("NX")
                .arg(0)
                .arg(key)
                .ignore();
        }
        pipe.query_async::<()>(&mut conn.clone()).await?;
    }
    Ok(())
}

/// How many messages are not acknowledged yet.
pub async fn left(conn: &ConnectionManager) -> Result<u64, BoxError> {
    records_left(conn, KEYS[1]).await
}

/// How many records the hash `data` holds: the messages not acknowledged.
async fn records_left(conn: &ConnectionManager, data: &str) -> Result<u64, BoxError> {
    Ok(redis::cmd("HLEN")
        .arg(data)
        .query_async(&mut conn.clone())
        .await?)
}

/// One worker loop: claims, hands each payload to `handle` (no-op
/// handlers), acknowledges what it claimed in one call; until `stop`.
pub async fn work(
    conn: ConnectionManager,
    mut handle: impl FnMut(&str),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), BoxError> {
    let prefix = format!("{:032x}:", rand::random::<u128>());
    let mut conn = conn;
    while !*stop.borrow() {
        let claimed: Vec<String> = CLAIM
            .key(&KEYS[..])
            .arg(LEASE_MS)
            .arg(BATCH)
            .arg(&prefix)
            .invoke_async(&mut conn)
            .await?;
        if claimed.is_empty() {
            pause(&mut stop).await;
            continue;
        }
        acknowledge(&mut conn, &claimed, &mut handle, false).await?;
    }
    Ok(())
}

/// The names of `key`'s lock and line.
fn lock_and_line(key: &str) -> [String; 2] {
    [format!("floor:lock:{key}"), format!("floor:line:{key}")]
}

/// [`work`] with every key a script touches declared (`claim_declared.lua`,
/// and `ack.lua` given each message's lock and line): a claim takes among
/// the keys its last call named, as the keyed queue's does.
pub async fn work_declared(
    conn: ConnectionManager,
    mut handle: impl FnMut(&str),
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), BoxError> {
    let prefix = format!("{:032x}:", rand::random::<u128>());
    let mut conn = conn;
    let mut named: Vec<String> = Vec::new();
    while !*stop.borrow() {
        let mut claim = CLAIM_DECLARED.key(&KEYS[..]);
        for key in &named {
            claim.key(&lock_and_line(key)[..]);
        }
        claim
            .arg(LEASE_MS)
            .arg(BATCH)
            .arg(&prefix)
            .arg(NAMES)
            .arg(rand::random::<u32>())
            .arg(&named[..]);
        let (next, claimed): (Vec<String>, Vec<String>) = claim.invoke_async(&mut conn).await?;
        let idle = claimed.is_empty() && (named.is_empty() || next.is_empty());
        named = next;
        if idle {
            pause(&mut stop).await;
        } else if !claimed.is_empty() {
            acknowledge(&mut conn, &claimed, &mut handle, true).await?;
        }
    }
    Ok(())
}

/// Waits 2 ms, or until `stop` changes.
async fn pause(stop: &mut tokio::sync::watch::Receiver<bool>) {
    let pause = tokio::time::sleep(std::time::Duration::from_millis(2));
    tokio::select! {
        () = pause => {}
        _ = stop.changed() => {}
    }
}

/// Hands each of the `claimed` messages (key, id, token, payload each) to
/// `handle`, then acknowledges them in one call; `declared`: naming each
/// one's lock and line.
async fn acknowledge(
    conn: &mut ConnectionManager,
    claimed: &[String],
    handle: &mut impl FnMut(&str),
    declared: bool,
) -> Result<(), BoxError> {
    let mut ack = ACK.key(&KEYS[..]);
    for message in claimed.chunks(4) {
        let [key, id, token, payload] = message else {
            return Err("the floor's claim answered a partial message".into());
        };
        handle(payload);
        if declared {
            ack.key(&lock_and_line(key)[..]);
        }
        ack.arg(key).arg(id).arg(token);
    }
    let _: usize = ack.invoke_async(conn).await?;
    Ok(())
}

pub mod lean;
