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
//! shows what those cost, not a design to ship.

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
    Ok(redis::cmd("HLEN")
        .arg(KEYS[1])
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
            let pause = tokio::time::sleep(std::time::Duration::from_millis(2));
            tokio::select! {
                () = pause => {}
                _ = stop.changed() => {}
            }
            continue;
        }
        let mut ack = ACK.key(&KEYS[..]);
        for message in claimed.chunks(4) {
            let [key, id, token, payload] = message else {
                return Err("the floor's claim answered a partial message".into());
            };
            handle(payload);
            ack.arg(key).arg(id).arg(token);
        }
        let _: usize = ack.invoke_async(&mut conn).await?;
    }
    Ok(())
}
