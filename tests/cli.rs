//! The `lockgate` command-line tool, run against a throwaway server.

use std::process::{Command, Output};

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
        &["push", "orders", r#"{"n":2}"#, "--after", "60000"],
    ));
    let stats = stdout(&lockgate(&server, &["stats", "orders"]));
    assert!(
        stats.contains("due     1") && stats.contains("later   1"),
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

    // Bad input: a clear message and a failing exit status, never a panic.
    for bad in [
        &["bogus"][..],
        &["push", "orders", "not json"],
        &["requeue", "orders", "nope"],
        &["stats"],
        &["permits"],
    ] {
        let output = lockgate(&server, bad);
        assert!(!output.status.success(), "{bad:?} succeeded");
        assert!(
            String::from_utf8_lossy(&output.stderr).starts_with("lockgate: "),
            "{bad:?}"
        );
    }
}
