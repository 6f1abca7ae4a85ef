//! A producer in another language (Python, standard library only) pushes
//! through the shipped `scripts/push.lua`, as docs/internals.md tells it to; the
//! Rust side claims. Every message is claimed exactly once, and pushing an
//! id again (a duplicate, a retried push, or after a worker claimed it)
//! never puts it back on the schedule.

use crate::support;

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use lockgate::Queue;
use lockgate::testing::RedisServer;
use serde_json::{Value, json};
use support::{manager, raw, secs, server, stats};

const LONG: Duration = secs(60);

/// Runs `tests/python/<file>` with `args` after the server's port, `input`
/// on its stdin; returns the JSON list it prints.
async fn run_python(server: &RedisServer, file: &str, args: &[&str], input: Value) -> Vec<Value> {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut command = Command::new("python3");
    command
        .arg(format!("{root}/tests/python/{file}"))
        .arg(server.port().to_string())
        .args(args.iter().map(|a| a.replace("$ROOT", root)));
    let file = file.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 must be installed to run this test");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{file} failed: {:?}", out.status);
        serde_json::from_slice::<Vec<Value>>(&out.stdout).expect("the producer's output")
    })
    .await
    .unwrap()
}

/// Runs `tests/python/producer.py` with `calls` (a list of lists of
/// `[id, when, payload]`) and returns its per-call results.
async fn python(server: &RedisServer, queue: &str, calls: Value) -> Vec<Value> {
    let args = [queue, "$ROOT/scripts/push.lua"];
    run_python(server, "producer.py", &args, calls).await
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Order {
    order: u64,
    note: String,
}

#[tokio::test]
async fn a_python_producer_using_the_shipped_script_cannot_make_a_message_claimable_twice() {
    const N: u64 = 50;
    let server = server();
    let q: Queue<Order> = Queue::new(manager(&server).await, "py").unwrap();
    let msg = |n: u64| json!([format!("order-{n}"), "0", {"order": n, "note": "from python"}]);

    // One call with every message, and order-0 twice in it; a second call
    // repeats order-1 (a retried push whose reply was lost); a third is due
    // in a minute.
    let mut first: Vec<Value> = (0..N).map(msg).collect();
    first.push(msg(0));
    let results = python(
        &server,
        "py",
        json!([first, [msg(1)], [["later", "60000", {"order": 99, "note": "later"}]]]),
    )
    .await;
    let replies = results[0].as_array().unwrap();
    assert_eq!(replies.len(), N as usize + 1);
    assert!(
        replies[..N as usize].iter().all(|r| r[0] == 1),
        "{replies:?}"
    );
    assert_eq!(replies[N as usize][0], 0, "the duplicate was added");
    assert_eq!(results[1][0][0], 0, "the re-push was added");
    assert_eq!(results[2][0][0], 1);
    let s = stats(&q).await;
    assert_eq!((s.due, s.later), (N, 1));

    // A worker claims everything due.
    let mut jobs = Vec::new();
    loop {
        let batch = q.claim(16, LONG).await.unwrap();
        assert_eq!(batch.buried, 0, "a Python payload did not decode");
        if batch.jobs.is_empty() {
            break;
        }
        jobs.extend(batch.jobs);
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    for job in &jobs {
        *seen.entry(job.id().to_owned()).or_default() += 1;
        assert_eq!(job.id(), format!("order-{}", job.order));
        assert_eq!(job.note, "from python");
        assert_eq!(job.attempt(), 1);
    }
    assert_eq!(seen.len(), N as usize);
    assert!(seen.values().all(|&n| n == 1), "claimed twice: {seen:?}");

    // The producer pushes every id again while the worker holds them: each
    // is reported as existing and not scheduled, and none becomes claimable.
    let again: Vec<Value> = (0..N).map(msg).collect();
    let results = python(&server, "py", json!([again])).await;
    for reply in results[0].as_array().unwrap() {
        assert_eq!(reply, &json!([0, -1]), "a claimed id was pushed again");
    }
    let s = stats(&q).await;
    assert_eq!((s.due, s.later, s.active), (0, 1, N));
    assert!(q.claim(16, LONG).await.unwrap().jobs.is_empty());

    for job in &jobs {
        assert!(q.ack(job).await.unwrap());
    }
    let s = stats(&q).await;
    assert_eq!((s.due, s.later, s.active, s.dead), (0, 1, 0, 0));

    // Bad arguments come back as a clear error, and nothing is written.
    let results = python(
        &server,
        "py",
        json!([[["bad", "5s", {"order": 1, "note": ""}]]]),
    )
    .await;
    let error = results[0]["error"].as_str().expect("an error reply");
    assert!(error.contains("lockgate push"), "{error}");
    let orphan: i64 = raw(q.connection(), &["HEXISTS", "lockgate:{py}:data", "bad"]).await;
    assert_eq!(orphan, 0, "a refused push left a record behind");
    let s = stats(&q).await;
    assert_eq!((s.due, s.later, s.active, s.dead), (0, 1, 0, 0));
}

#[tokio::test]
async fn a_python_producer_pushes_with_priorities() {
    let server = server();
    let q: Queue<Order> = Queue::new(manager(&server).await, "py-prio").unwrap();
    let order = |n: u64| json!({"order": n, "note": "p"});
    let results = python(
        &server,
        "py-prio",
        json!([[
            ["plain", "0", order(1)],
            ["urgent", "0/9", order(2)],
            ["later", "0/3", order(3)],
            ["bad", "0/10", order(4)],
        ]]),
    )
    .await;
    // The bad priority refuses the whole call, before any write.
    assert!(results[0].get("error").is_some(), "{results:?}");
    let results = python(
        &server,
        "py-prio",
        json!([[
            ["plain", "0", order(1)],
            ["urgent", "0/9", order(2)],
            ["later", "0/3", order(3)],
        ]]),
    )
    .await;
    assert!(results[0].get("error").is_none(), "{results:?}");
    let claimed = q.claim(10, LONG).await.unwrap();
    let got: Vec<(u8, &str)> = claimed
        .jobs
        .iter()
        .map(|j| (j.priority(), j.id()))
        .collect();
    assert_eq!(got, [(9, "urgent"), (3, "later"), (0, "plain")]);
}

/// Runs `tests/python/keyed_producer.py` with `messages` (a list of
/// `[key, id, when, payload]`) and returns its per-message results.
async fn python_keyed(server: &RedisServer, queue: &str, messages: Value) -> Vec<Value> {
    let args = [queue, "$ROOT/scripts/push_keyed.lua"];
    run_python(server, "keyed_producer.py", &args, messages).await
}

#[tokio::test]
async fn a_python_producer_pushes_keyed_messages_the_claim_takes_with_their_keys_lock() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Order> = Queue::new(conn.clone(), "py").unwrap();
    // Keys with the characters lockgate escapes in a hash tag, too.
    let keys = ["alice", "b}ob", "c\\arol"];
    let mut messages = Vec::new();
    for n in 0..4u64 {
        for key in keys {
            let order = json!({"order": n, "note": key});
            messages.push(json!([key, format!("{key}/{n}"), "0", order]));
        }
    }
    messages.push(json!(["alice", "alice/0", "0", {"order": 99, "note": "again"}]));
    let results = python_keyed(&server, "py", Value::Array(messages)).await;
    assert_eq!(results.len(), 13);
    assert!(results[..12].iter().all(|r| r[0] == 1), "{results:?}");
    assert_eq!(results[12][0], 0, "a duplicate id changes nothing");
    let locker = lockgate::Locker::new(conn);
    let mut next = HashMap::new();
    for _ in 0..4 {
        let jobs = q.claim(10, LONG).await.unwrap().jobs;
        assert_eq!(jobs.len(), keys.len(), "one per key: {jobs:?}");
        for job in &jobs {
            let key = job.key().expect("a keyed message");
            assert_eq!(job.note, key);
            // In push order per key, under the key's lock.
            let n = next.entry(key.to_owned()).or_insert(0u64);
            assert_eq!(job.order, *n);
            *n += 1;
            assert!(locker.acquire(key).await.unwrap().lease().is_none());
            assert!(q.ack(job).await.unwrap());
        }
    }
    assert_eq!(stats(&q).await.due, 0);
    // A key with 2 permits: two of its messages at once, each holding one.
    let pair =
        (0..2).map(|n| json!(["dave", format!("dave/{n}"), "0", {"order": n, "note": "d"}, 2]));
    let results = python_keyed(&server, "py", Value::Array(pair.collect())).await;
    assert!(results.iter().all(|r| r[0] == 1), "{results:?}");
    let mut jobs = q.claim(10, LONG).await.unwrap().jobs;
    jobs.extend(q.claim(10, LONG).await.unwrap().jobs);
    let orders: Vec<u64> = jobs.iter().map(|job| job.order).collect();
    assert_eq!(orders, [0, 1]);
    assert_eq!(locker.permit_holders("dave").await.unwrap().len(), 2);
}

#[tokio::test]
async fn a_python_producer_pushes_to_a_sharded_queue_and_workers_find_every_message() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Order> = Queue::new(conn.clone(), "py")
        .and_then(|q| q.shards(3))
        .unwrap();
    let messages = (0..30u64).map(|n| json!([format!("o{n}"), "0", {"order": n, "note": "s"}]));
    let mut messages: Vec<Value> = messages.collect();
    messages.push(json!(["o7", "0", {"order": 99, "note": "again"}]));
    let args = ["py", "3", "$ROOT/scripts/push.lua"];
    let results = run_python(
        &server,
        "sharded_producer.py",
        &args,
        Value::Array(messages),
    )
    .await;
    assert!(results[..30].iter().all(|r| r[0] == 1), "{results:?}");
    assert_eq!(
        results[30][0], 0,
        "a duplicate id meets itself in its shard"
    );
    let shards: std::collections::BTreeSet<u64> =
        results.iter().map(|r| r[2].as_u64().unwrap()).collect();
    assert_eq!(shards.len(), 3, "{results:?}");
    // Claimed from every shard, each once, woken by the bell.
    let mut waiter = q.waiter(server.client());
    let _ = waiter.wait(Some(tokio::time::Instant::now())).await;
    let mut orders = Vec::new();
    for _ in 0..10 {
        let jobs = q.claim(100, LONG).await.unwrap().jobs;
        orders.extend(jobs.iter().map(|j| j.order));
        q.ack_many(&jobs).await.unwrap();
    }
    orders.sort_unstable();
    assert_eq!(orders, (0..30).collect::<Vec<_>>());
    // A producer with another count is refused by the record.
    let args = ["py", "2", "$ROOT/scripts/push.lua"];
    let wrong = std::process::Command::new("python3")
        .arg(format!(
            "{}/tests/python/sharded_producer.py",
            env!("CARGO_MANIFEST_DIR")
        ))
        .arg(server.port().to_string())
        .args(
            args.iter()
                .map(|a| a.replace("$ROOT", env!("CARGO_MANIFEST_DIR"))),
        )
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(!wrong.success());
}

