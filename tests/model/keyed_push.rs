//! The keyed producer script (`scripts/push_keyed.lua`, what producers in
//! other languages load) called with arbitrary arguments, held to the same
//! contract as the unkeyed one (`push.rs`, issue 37): every call is either
//! accepted exactly as the model says, or refused with a `lockgate push:`
//! error before anything is written.
//!
//! The contract, restated independently of the Lua: arguments are
//! quintuples (key, limits, id, when, payload); a key is non-empty UTF-8
//! without NUL, an id non-empty UTF-8 (every reader takes both for
//! strings); limits are empty, `<permits>` (1 to 1,048,576, no leading
//! zero), `<permits>/<rate>` or `/<rate>`, a rate `<l>/<p>/<b>/<w>` of
//! positive numbers (at most 7, 15, -, 15 digits) with `b <= l`; `when`
//! as the unkeyed script's, without a priority; a payload any bytes but
//! those starting with digits and a colon. An accepted call answers one
//! flat list, two entries per message: added (1 for an id new to its key,
//! 0 for one there already under that key, also from earlier in the same
//! call; the same id under another key of the partition is another message)
//! and, for a new message, its due time (at or before now: in line at
//! once), for an id already there its due time while it waits to be due,
//! else -1; an id already there is left as it is.
//!
//! A call may also take several partitions (13 keys each, on one server):
//! then the arguments start with one count per partition, how many of the
//! quintuples that follow go to it, in the keys' order; counts that do not
//! add up to the quintuples are refused. Each message lands in the
//! partition it was sent to, and the counts (kept for all the partitions,
//! as on one server) add them all up.

use std::collections::BTreeMap;

use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support;

/// The first due time refused (ms since 1970: the year 2286).
const BEYOND: i64 = 10_000_000_000_000;

/// The partition's keys, in the script's order (its own counts, as on a
/// Redis Cluster).
const NAMES: [&str; 13] = [
    "data", "schedule", "active", "dead", "errors", "claims", "lines", "ready", "keyof", "seq",
    "limits", "counts", "oldest",
];

/// Partitions a history's calls draw from.
const PARTITIONS: usize = 3;

/// One message of a call: key, limits, id, when, payload.
type Quintuple = (Vec<u8>, String, Vec<u8>, String, Vec<u8>);

#[derive(Debug, Clone)]
struct Call {
    /// The partitions called, each with its messages, in the call's order.
    parts: Vec<(usize, Vec<Quintuple>)>,
    /// An argument too many (not a whole quintuple).
    dangling: bool,
    /// With several partitions, the first count one too many.
    miscounted: bool,
}

impl Call {
    /// Every message, with its partition, in the call's order.
    fn messages(&self) -> impl Iterator<Item = (usize, &Quintuple)> {
        (self.parts.iter()).flat_map(|(p, messages)| messages.iter().map(move |m| (*p, m)))
    }
}

fn text_or_bytes(names: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => prop::sample::select(names).prop_map(|n| n.as_bytes().to_vec()),
        1 => Just(Vec::new()),
        1 => Just(b"k\0nul".to_vec()),
        2 => prop::collection::vec(any::<u8>(), 1..6),
    ]
}

fn limits() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => Just(String::new()),
        2 => "[1-9][0-9]{0,2}",
        1 => "0|01|2000000|x|2/|/",
        1 => "[0-9]{0,2}/[0-9]{1,2}/[0-9]{1,7}/[0-9]{1,2}/[0-9]{1,7}",
        1 => "[0-9/x]{0,8}",
    ]
}

fn when() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => "[0-9]{1,4}",
        1 => "-[0-9]{1,15}",
        1 => "@[0-9]{1,15}",
        1 => "[0-9]{12,17}",
        1 => "[0-9]{1,3}/[0-9]",
        1 => any::<String>(),
    ]
}

fn call() -> impl Strategy<Value = Call> {
    let payload = prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..12),
        1 => "[0-9]{0,3}:?[a-z:]{0,3}".prop_map(String::into_bytes),
    ];
    let key = text_or_bytes(&["a", "b", "c"]);
    let id = text_or_bytes(&["m0", "m1", "m2", "m3"]);
    let message = (key, limits(), id, when(), payload);
    let part = prop::collection::vec(message, 0..4);
    let parts = prop::collection::vec(part, 1..=PARTITIONS);
    let order = Just((0..PARTITIONS).collect::<Vec<_>>()).prop_shuffle();
    (
        parts,
        order,
        prop::bool::weighted(0.05),
        prop::bool::weighted(0.05),
    )
        .prop_map(|(parts, order, dangling, miscounted)| Call {
            parts: order.into_iter().zip(parts).collect(),
            dangling,
            miscounted,
        })
}

