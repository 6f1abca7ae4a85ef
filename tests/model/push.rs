//! The producer script (`scripts/push.lua`, what producers in other
//! languages load) called with arbitrary arguments: every call is either
//! accepted exactly as the model of its contract says, or refused with a
//! `lockgate push:` error before anything is written.
//!
//! The contract, restated independently of the Lua: arguments are triplets
//! (id, when, payload); an id is non-empty UTF-8 (every reader takes it
//! for a string); `when` is a delay in
//! whole ms (`-?[0-9]{1,15}`) from the server's now, or `@[0-9]{1,15}`, an
//! absolute time in ms, optionally followed by `/<one digit>`, a priority
//! (which needs the prioritized key); a due time before 1970 is due at 0,
//! one from 10^13 ms (the year 2286) on is refused; a payload is any bytes
//! but those that start with digits and a colon (never JSON: they would be
//! read as a count). A new id is stored as
//! `[p<priority>:]<now>:0:0:<payload>` and scheduled at its due time; an
//! existing one (pushed before, or earlier in the same call) is left as it
//! is, and the reply gives its due time (-1 for one with a priority when
//! the call leaves the prioritized key out).

use std::collections::BTreeMap;

use lockgate::Queue;
use lockgate::queue::MAX_BATCH;
use proptest::prelude::*;
use redis::aio::ConnectionManager;

use crate::support;

/// The first due time refused (ms since 1970: the year 2286).
const BEYOND: i64 = 10_000_000_000_000;

/// One call of the script.
#[derive(Debug, Clone)]
struct Call {
    triplets: Vec<(Vec<u8>, String, Vec<u8>)>,
    /// An argument too many (not a whole triplet).
    dangling: bool,
    /// Whether the prioritized key is passed (producers without priorities
    /// may leave it out).
    prioritized: bool,
}

fn id() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        12 => (0..4u8).prop_map(|n| format!("m{n}").into_bytes()),
        1 => Just(Vec::new()),
        1 => prop::collection::vec(any::<u8>(), 1..6),
    ]
}

fn when() -> impl Strategy<Value = String> {
    let time = prop_oneof![
        12 => "[0-9]{1,4}",
        1 => "-[0-9]{1,15}",
        1 => "@[0-9]{1,15}",
        1 => "[0-9]{12,17}",
        1 => "@-[0-9]{1,3}",
        1 => "[ +0-9a-fx.e@-]{0,6}",
        1 => any::<String>(),
    ];
    let priority = prop_oneof![6 => Just(String::new()), 4 => "/[0-9]", 1 => "/[0-9a/]{0,2}"];
    (time, priority).prop_map(|(t, p)| t + &p)
}

fn call() -> impl Strategy<Value = Call> {
    let payload = prop_oneof![
        3 => prop::collection::vec(any::<u8>(), 0..12),
        1 => "[0-9]{0,3}:?[a-z:]{0,3}".prop_map(String::into_bytes),
        1 => "\\{\"n\":[0-9]{1,3}\\}".prop_map(String::into_bytes),
    ];
    let triplet = (id(), when(), payload);
    (
        prop::collection::vec(triplet, 1..4),
        prop::bool::weighted(0.05),
        prop::bool::weighted(0.8),
    )
        .prop_map(|(triplets, dangling, prioritized)| Call {
            triplets,
            dangling,
            prioritized,
        })
}

/// A `when` argument as the contract reads it: the due time as a function
/// of the server's now, and the priority; `None` if it is refused.
fn parse(when: &str) -> Option<(Due, u8)> {
    let bytes = when.as_bytes();
    let (time, priority) = match bytes {
        [rest @ .., b'/', d] if d.is_ascii_digit() => (rest, d - b'0'),
        _ => (bytes, 0),
    };
    let (absolute, time) = match time {
        [b'@', rest @ ..] => (true, rest),
        _ => (false, time),
    };
    let (negative, digits) = match time {
        [b'-', rest @ ..] if !absolute => (true, rest),
        _ => (false, time),
    };
    if digits.is_empty() || digits.len() > 15 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: i64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match (absolute, negative) {
        (true, _) => (Due::At(n), priority),
        (false, true) => (Due::After(-n), priority),
        (false, false) => (Due::After(n), priority),
    })
}