/// Keyed messages that lockgate 0.1 pushed on one server wait in the
/// partitions of their locks' slots (pushed there here by the Python
/// producer, as 0.1 did). Now that every key's line on one server is in the
/// queue's own partition, claims still find them, beside the new ones (and
/// over more partitions than one claim visits), each once, under its key's
/// lock, each partition's in line order.
#[tokio::test]
async fn keyed_messages_in_their_locks_partitions_from_0_1_are_claimed_beside_new_ones() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Order> = Queue::new(conn.clone(), "py").unwrap();
    let keys: Vec<String> = (0..40).map(|n| format!("k{n}")).collect();
    let old = keys.iter().flat_map(|key| {
        (0..2u64).map(move |n| json!([key, format!("{key}/{n}"), "0", {"order": n, "note": key}]))
    });
    let args = ["py", "$ROOT/scripts/push_keyed.lua", "--by-lock-slot"];
    let results = run_python(&server, "keyed_producer.py", &args, old.collect()).await;
    assert!(results.iter().all(|r| r[0] == 1), "{results:?}");
    let new = keys.iter().map(|key| {
        let order = Order {
            order: 2,
            note: key.clone(),
        };
        (
            order,
            lockgate::PushOptions::new().key(key).id(format!("{key}/2")),
        )
    });
    q.push_many_with(new).await.unwrap();
    let lines: Vec<String> = raw(&conn, &["KEYS", "lockgate:{*}:py:lines"]).await;
    assert!(
        lines.len() > 32,
        "0.1's partitions and the queue's: {lines:?}"
    );
    // A key waiting in one partition for its lock, held for its message in
    // the other, is woken by the release (the default lease is 30 s).
    let locker = lockgate::Locker::new(conn);
    let handled = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = handled.clone();
    let service = tower::service_fn(move |job: lockgate::Job<Order>| {
        let (seen, locker) = (seen.clone(), locker.clone());
        async move {
            let key = job.key().unwrap_or_default().to_owned();
            let held = locker.acquire(&key).await?.lease().is_none();
            seen.lock().unwrap().push((key, job.order, held));
            Ok::<_, lockgate::BoxError>(())
        }
    });
    let worker = lockgate::Worker::new(server.client(), q.clone(), service);
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    support::eventually("every message handled", secs(5), async || {
        let n = handled.lock().unwrap().len();
        support::done_if(n == 3 * keys.len(), n)
    })
    .await;
    support::stop(stop_tx, run).await;
    let handled = handled.lock().unwrap().clone();
    assert!(
        handled.iter().all(|(_, _, held)| *held),
        "under the key's lock"
    );
    for key in &keys {
        let orders: Vec<u64> = (handled.iter().filter(|(k, _, _)| k == key))
            .map(|(_, order, _)| *order)
            .collect();
        let old: Vec<u64> = orders.iter().copied().filter(|n| *n < 2).collect();
        assert_eq!(old, [0, 1], "{key}: {orders:?}");
        assert_eq!(orders.len(), 3, "{key}: each once: {orders:?}");
    }
    assert_eq!(stats(&q).await, Default::default());
}

