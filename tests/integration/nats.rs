//! The broker pipeline of `examples/nats.rs`, end to end: a `nats-server
//! -js` and a redis-server started here, the example running as consumer
//! processes (`ORDERS=0`), this test as the producer. Every order is handled,
//! never two of one account at once (by the intervals the processes print),
//! exactly once while nobody crashes, and nothing is lost when a consumer is
//! killed mid-run.

use crate::support;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, stream};
use lockgate::Queue;
use lockgate::testing::{NatsServer, RedisServer};
use support::{ms, secs};
use tokio::time::{Instant, sleep};

/// The example's stream and subjects (see examples/nats.rs).
const STREAM: &str = "LOCKGATE_EXAMPLE";
const SUBJECT: &str = "lockgate-example.orders";

/// A consumer process and the lines it printed so far.
struct Consumer {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Consumer {
    fn spawn(nats: &NatsServer, redis: &RedisServer) -> Self {
        let mut child = Command::new(support::example("nats"))
            .env("NATS_URL", nats.url())
            .env("REDIS_URL", redis.url())
            .env("ORDERS", "0")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning examples/nats.rs");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn({
            let lines = lines.clone();
            move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            }
        });
        Consumer { child, lines }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One handled order: (order, account, start µs, end µs).
type Handled = (u64, String, u128, u128);

fn handled(consumers: &[Consumer]) -> Vec<Handled> {
    let mut all = Vec::new();
    for consumer in consumers {
        for line in consumer.lines.lock().unwrap().iter() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let ["handled", id, account, start, end, ..] = words[..] {
                all.push((
                    id.parse().unwrap(),
                    account.to_owned(),
                    start.parse().unwrap(),
                    end.parse().unwrap(),
                ));
            }
        }
    }
    all
}

/// Publishes `n` orders over `accounts`, once JetStream has the stream.
async fn publish(nats: &NatsServer, n: u64, accounts: &[&str]) {
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.get_or_create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec![format!("{SUBJECT}.*")],
        ..Default::default()
    })
    .await
    .unwrap();
    let order = |id: u64| {
        let subject = format!("{SUBJECT}.{}", accounts[id as usize % accounts.len()]);
        (subject, format!(r#"{{"id":{id},"amount":{id}}}"#))
    };
    let mut acks = Vec::new();
    for id in 0..n {
        let (subject, payload) = order(id);
        acks.push((id, js.publish(subject, payload.into()).await.unwrap()));
    }
    // A loaded server may answer "no stream for the subject" for a moment
    // after creating it: such a message was not stored; publish it again.
    for (id, ack) in acks {
        let mut ack = ack.await;
        let deadline = Instant::now() + secs(10);
        while let Err(e) = &ack {
            let missing = e.kind() == jetstream::context::PublishErrorKind::StreamNotFound;
            assert!(
                missing && Instant::now() < deadline,
                "publishing order {id}: {e}"
            );
            sleep(ms(50)).await;
            let (subject, payload) = order(id);
            ack = js.publish(subject, payload.into()).await.unwrap().await;
        }
    }
}

/// Waits until every consumer has started (its first line), then a moment
/// for it to join the durable consumer: an order published before a
/// process pulls goes to the other, and both must take part.
async fn until_started(consumers: &[Consumer]) {
    let deadline = Instant::now() + secs(30);
    while consumers.iter().any(|c| c.lines.lock().unwrap().is_empty()) {
        assert!(Instant::now() < deadline, "a consumer did not start");
        sleep(ms(10)).await;
    }
    sleep(ms(500)).await;
}

/// Waits until every order `0..n` was handled somewhere.
async fn until_all_handled(consumers: &[Consumer], n: u64, bound: Duration) {
    let deadline = Instant::now() + bound;
    loop {
        let seen: std::collections::BTreeSet<u64> =
            handled(consumers).into_iter().map(|h| h.0).collect();
        if seen.len() as u64 == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} orders were handled in {bound:?}",
            seen.len()
        );
        sleep(ms(50)).await;
    }
}