#[derive(Debug, Clone, Copy)]
enum Due {
    At(i64),
    After(i64),
}

impl Due {
    /// The due time pushed at server time `now`, or `None` if refused.
    fn at(self, now: i64) -> Option<i64> {
        let due = match self {
            Due::At(n) => n,
            Due::After(n) => (now + n).max(0),
        };
        (due < BEYOND).then_some(due)
    }
}

/// A stored message as the model has it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stored {
    due: i64,
    priority: u8,
    record: Vec<u8>,
    payload: Vec<u8>,
}

/// Everything the queue's keys hold, read raw.
#[derive(Debug, PartialEq)]
struct Raw {
    data: BTreeMap<Vec<u8>, Vec<u8>>,
    schedule: Vec<(Vec<u8>, f64)>,
    prioritized: Vec<(Vec<u8>, f64)>,
}

async fn raw(conn: &mut ConnectionManager, base: &str) -> Raw {
    let data: BTreeMap<Vec<u8>, Vec<u8>> = redis::cmd("HGETALL")
        .arg(format!("{base}:data"))
        .query_async(conn)
        .await
        .expect("HGETALL");
    let mut zset = async |name: &str| -> Vec<(Vec<u8>, f64)> {
        redis::cmd("ZRANGE")
            .arg(format!("{base}:{name}"))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES")
            .query_async(conn)
            .await
            .expect("ZRANGE")
    };
    let schedule = zset("schedule").await;
    let prioritized = zset("prioritized").await;
    Raw {
        data,
        schedule,
        prioritized,
    }
}

async fn server_ms(conn: &mut ConnectionManager) -> i64 {
    let (s, us): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    s * 1000 + us / 1000
}

/// Whether a payload starts with digits and a colon: never JSON, and a
/// record's reader would take the digits for a count.
fn misread(payload: &[u8]) -> bool {
    let digits = payload.iter().take_while(|b| b.is_ascii_digit()).count();
    digits > 0 && payload.get(digits) == Some(&b':')
}

/// Whether the contract accepts `call` at server time `now`, checked
/// before anything is written.
fn accepted(call: &Call, now: i64) -> bool {
    !call.dangling
        && call.triplets.iter().all(|(id, when, payload)| {
            !id.is_empty()
                && std::str::from_utf8(id).is_ok()
                && !misread(payload)
                && parse(when).is_some_and(|(due, priority)| {
                    // Refusal must not depend on the exact ms: far from the edge.
                    due.at(now).is_some() && (priority == 0 || call.prioritized)
                })
        })
}

async fn run_history(
    conn: &ConnectionManager,
    n: usize,
    history: &[Call],
) -> Result<(), TestCaseError> {
    let mut conn = conn.clone();
    let name = format!("push-{n}");
    let base = format!("lockgate:{{{name}}}");
    let queue: Queue<u64> = Queue::new(conn.clone(), &name).expect("a queue");
    let script = redis::Script::new(include_str!("../../scripts/push.lua"));
    let mut model: BTreeMap<Vec<u8>, Stored> = BTreeMap::new();
    for (step, call) in history.iter().enumerate() {
        let at = format!("call {step}: {call:?}");
        let before = raw(&mut conn, &base).await;
        let invocation = invocation(&script, &base, call);
        let t0 = server_ms(&mut conn).await;
        let reply: redis::RedisResult<Vec<i64>> = invocation.invoke_async(&mut conn).await;
        let t1 = server_ms(&mut conn).await;
        let after = raw(&mut conn, &base).await;
        let accept = accepted(call, t0);
        // Calls whose verdict could change within the window are not drawn
        // on purpose; skip the rare one rather than guess.
        if accept != accepted(call, t1) {
            continue;
        }
        let reply = match reply {
            Err(e) => {
                prop_assert!(!accept, "{}: refused: {}", at, e);
                let text = e.to_string();
                prop_assert!(text.contains("lockgate push:"), "{}: refusal {}", at, text);
                prop_assert_eq!(&after, &before, "{}: a refused call wrote", at);
                continue;
            }
            Ok(reply) => reply,
        };
        prop_assert!(accept, "{}: accepted: {:?}", at, reply);
        prop_assert_eq!(reply.len(), call.triplets.len() * 2, "{}", at);
        for ((id, when, payload), answer) in call.triplets.iter().zip(reply.chunks(2)) {
            let (due, priority) = parse(when).expect("accepted");
            match model.get(id) {
                Some(old) => {
                    // Without the prioritized key, a message there is not seen.
                    let due = if old.priority > 0 && !call.prioritized {
                        -1
                    } else {
                        old.due
                    };
                    prop_assert_eq!(answer, &[0, due][..], "{}: existing {:?}", at, id)
                }
                None => {
                    prop_assert_eq!(answer[0], 1, "{}: new {:?}", at, id);
                    let record = &after.data[id];
                    let (now, stored) = split(record, priority, payload)
                        .ok_or_else(|| TestCaseError::fail(format!("{at}: record {record:?}")))?;
                    prop_assert!((t0..=t1).contains(&now), "{}: enqueued at {}", at, now);
                    prop_assert_eq!(Some(answer[1]), due.at(now), "{}: due of {:?}", at, id);
                    model.insert(
                        id.clone(),
                        Stored {
                            due: answer[1],
                            priority,
                            record: stored,
                            payload: payload.clone(),
                        },
                    );
                }
            }
        }
        check(&queue, &model, &after, &at).await?;
    }
    Ok(())
}