/// Leases of messages in 0.1's partitions (one per lock slot, pushed there
/// here by the Python producer) are recovered on one server as before: a
/// sweep over many partitions in few script calls, each message back in
/// line and claimed again.
#[tokio::test]
async fn leases_in_0_1_s_partitions_are_recovered() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Order> = Queue::new(conn.clone(), "py").unwrap();
    let old = (0..300u64)
        .map(|n| json!([format!("k{n}"), format!("m{n}"), "0", {"order": n, "note": "old"}]));
    let args = ["py", "$ROOT/scripts/push_keyed.lua", "--by-lock-slot"];
    let results = run_python(&server, "keyed_producer.py", &args, old.collect()).await;
    assert!(results.iter().all(|r| r[0] == 1), "{results:?}");
    let mut claimed = 0;
    for _ in 0..20 {
        claimed += q
            .claim(100, Duration::from_millis(50))
            .await
            .unwrap()
            .jobs
            .len();
    }
    assert_eq!(claimed, 300);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = support::script_calls(&conn).await;
    let recovered = q.recover(3).await.unwrap();
    let calls = support::script_calls(&conn).await - before;
    assert_eq!((recovered.requeued, recovered.buried), (300, 0));
    assert!(calls <= 7, "{calls} script calls for ~300 partitions");
    let mut again = 0;
    for _ in 0..20 {
        again += q.claim(100, LONG).await.unwrap().jobs.len();
    }
    assert_eq!(again, 300);
}