/// Whether `limits` is what the contract accepts.
fn limits_ok(limits: &str) -> bool {
    let (permits, rate) = match limits.split_once('/') {
        Some((permits, rate)) => (permits, Some(rate)),
        None => (limits, None),
    };
    let permits_ok = permits.is_empty()
        || (!permits.starts_with('0')
            && permits.len() <= 7
            && permits.bytes().all(|b| b.is_ascii_digit())
            && permits.parse::<u32>().is_ok_and(|n| n <= 1_048_576));
    permits_ok && rate.is_none_or(rate_ok)
}

fn rate_ok(rate: &str) -> bool {
    let parts: Vec<&str> = rate.split('/').collect();
    let number =
        |p: &&str| !p.is_empty() && !p.starts_with('0') && p.bytes().all(|b| b.is_ascii_digit());
    if parts.len() != 4 || !parts.iter().all(number) {
        return false;
    }
    let (l, p, b, w) = (parts[0], parts[1], parts[2], parts[3]);
    l.len() <= 7
        && p.len() <= 15
        && w.len() <= 15
        && b.len() <= 7
        && b.parse::<u64>().ok() <= l.parse().ok()
}

/// The due time of `when` at server time `now`, `None` if refused.
fn due(when: &str, now: i64) -> Option<i64> {
    let (absolute, rest) = match when.strip_prefix('@') {
        Some(rest) => (true, rest),
        None => (false, when),
    };
    let (negative, digits) = match rest.strip_prefix('-') {
        Some(digits) if !absolute => (true, digits),
        _ => (false, rest),
    };
    if digits.is_empty() || digits.len() > 15 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: i64 = digits.parse().ok()?;
    let due = match (absolute, negative) {
        (true, _) => n,
        (false, true) => (now - n).max(0),
        (false, false) => (now + n).max(0),
    };
    (due < BEYOND).then_some(due)
}

fn misread(payload: &[u8]) -> bool {
    let digits = payload.iter().take_while(|b| b.is_ascii_digit()).count();
    digits > 0 && payload.get(digits) == Some(&b':')
}

/// Whether the contract accepts `call` at server time `now`.
fn accepted(call: &Call, now: i64) -> bool {
    let miscounted = call.miscounted && call.parts.len() > 1;
    !(call.dangling || miscounted)
        && call
            .messages()
            .all(|(_, (key, limits, id, when, payload))| {
                !key.is_empty()
                    && !key.contains(&0)
                    && std::str::from_utf8(key).is_ok()
                    && !id.is_empty()
                    && std::str::from_utf8(id).is_ok()
                    && limits_ok(limits)
                    && !misread(payload)
                    && due(when, now).is_some()
            })
}

/// Every key of the partition, dumped raw (`DUMP`), to tell whether a
/// refused call wrote anything.
async fn dump(conn: &mut ConnectionManager, keys: &[String]) -> Vec<Option<Vec<u8>>> {
    let mut dumped = Vec::new();
    for key in keys {
        let value: Option<Vec<u8>> = redis::cmd("DUMP")
            .arg(key)
            .query_async(conn)
            .await
            .expect("DUMP");
        dumped.push(value);
    }
    dumped
}

async fn server_ms(conn: &mut ConnectionManager) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    s * 1000 + us / 1000
}

