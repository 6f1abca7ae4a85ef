//! Runs every example in `examples/` against a throwaway redis-server (and
//! nats-server, for the broker pipeline) and
//! checks that it succeeds and says something, and that it leaves a server
//! it did not start as it found it.
//!
//! The examples are built once (`support::example`: Cargo gives tests no
//! path to example binaries) and run one after the other.

use crate::support;

use std::collections::BTreeMap;
use std::process::Output;

use lockgate::testing::{NatsServer, RedisServer};
use lockgate::{PushOptions, Queue};

const EXAMPLES: &[&str] = &[
    "quickstart",
    "keyed",
    "strategies",
    "fencing",
    "pipeline",
    "limits",
    "prometheus",
    "nats",
];

/// The examples whose processes share fixed key names (several consumers of
/// one queue), which they leave behind on purpose.
const SHARED_NAMES: &[&str] = &["nats"];

#[test]
fn every_example_runs() {
    let server = support::server();
    // For examples/nats.rs: JetStream in front of the pipeline.
    let nats = NatsServer::start().unwrap_or_else(|e| panic!("could not start nats-server: {e}"));
    // The server stands for one of yours, named by REDIS_URL.
    let yours = seed_someone_elses_data(&server);
    for name in EXAMPLES {
        let output = run_example(name, |cargo| {
            cargo
                .env("REDIS_URL", server.url())
                .env("NATS_URL", nats.url())
                // For examples/prometheus.rs: a free port, and a short run.
                .env("METRICS_ADDR", free_address())
                .env("RUN_FOR_MS", "1000");
        });
        let stdout = String::from_utf8_lossy(&output.stdout);
        let address = format!("127.0.0.1:{}", server.port());
        assert!(
            stdout.contains(&address),
            "example {name} did not say it used {address}\n--- stdout ---\n{stdout}"
        );
        if !SHARED_NAMES.contains(name) {
            assert_same_keys(name, &yours, &keyspace(&server));
        }
    }
}

/// Issue 39, item 5: the quickstart used a Redis it found on port 6379 and
/// purged its queue there. Pointed at a server of yours, it must leave every
/// key as it was (here: a message in a queue of the quickstart's own name,
/// a lock on one of its accounts, a key of your own) and leave nothing
/// behind.
#[test]
fn the_quickstart_leaves_a_server_it_did_not_start_as_it_found_it() {
    let server = support::server();
    seed_someone_elses_data(&server);
    // A lock of yours on one of the quickstart's accounts: not its business.
    let mut set = redis::cmd("SET");
    set.arg(&["lockgate:lock:{bob}", "their-token", "PX", "600000"]);
    server.query::<()>(&set).expect("SET");
    let yours = keyspace(&server);
    let output = run_example("quickstart", |cargo| {
        cargo.env("REDIS_URL", server.url());
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&format!("127.0.0.1:{}", server.port())),
        "the quickstart did not use REDIS_URL\n--- stdout ---\n{stdout}"
    );
    assert_same_keys("quickstart", &yours, &keyspace(&server));
}

/// Without `REDIS_URL`, the quickstart starts a server of its own and says
/// so: never one that merely answers on `127.0.0.1:6379`.
#[test]
fn the_quickstart_without_redis_url_starts_its_own_server() {
    let output = run_example("quickstart", |cargo| {
        cargo.env_remove("REDIS_URL");
    });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let first = stdout.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("using a throwaway redis-server at 127.0.0.1:")
            && !first.ends_with(":6379"),
        "the quickstart did not start a server of its own\n--- stdout ---\n{stdout}"
    );
}

/// Runs an example with the environment `configure` sets; panics with its
/// output unless it succeeds and prints something.
fn run_example(name: &str, configure: impl FnOnce(&mut std::process::Command)) -> Output {
    let mut example = std::process::Command::new(support::example(name));
    configure(&mut example);
    let output = example
        .output()
        .unwrap_or_else(|e| panic!("could not run example {name}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "example {name} failed with {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        output.status
    );
    assert!(
        !stdout.trim().is_empty(),
        "example {name} printed nothing\n--- stderr ---\n{stderr}"
    );
    output
}

/// Fills `server` with data an example must not touch: a message in a
/// queue of each example's own name (keyed, in the quickstart's), and a key
/// of another application. Returns the keyspace it leaves.
fn seed_someone_elses_data(server: &RedisServer) -> BTreeMap<String, Vec<u8>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let conn = support::manager(server).await;
        let names = [
            "quickstart-orders",
            "keyed-orders",
            "strategies-example",
            "pipeline-deferred",
            "limits-jobs",
            "prometheus-orders",
        ];
        for name in names {
            let queue: Queue<String> = Queue::new(conn.clone(), name).expect("a queue");
            let message = format!("someone else's message in {name}");
            queue.push(&message).await.expect("a push");
        }
        let queue: Queue<String> = Queue::new(conn, "quickstart-orders").expect("a queue");
        let keyed = PushOptions::new().key("alice");
        queue
            .push_with(&"theirs, keyed".to_owned(), keyed)
            .await
            .expect("a keyed push");
    });
    let mut set = redis::cmd("SET");
    set.arg(&["app:config", "do not purge me"]);
    server.query::<()>(&set).expect("SET");
    keyspace(server)
}

/// Every key of `server` and its value (`DUMP`): a throwaway server with
/// few keys, so `KEYS` is fine here.
fn keyspace(server: &RedisServer) -> BTreeMap<String, Vec<u8>> {
    let keys: Vec<String> = server
        .query(&redis::cmd("KEYS").arg("*").clone())
        .expect("KEYS");
    keys.into_iter()
        .filter_map(|key| {
            let dump: Option<Vec<u8>> = server.query(redis::cmd("DUMP").arg(&key)).expect("DUMP");
            // A key that expired between KEYS and DUMP is gone.
            Some((key, dump?))
        })
        .collect()
}

/// Panics, naming the keys, unless `after` is `before`: nothing of yours
/// deleted or changed, nothing of the example's left behind.
fn assert_same_keys(
    example: &str,
    before: &BTreeMap<String, Vec<u8>>,
    after: &BTreeMap<String, Vec<u8>>,
) {
    let gone: Vec<_> = before.keys().filter(|k| !after.contains_key(*k)).collect();
    let changed: Vec<_> = before
        .iter()
        .filter(|(k, v)| after.get(*k).is_some_and(|now| now != *v))
        .map(|(k, _)| k)
        .collect();
    let left: Vec<_> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    assert!(
        gone.is_empty() && changed.is_empty() && left.is_empty(),
        "example {example} did not leave a server it did not start as it found it:\n\
         deleted {gone:?}\nchanged {changed:?}\nleft behind {left:?}"
    );
}

/// A loopback address whose port was free a moment ago.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").to_string()
}