/// The script's call for `call` on the queue whose keys start with `base`.
fn invocation<'a>(
    script: &'a redis::Script,
    base: &str,
    call: &Call,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    invocation
        .key(format!("{base}:data"))
        .key(format!("{base}:schedule"))
        .key(format!("{base}:bell"));
    if call.prioritized {
        invocation.key(format!("{base}:prioritized"));
    }
    for (id, when, payload) in &call.triplets {
        invocation.arg(id).arg(when).arg(payload);
    }
    if call.dangling {
        invocation.arg("x");
    }
    invocation
}

/// Splits a stored record into its enqueue time, checking it is the
/// contract's `[p<priority>:]<now>:0:0:<payload>`.
fn split(record: &[u8], priority: u8, payload: &[u8]) -> Option<(i64, Vec<u8>)> {
    let rest = match priority {
        0 => record,
        p => record.strip_prefix(format!("p{p}:").as_bytes())?,
    };
    let colon = rest.iter().position(|&b| b == b':')?;
    let now: i64 = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
    let tail = rest[colon..].strip_prefix(b":0:0:")?;
    (tail == payload).then(|| (now, record.to_vec()))
}

/// What the queue holds equals the model: the raw keys, and the messages
/// as the library reads them (the exact payload bytes, the priority, the
/// due time).
async fn check(
    queue: &Queue<u64>,
    model: &BTreeMap<Vec<u8>, Stored>,
    raw: &Raw,
    at: &str,
) -> Result<(), TestCaseError> {
    let records: BTreeMap<Vec<u8>, Vec<u8>> = model
        .iter()
        .map(|(id, s)| (id.clone(), s.record.clone()))
        .collect();
    prop_assert_eq!(&raw.data, &records, "{}: records", at);
    let scheduled = raw.schedule.len() + raw.prioritized.len();
    prop_assert_eq!(scheduled, model.len(), "{}: scheduled", at);
    let peek = queue
        .peek(MAX_BATCH)
        .await
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert_eq!(peek.waiting.len(), model.len(), "{}: waiting", at);
    for w in &peek.waiting {
        let stored = &model[w.id.as_bytes()];
        let at_ms =
            w.at.duration_since(std::time::UNIX_EPOCH)
                .map_or(-1, |d| d.as_millis() as i64);
        prop_assert_eq!(
            (w.priority, at_ms),
            (stored.priority, stored.due),
            "{}: peeked {}",
            at,
            w.id
        );
        prop_assert_eq!(&w.payload, &stored.payload, "{}: payload of {}", at, w.id);
    }
    Ok(())
}

#[test]
fn the_producer_script_accepts_exactly_what_its_contract_says() {
    let server = support::server();
    let runtime = crate::runtime();
    let conn = runtime.block_on(support::manager(&server));
    let histories = prop::collection::vec(call(), 1..8);
    crate::run("producer script", 256, histories, |history, n| {
        runtime.block_on(run_history(&conn, n, &history))
    });
}
