//! `lockgate dashboard` over HTTP: every page and action against a real
//! redis-server, hostile payloads rendered as text, the token rule, a
//! server that goes away.

mod web;

use lockgate::testing::RedisServer;
use lockgate::{Locker, PushOptions, Queue};
use serde_json::json;
use web::{Dashboard, csrf};

/// A queue with waiting, delayed, prioritized and dead messages, a held
/// lock and permits.
async fn fill(server: &RedisServer) {
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "orders").unwrap();
    q.push_with(json!({"order": 1}), PushOptions::new().id("o-1"))
        .await
        .unwrap();
    q.push_with(
        json!({"order": 2}),
        PushOptions::new().id("o-2").priority(7),
    )
    .await
    .unwrap();
    q.push_with(
        json!({"order": 3}),
        PushOptions::new()
            .id("o-3")
            .after(std::time::Duration::from_secs(600)),
    )
    .await
    .unwrap();
    for (id, error) in [("d-1", "card declined"), ("d-2", "timeout")] {
        q.push_with(json!({"order": id}), PushOptions::new().id(id).priority(9))
            .await
            .unwrap();
        let job = q
            .claim(1, std::time::Duration::from_secs(30))
            .await
            .unwrap()
            .jobs
            .remove(0);
        assert_eq!(job.id(), id);
        q.bury(&job, error).await.unwrap();
    }
    let locker = Locker::new(conn)
        .ttl(std::time::Duration::from_secs(60))
        .unwrap();
    let lease = locker.acquire("account-42").await.unwrap().lease().unwrap();
    locker.fence(&lease).await.unwrap();
    assert!(
        locker
            .acquire_permit("tenant-7", 3)
            .await
            .unwrap()
            .lease()
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_page_and_action_works() {
    let server = RedisServer::start().unwrap();
    fill(&server).await;
    let board = Dashboard::start(&server, &[]);

    let (status, overview) = board.get("/");
    assert_eq!(status, 200);
    assert!(overview.contains(r#"href="/queue/orders""#), "{overview}");
    assert!(overview.contains("data-refresh=\"/fragment/overview\""));
    let (status, fragment) = board.get("/fragment/overview");
    assert_eq!(status, 200);
    assert!(fragment.contains("orders") && !fragment.contains("<html"));

    let (status, page) = board.get("/queue/orders");
    assert_eq!(status, 200);
    for needle in [
        "o-1",
        "o-2",
        "o-3",
        "d-1",
        "d-2",
        "card declined",
        "timeout",
        "Requeue",
    ] {
        assert!(
            page.contains(needle),
            "{needle} missing from the queue page"
        );
    }
    let token = csrf(&page);
    let stats = || async {
        let q: Queue<serde_json::Value> =
            Queue::new(server.connection_manager().await.unwrap(), "orders").unwrap();
        q.stats().await.unwrap()
    };

    // Requeue one dead letter.
    let (status, after) = board.post("/queue/orders/requeue", &[("csrf", &token), ("id", "d-1")]);
    assert_eq!(status, 200, "{after}");
    assert!(after.contains("re-drove d-1"));
    assert_eq!(stats().await.dead, 1);
    // Remove one; requeue all.
    let (status, _) = board.post("/queue/orders/remove", &[("csrf", &token), ("id", "o-3")]);
    assert_eq!(status, 200);
    assert_eq!(stats().await.later, 0);
    let (status, after) = board.post("/queue/orders/requeue", &[("csrf", &token), ("all", "1")]);
    assert_eq!(status, 200);
    assert!(after.contains("re-drove 1 dead letters"), "{after}");
    assert_eq!(stats().await.dead, 0);

    // Refused: no token, a wrong one, a cross-site request.
    let (status, _) = board.post("/queue/orders/requeue", &[("id", "d-1")]);
    assert!(status == 403 || status == 422, "{status}");
    let (status, _) = board.post("/queue/orders/remove", &[("csrf", "nope"), ("id", "o-1")]);
    assert_eq!(status, 403);
    let (status, _) =
        board.post_cross_site("/queue/orders/remove", &[("csrf", &token), ("id", "o-1")]);
    assert_eq!(status, 403);
    assert_eq!(stats().await.due, 4);
    // GETs change nothing.
    let (status, _) = board.get("/queue/orders/purge");
    assert_eq!(status, 405);

    // Purge needs the name typed.
    let (_, after) = board.post(
        "/queue/orders/purge",
        &[("csrf", &token), ("confirm", "wrong")],
    );
    assert!(after.contains("not purged"));
    assert_eq!(stats().await.due, 4);
    let (status, after) = board.post(
        "/queue/orders/purge",
        &[("csrf", &token), ("confirm", "orders")],
    );
    assert_eq!(status, 200);
    assert!(
        !after.contains(r#"href="/queue/orders""#),
        "purged, yet listed: {after}"
    );
    assert_eq!(stats().await.due, 0);
    let (status, _) = board.get("/queue/orders");
    assert_eq!(status, 404);

    // Locks and permits, searchable.
    let (status, locks) = board.get("/locks?match=account-*");
    assert_eq!(status, 200);
    assert!(
        locks.contains("account-42") && !locks.contains("tenant-7"),
        "{locks}"
    );
    let (_, locks) = board.get("/locks");
    assert!(
        locks.contains("account-42") && locks.contains("tenant-7"),
        "{locks}"
    );

    // Assets and headers.
    let (status, script) = board.get("/assets/app.js");
    assert_eq!(status, 200);
    assert!(script.contains("data-refresh") || script.contains("dataset.refresh"));
    let csp = board.header("/", "content-security-policy").unwrap();
    assert!(csp.contains("script-src 'self'"), "{csp}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_payloads_and_errors_render_as_text() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn.clone(), "evil").unwrap();
    let script = "<script>alert('payload')</script>\"'&";
    q.push_with(
        json!({ "html": script }),
        PushOptions::new().id("<b>id</b>"),
    )
    .await
    .unwrap();
    q.push_with(json!("x"), PushOptions::new().id("poison"))
        .await
        .unwrap();
    let job = q
        .claim(2, std::time::Duration::from_secs(30))
        .await
        .unwrap()
        .jobs;
    let poison = job.iter().find(|j| j.id() == "poison").unwrap();
    q.bury(poison, "<img src=x onerror=alert('error')>")
        .await
        .unwrap();
    // A record whose payload is not UTF-8 at all, written as another
    // producer could.
    let _: () = redis::pipe()
        .hset(
            "lockgate:{evil}:data",
            "bytes",
            b"1:0:0:\xff\xfe<script>".as_slice(),
        )
        .zadd("lockgate:{evil}:schedule", "bytes", 1)
        .query_async(&mut conn.clone())
        .await
        .unwrap();
    let board = Dashboard::start(&server, &[]);
    let (status, page) = board.get("/queue/evil");
    assert_eq!(status, 200);
    assert!(
        !page.contains("<script>alert"),
        "a payload's script reached the page"
    );
    assert!(
        !page.contains("<img src=x"),
        "an error's markup reached the page"
    );
    assert!(
        !page.contains("<b>id</b>"),
        "an id's markup reached the page"
    );
    assert!(page.contains("&lt;script&gt;alert"), "{page}");
    assert!(page.contains("&lt;img src=x onerror=alert"), "{page}");
    assert!(page.contains("&lt;b&gt;id&lt;/b&gt;"));
    assert!(
        page.contains('\u{FFFD}'),
        "invalid UTF-8 shows as replacement characters"
    );
    // Only our own script tag.
    assert_eq!(page.matches("<script").count(), 1, "{page}");
}

#[tokio::test]
async fn beyond_loopback_a_token_is_required() {
    let server = RedisServer::start().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lockgate"))
        .args(["--url", &server.url(), "dashboard", "--bind", "0.0.0.0:0"])
        .env_remove("LOCKGATE_DASHBOARD_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--token"));

    // With a token (here on loopback), nothing is shown without it.
    let board = Dashboard::start(&server, &["--token", "s3cret"]);
    assert_eq!(board.get("/").0, 401);
    assert_eq!(board.get("/locks").0, 401);
    assert_eq!(board.get("/login?token=wrong").0, 401);
    let cookie = board.login("s3cret");
    assert_eq!(board.get_with_cookie("/", &cookie).0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_that_cannot_reach_redis_says_so_and_recovers() {
    let mut server = RedisServer::start().unwrap();
    fill(&server).await;
    let board = Dashboard::start(&server, &[]);
    assert_eq!(board.get("/").0, 200);
    server.stop();
    let (status, page) = board.get("/");
    assert_eq!(status, 503);
    assert!(page.contains("Redis is unreachable"), "{page}");
    assert!(!page.contains("panicked") && !page.contains("backtrace"));
    server.restart().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while board.get("/").0 != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the dashboard never reconnected"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_queue_shows_its_busy_keys_and_longest_lines() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn, "keyed").unwrap();
    for (key, n) in [("acct-a", 3), ("acct-b", 1)] {
        for i in 0..n {
            let options = PushOptions::new().key(key);
            q.push_with(json!({"n": i}), options).await.unwrap();
        }
    }
    let claimed = q.claim(10, std::time::Duration::from_secs(60)).await;
    assert_eq!(claimed.unwrap().jobs.len(), 2);
    let board = Dashboard::start(&server, &[]);
    let (status, page) = board.get("/queue/keyed");
    assert_eq!(status, 200);
    for needle in [
        "2 keys with messages in line or at work",
        "Busy keys",
        "Longest lines",
        "<code>acct-a</code>",
        "<code>acct-b</code>",
        // The messages at work and first in line, with their keys.
        r#"<td class="key"><code>acct-a</code></td>"#,
    ] {
        assert!(page.contains(needle), "{needle} missing: {page}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_queue_shows_one_view_and_each_shard() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn, "spread")
        .and_then(|q| q.shards(3))
        .unwrap();
    let messages: Vec<serde_json::Value> = (0..30).map(|n| json!({"n": n})).collect();
    q.push_many(&messages).await.unwrap();
    let board = Dashboard::start(&server, &[]);
    let (status, page) = board.get("/queue/spread");
    assert_eq!(status, 200);
    for needle in [
        "due <b class=\"due\">30</b>",
        "3 shards of the messages without a key",
        "shard 2",
    ] {
        assert!(page.contains(needle), "{needle} missing: {page}");
    }
}