/// No two handlers of one account overlapped, in whatever process.
fn assert_one_at_a_time_per_account(all: &[Handled]) {
    let mut by_account: HashMap<&str, Vec<(u128, u128, u64)>> = HashMap::new();
    for (id, account, start, end) in all {
        by_account
            .entry(account)
            .or_default()
            .push((*start, *end, *id));
    }
    for (account, mut runs) in by_account {
        runs.sort();
        for pair in runs.windows(2) {
            assert!(
                pair[0].1 <= pair[1].0,
                "orders {} and {} of {account} overlapped: {pair:?}",
                pair[0].2,
                pair[1].2
            );
        }
    }
}

/// Waits until the lockgate queue has nothing left in it.
async fn until_queue_empty(redis: &RedisServer) {
    let queue: Queue<serde_json::Value> =
        Queue::new(redis.connection_manager().await.unwrap(), "nats-orders").unwrap();
    let deadline = Instant::now() + secs(20);
    loop {
        let stats = queue.stats().await.unwrap();
        if (stats.due, stats.later, stats.active, stats.dead) == (0, 0, 0, 0) {
            return;
        }
        assert!(Instant::now() < deadline, "the queue kept {stats:?}");
        sleep(ms(50)).await;
    }
}

const ACCOUNTS: [&str; 4] = ["alice", "bob", "carol", "dave"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_order_is_handled_once_and_one_at_a_time_per_account_across_consumers() {
    let nats = NatsServer::start().unwrap_or_else(|e| panic!("{e}"));
    let redis = support::server();
    let total = 200;
    let consumers = [
        Consumer::spawn(&nats, &redis),
        Consumer::spawn(&nats, &redis),
    ];
    until_started(&consumers).await;
    publish(&nats, total, &ACCOUNTS).await;
    until_all_handled(&consumers, total, secs(60)).await;
    until_queue_empty(&redis).await;
    // A late duplicate would show up by now (the ack wait is 5 s; the
    // handlers are done, the queue is empty).
    sleep(ms(300)).await;

    let all = handled(&consumers);
    let mut times: BTreeMap<u64, usize> = BTreeMap::new();
    for (id, ..) in &all {
        *times.entry(*id).or_default() += 1;
    }
    let twice: Vec<_> = times.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "handled more than once: {twice:?}");
    assert_eq!(times.len() as u64, total);
    assert_one_at_a_time_per_account(&all);
    // Both processes took part.
    for (i, consumer) in consumers.iter().enumerate() {
        assert!(
            !handled(std::slice::from_ref(consumer)).is_empty(),
            "consumer {i} handled nothing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_mid_run_loses_no_order() {
    let nats = NatsServer::start().unwrap_or_else(|e| panic!("{e}"));
    let redis = support::server();
    let total = 200;
    let mut consumers = vec![
        Consumer::spawn(&nats, &redis),
        Consumer::spawn(&nats, &redis),
    ];
    until_started(&consumers).await;
    publish(&nats, total, &ACCOUNTS).await;
    // Kill one consumer (SIGKILL: no goodbye) once it is well under way,
    // holding locks, orders waiting in their account's line and unacknowledged messages.
    // Whichever got going: JetStream may hand one consumer most of the work.
    let deadline = Instant::now() + secs(30);
    let busy = loop {
        let got_going = (0..consumers.len())
            .find(|&i| handled(std::slice::from_ref(&consumers[i])).len() >= 20);
        if let Some(i) = got_going {
            break i;
        }
        assert!(Instant::now() < deadline, "no consumer got going");
        sleep(ms(5)).await;
    };
    consumers[busy].kill();
    let before = handled(&consumers).len();
    assert!(
        before < total as usize,
        "everything was handled before the kill"
    );

    // JetStream redelivers what it had not acknowledged (after 5 s); its
    // locks expire and its claims' leases end (5 s each).
    until_all_handled(&consumers, total, secs(60)).await;
    until_queue_empty(&redis).await;
    let all = handled(&consumers);
    assert_one_at_a_time_per_account(&all);
}