/// Issue 37: a producer that ran the push script and stopped before its
/// index step (here: told to leave it out) left partitions the index does
/// not name; the workers' recovery turn finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_messages_pushed_without_the_index_step_are_found_by_the_workers() {
    let server = server();
    let conn = manager(&server).await;
    let q: Queue<Order> = Queue::new(conn.clone(), "py").unwrap();
    let messages = (0..6u64).map(|n| {
        let key = ["alice", "bob", "carol"][n as usize % 3];
        json!([key, format!("{key}/{n}"), "0", {"order": n, "note": key}])
    });
    let args = ["py", "$ROOT/scripts/push_keyed.lua", "--no-index"];
    let results = run_python(&server, "keyed_producer.py", &args, messages.collect()).await;
    assert!(results.iter().all(|r| r[0] == 1), "{results:?}");
    let indexed: Vec<String> = raw(&conn, &["ZRANGE", "lockgate:{py}:partitions", "0", "-1"]).await;
    assert!(
        indexed.is_empty(),
        "the producer left out step 4: {indexed:?}"
    );
    let handled = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = handled.clone();
    let service = tower::service_fn(move |job: lockgate::Job<Order>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(job.order);
            Ok::<_, lockgate::BoxError>(())
        }
    });
    let worker = lockgate::Worker::new(server.client(), q, service)
        .lease(Duration::from_millis(300))
        .unwrap();
    let pushed = tokio::time::Instant::now();
    let (stop_tx, shutdown) = support::shutdown_signal();
    let run = tokio::spawn(worker.run_until(shutdown));
    // The sweep runs at most every 5 s: within that and a tick.
    support::eventually("every message handled", secs(8), async || {
        let n = handled.lock().unwrap().len();
        support::done_if(n == 6, n)
    })
    .await;
    support::stop(stop_tx, run).await;
    let mut orders = handled.lock().unwrap().clone();
    orders.sort_unstable();
    assert_eq!(orders, [0, 1, 2, 3, 4, 5], "each once");
    assert!(pushed.elapsed() < secs(8));
}

/// Issue 37: a refusal names the message, its key and id, and the argument
/// the caller got wrong; a non-UTF-8 id is refused (the model in
/// `tests/model/keyed_push.rs` draws them).
#[tokio::test]
async fn the_keyed_push_script_names_the_argument_it_refuses() {
    let server = server();
    let bad = json!([["alice", "a/1", "0", {"order": 1, "note": "x"}, "x"]]);
    let args = ["py", "$ROOT/scripts/push_keyed.lua"];
    let results = run_python(&server, "keyed_producer.py", &args, bad).await;
    let error = results[0]["error"].as_str().expect("refused");
    assert!(
        error.contains(r#"message 1 (key "alice", id "a/1") has bad limits "x""#),
        "{error}"
    );
}