async fn run_history(
    conn: &ConnectionManager,
    n: usize,
    history: &[Call],
) -> Result<(), TestCaseError> {
    let mut conn = conn.clone();
    // Each partition's keys; the counts and the earliest ready times are
    // kept for all of them, as on one server.
    let keys: Vec<Vec<String>> = (0..PARTITIONS)
        .map(|p| {
            let name = |name: &str| match name {
                "counts" | "oldest" => format!("lockgate:{{kp-{n}}}:keyed:{name}"),
                _ => format!("lockgate:{{{p}}}:kp-{n}:{name}"),
            };
            NAMES.iter().map(|n| name(n)).collect()
        })
        .collect();
    let all_keys: Vec<String> = keys.concat();
    let script = redis::Script::new(include_str!("../../scripts/push_keyed.lua"));
    // Per partition, key and id: what a push of it again answers (its due
    // time while it waits to be due, else -1: in line).
    let mut model: BTreeMap<(usize, Vec<u8>, Vec<u8>), i64> = BTreeMap::new();
    for (step, call) in history.iter().enumerate() {
        let at = format!("call {step}: {call:?}");
        let before = dump(&mut conn, &all_keys).await;
        let mut invocation = script.prepare_invoke();
        for (p, _) in &call.parts {
            invocation.key(&keys[*p]);
        }
        if call.parts.len() > 1 {
            for (i, (_, messages)) in call.parts.iter().enumerate() {
                invocation.arg(messages.len() + usize::from(i == 0 && call.miscounted));
            }
        }
        for (_, (key, limits, id, when, payload)) in call.messages() {
            invocation
                .arg(key)
                .arg(limits)
                .arg(id)
                .arg(when)
                .arg(payload);
        }
        if call.dangling {
            invocation.arg("x");
        }
        let t0 = server_ms(&mut conn).await;
        let reply: redis::RedisResult<Vec<i64>> = invocation.invoke_async(&mut conn).await;
        let t1 = server_ms(&mut conn).await;
        let accept = accepted(call, t0);
        if accept != accepted(call, t1) {
            continue;
        }
        let reply = match reply {
            Err(e) => {
                prop_assert!(!accept, "{}: refused: {}", at, e);
                prop_assert!(
                    e.to_string().contains("lockgate push:"),
                    "{}: refusal {}",
                    at,
                    e
                );
                prop_assert_eq!(
                    dump(&mut conn, &all_keys).await,
                    before,
                    "{}: a refused call wrote",
                    at
                );
                continue;
            }
            Ok(reply) => reply,
        };
        prop_assert!(accept, "{}: accepted: {:?}", at, reply);
        prop_assert_eq!(
            reply.len(),
            call.messages().count() * 2,
            "{}: one flat list",
            at
        );
        for ((p, (key, _, id, when, _)), answer) in call.messages().zip(reply.chunks(2)) {
            let message = (p, key.clone(), id.clone());
            match model.get(&message) {
                Some(again) => {
                    prop_assert_eq!(answer, &[0, *again][..], "{}: existing {:?}", at, id)
                }
                None => {
                    prop_assert_eq!(answer[0], 1, "{}: new {:?}", at, id);
                    let d = answer[1];
                    let dues: Vec<(i64, i64)> = (t0..=t1)
                        .filter_map(|now| due(when, now).map(|d| (now, d)))
                        .collect();
                    prop_assert!(
                        dues.iter().any(|(_, due)| *due == d),
                        "{}: {:?} due {}",
                        at,
                        id,
                        d
                    );
                    let waits = |(now, due): &(i64, i64)| due > now;
                    if !dues.iter().all(waits) && dues.iter().any(waits) {
                        return Ok(()); // due just at the edge of now: the model cannot tell
                    }
                    model.insert(message, if dues.iter().all(waits) { d } else { -1 });
                    // In the partition it was sent to.
                    let stored = [key.as_slice(), b"\0", id.as_slice()].concat();
                    let there: bool = redis::cmd("HEXISTS")
                        .arg(&keys[p][0])
                        .arg(stored)
                        .query_async(&mut conn)
                        .await
                        .expect("HEXISTS");
                    prop_assert!(there, "{}: {:?} in partition {}", at, id, p);
                }
            }
        }
        // The counts the script keeps (issue 35): in line, delayed, over
        // all the partitions.
        let counts: (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(&keys[0][11])
            .arg(&["lines", "schedule"])
            .query_async(&mut conn)
            .await
            .expect("HMGET");
        let in_line = model.values().filter(|due| **due == -1).count() as u64;
        let delayed = model.len() as u64 - in_line;
        let counts = (counts.0.unwrap_or(0), counts.1.unwrap_or(0));
        prop_assert_eq!(counts, (in_line, delayed), "{}: counts", at);
    }
    Ok(())
}

#[test]
fn the_keyed_producer_script_accepts_exactly_what_its_contract_says() {
    let server = support::server();
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::manager(&server));
    let histories = prop::collection::vec(call(), 1..8);
    crate::run("keyed producer script", 256, histories, |history, n| {
        runtime.block_on(run_history(&conn, n, &history))
    });
}
