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

/// Dead letters are paged by cursor (issue 38): the next page's link
/// carries the last letter's place, that page and its refresh read from
/// there, and re-driving a letter of an earlier page does not shift it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_paged_by_cursor_and_refreshed_page_by_page() {
    let server = RedisServer::start().unwrap();
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn, "letters").unwrap();
    for i in 0..30 {
        let id = format!("dead-{i:02}");
        q.push_with(json!({ "n": i }), PushOptions::new().id(&id))
            .await
            .unwrap();
        let job = q.claim(1, std::time::Duration::from_secs(30)).await;
        q.bury(&job.unwrap().jobs[0], "failed").await.unwrap();
    }
    let board = Dashboard::start(&server, &[]);
    // Whether the dead-letter table shows exactly the letters `ids`.
    let shows = |page: &str, ids: &[usize]| {
        let table = &page[page.find(r#"id="dead""#).expect("the dead letters")..];
        (0..30).all(|i| table.contains(&format!(">dead-{i:02}<")) == ids.contains(&i))
    };
    let range = |r: std::ops::Range<usize>| r.collect::<Vec<_>>();

    let (status, first) = board.get("/queue/letters");
    assert_eq!(status, 200);
    assert!(shows(&first, &range(0..25)), "the first page: {first}");
    assert!(!first.contains("first page"));
    let link = r#"<a class="next" href="/queue/letters?after="#;
    let start = first.find(link).expect("a next page link") + link.len();
    let after = &first[start..start + first[start..].find("#dead").unwrap()];
    assert!(
        after.ends_with("-dead-24"),
        "the last letter's place: {after}"
    );

    // A letter of the first page re-driven: the second page stays.
    assert!(q.requeue_dead("dead-03").await.unwrap());
    let (status, second) = board.get(&format!("/queue/letters?after={after}"));
    assert_eq!(status, 200);
    assert!(shows(&second, &range(25..30)), "the second page: {second}");
    assert!(second.contains("first page") && !second.contains(r#"class="next""#));
    let refresh = format!(r#"data-refresh="/fragment/queue/letters?after={after}""#);
    assert!(
        second.contains(&refresh),
        "the refresh reads this page: {second}"
    );
    let (status, fragment) = board.get(&format!("/fragment/queue/letters?after={after}"));
    assert_eq!(status, 200);
    assert!(shows(&fragment, &range(25..30)), "{fragment}");
    // A malformed cursor shows the first page.
    let (status, page) = board.get("/queue/letters?after=nonsense");
    assert_eq!(status, 200);
    let first_now: Vec<usize> = (0..26).filter(|&i| i != 3).collect();
    assert!(shows(&page, &first_now), "{page}");
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

// ---------------------------------------------------------------------------
// The Host rule (issue 34): a page on another site can point its own name at
// 127.0.0.1 after it loaded (DNS rebinding); the operator's browser then
// treats the dashboard as that site, reads its form token and posts with
// `Sec-Fetch-Site: same-origin`. Only the `Host` header tells such a request
// apart, so every request under a name that is not the dashboard's is
// refused before it reaches Redis.

/// A queue `orders` with two waiting messages and one dead letter, and
/// nothing else: no lock whose lease would renew in the background while a
/// test counts the server's commands.
async fn orders(server: &RedisServer) -> Queue<serde_json::Value> {
    let conn = server.connection_manager().await.unwrap();
    let q: Queue<serde_json::Value> = Queue::new(conn, "orders").unwrap();
    for id in ["o-1", "o-2"] {
        q.push_with(json!({ "id": id }), PushOptions::new().id(id))
            .await
            .unwrap();
    }
    let options = PushOptions::new().id("d-1").priority(9);
    q.push_with(json!({ "id": "d-1" }), options).await.unwrap();
    let claimed = q.claim(1, std::time::Duration::from_secs(30)).await;
    let job = claimed.unwrap().jobs.remove(0);
    assert_eq!(job.id(), "d-1");
    q.bury(&job, "card declined").await.unwrap();
    q
}

/// Due, later, active and dead: what a purge, requeue or remove changes.
async fn counts(q: &Queue<serde_json::Value>) -> (u64, u64, u64, u64) {
    let s = q.stats().await.unwrap();
    (s.due, s.later, s.active, s.dead)
}

/// Resets the server's per-command counters (`CONFIG RESETSTAT`).
fn reset_counts(server: &RedisServer) {
    let _: () = server.query(redis::cmd("CONFIG").arg("RESETSTAT")).unwrap();
}

/// The commands the server ran since [`reset_counts`], with their calls,
/// less the test's own: `CONFIG`, `INFO`, and what a fresh connection sends
/// (`CLIENT SETINFO`, `HELLO`).
fn commands_since_reset(server: &RedisServer) -> Vec<(String, u64)> {
    let info: String = server
        .query(redis::cmd("INFO").arg("commandstats"))
        .unwrap();
    let ours = |name: &str| {
        ["config", "info", "client", "hello"]
            .iter()
            .any(|own| name == *own || name.starts_with(&format!("{own}|")))
    };
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_")?.split_once(':'))
        .filter(|(name, _)| !ours(name))
        .map(|(name, fields)| {
            let calls = fields
                .split(',')
                .find_map(|f| f.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            (name.to_owned(), calls)
        })
        .collect()
}

/// `Host` headers a browser may send to the dashboard on 127.0.0.1:`port`
/// that are not its names: a rebinding site's name (with its port, without,
/// in capitals, dressed up as localhost or as the IP), IP literals of other
/// addresses, the right names with the wrong port (no port is port 80), an
/// empty one, and none at all.
fn foreign_hosts(port: u16) -> Vec<Option<String>> {
    let other = if port == 7085 { 7086 } else { 7085 };
    let hosts = [
        format!("attacker.example:{port}"),
        "attacker.example".to_owned(),
        format!("ATTACKER.EXAMPLE:{port}"),
        format!("localhost.attacker.example:{port}"),
        format!("127.0.0.1.attacker.example:{port}"),
        format!("10.9.8.7:{port}"),
        "10.9.8.7".to_owned(),
        format!("127.0.0.2:{port}"),
        format!("[::2]:{port}"),
        format!("0.0.0.0:{port}"),
        format!("127.0.0.1:{other}"),
        format!("localhost:{other}"),
        format!("[::1]:{other}"),
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        format!("127.0.0.1:{port}.attacker.example"),
        format!("attacker.example@127.0.0.1:{port}"),
        String::new(),
    ];
    hosts.into_iter().map(Some).chain([None]).collect()
}

/// Every kind of request the dashboard answers, as (method, path, form):
/// its pages and fragments, an asset, the login, and the three actions
/// with the page's real form token, a purge confirmed.
fn every_request(csrf: &str) -> Vec<(&'static str, &'static str, String)> {
    vec![
        ("GET", "/", String::new()),
        ("GET", "/fragment/overview", String::new()),
        ("GET", "/queue/orders", String::new()),
        ("GET", "/fragment/queue/orders", String::new()),
        ("GET", "/locks", String::new()),
        ("GET", "/assets/app.js", String::new()),
        ("GET", "/login?token=s3cret", String::new()),
        (
            "POST",
            "/queue/orders/purge",
            format!("csrf={csrf}&confirm=orders"),
        ),
        (
            "POST",
            "/queue/orders/requeue",
            format!("csrf={csrf}&all=1"),
        ),
        (
            "POST",
            "/queue/orders/remove",
            format!("csrf={csrf}&id=o-1"),
        ),
    ]
}

/// Sends [`every_request`] under each of `hosts`, as the operator's browser
/// sends them to a rebound name (same-origin, with `cookie` when given),
/// and once more with each foreign name in the request line itself
/// (absolute form) beside the dashboard's own `Host`. Each must be refused
/// (421 or 403) without the form token or a cookie in the answer.
fn assert_refused(board: &Dashboard, hosts: &[Option<String>], cookie: Option<&str>, csrf: &str) {
    let own = format!("127.0.0.1:{}", board.port());
    for host in hosts {
        for (method, path, form) in every_request(csrf) {
            let origin = format!("http://{}", host.as_deref().unwrap_or(&own));
            let mut headers = vec![("Sec-Fetch-Site", "same-origin")];
            if method == "POST" {
                headers.push(("Origin", &origin));
            }
            if let Some(cookie) = cookie {
                headers.push(("Cookie", cookie));
            }
            let mut tries = vec![(path.to_owned(), host.as_deref())];
            // (Only names an HTTP parser takes in a URL: others never
            // reach the dashboard that way.)
            let well_formed = |h: &&str| {
                !h.is_empty()
                    && !h.contains('@')
                    && h.rsplit_once(':')
                        .is_none_or(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            };
            if let Some(name) = host.as_deref().filter(well_formed) {
                tries.push((format!("http://{name}{path}"), Some(own.as_str())));
            }
            for (target, host) in tries {
                let answer = board.send(method, &target, host, &headers, &form);
                assert!(
                    matches!(answer.status, 421 | 403),
                    "{method} {target} with Host {host:?} was not refused: {} {}",
                    answer.status,
                    answer.body
                );
                assert!(
                    !answer.body.contains(csrf),
                    "the form token went to Host {host:?}"
                );
                assert!(answer.header("set-cookie").is_none(), "{answer:?}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_host_is_refused_before_any_redis_call() {
    let server = RedisServer::start().unwrap();
    let q = orders(&server).await;
    let board = Dashboard::start(&server, &[]);
    let (status, page) = board.get("/queue/orders");
    assert_eq!(status, 200);
    let token = csrf(&page);
    let before = counts(&q).await;

    // The issue's requests, word for word: the page with its form token,
    // then the purge.
    let port = board.port();
    let rebound = format!("attacker.example:{port}");
    let origin = format!("http://{rebound}");
    let page = board.send("GET", "/queue/orders", Some(&rebound), &[], "");
    assert_eq!(page.status, 421, "{}", page.body);
    assert!(
        page.body.contains(&rebound) && page.body.contains("--allowed-host"),
        "the refusal names the Host and how to allow it: {}",
        page.body
    );
    let purge = board.send(
        "POST",
        "/queue/orders/purge",
        Some(&rebound),
        &[("Origin", &origin), ("Sec-Fetch-Site", "same-origin")],
        &format!("csrf={token}&confirm=orders"),
    );
    assert_eq!(purge.status, 421, "{}", purge.body);

    // Every request under every foreign name, and not one Redis command.
    reset_counts(&server);
    assert_refused(&board, &foreign_hosts(port), None, &token);
    let ran = commands_since_reset(&server);
    assert!(
        ran.is_empty(),
        "Redis was called for a foreign Host: {ran:?}"
    );
    assert_eq!(counts(&q).await, before, "the queue changed");

    // The count does see the dashboard's calls: under its own name, the
    // same page reaches Redis.
    reset_counts(&server);
    let own = format!("127.0.0.1:{port}");
    assert_eq!(
        board
            .send("GET", "/queue/orders", Some(&own), &[], "")
            .status,
        200
    );
    assert!(!commands_since_reset(&server).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_host_is_refused_even_after_login() {
    let server = RedisServer::start().unwrap();
    let q = orders(&server).await;
    let board = Dashboard::start(&server, &["--token", "s3cret"]);
    let cookie = board.login("s3cret");
    let (status, page) = board.get_with_cookie("/queue/orders", &cookie);
    assert_eq!(status, 200);
    let token = csrf(&page);
    let before = counts(&q).await;

    reset_counts(&server);
    let hosts = foreign_hosts(board.port());
    // With the operator's login cookie, as the browser sends it to a name
    // rebound to the dashboard; and without it, where the login is open.
    assert_refused(&board, &hosts, Some(&cookie), &token);
    assert_refused(&board, &hosts, None, &token);
    let ran = commands_since_reset(&server);
    assert!(
        ran.is_empty(),
        "Redis was called for a foreign Host: {ran:?}"
    );
    assert_eq!(counts(&q).await, before, "the queue changed");
    // The login still works under the dashboard's own name.
    assert_eq!(board.get_with_cookie("/queue/orders", &cookie).0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_names_and_the_allowed_ones_are_served() {
    let server = RedisServer::start().unwrap();
    orders(&server).await;
    let by_flag = Dashboard::start(
        &server,
        &[
            "--allowed-host",
            "dash.example.com",
            "--allowed-host",
            "Proxy.example:8443",
        ],
    );
    let by_env = Dashboard::start_with_env(
        &server,
        &[],
        &[(
            "LOCKGATE_DASHBOARD_ALLOWED_HOSTS",
            "dash.example.com,proxy.example:8443",
        )],
    );
    for board in [&by_flag, &by_env] {
        let port = board.port();
        for host in [
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("LocalHost:{port}"),
            format!("[::1]:{port}"),
            // A reverse proxy passes on the name the browser used, with
            // or without a port: an allowed name without one takes any.
            "dash.example.com".to_owned(),
            "dash.example.com:443".to_owned(),
            format!("DASH.example.COM:{port}"),
            "proxy.example:8443".to_owned(),
        ] {
            let answer = board.send("GET", "/queue/orders", Some(&host), &[], "");
            assert_eq!(answer.status, 200, "Host {host}: {}", answer.body);
        }
        for host in [
            "proxy.example",
            "proxy.example:443",
            "dash.example.com.attacker.example",
            "attacker.example",
        ] {
            let answer = board.send("GET", "/queue/orders", Some(host), &[], "");
            assert_eq!(answer.status, 421, "Host {host}: {}", answer.body);
        }
    }
}

#[tokio::test]
async fn on_every_address_the_names_it_is_reached_by_are_required() {
    let server = RedisServer::start().unwrap();
    // The usage error (exit 2) and what it says; a dashboard that starts
    // instead is stopped after a few seconds and fails the test.
    let start = |args: &[&str]| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lockgate"))
            .args(["--url", &server.url(), "dashboard"])
            .args(args)
            .env_remove("LOCKGATE_DASHBOARD_TOKEN")
            .env_remove("LOCKGATE_DASHBOARD_ALLOWED_HOSTS")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("`lockgate dashboard {}` started", args.join(" "));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    };
    let out = start(&["--bind", "0.0.0.0:0", "--token", "s3cret"]);
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(
        error.contains("--allowed-host") && error.contains("LOCKGATE_DASHBOARD_ALLOWED_HOSTS"),
        "{error}"
    );
    assert!(!error.contains("--token"), "the token was given: {error}");
    // Neither: both are asked for.
    let out = start(&["--bind", "[::]:0"]);
    assert_eq!(out.status.code(), Some(2));
    let error = String::from_utf8_lossy(&out.stderr);
    assert!(
        error.contains("--allowed-host") && error.contains("--token"),
        "{error}"
    );
    // A URL or a path is not a host name.
    for bad in ["http://dash.example.com", "dash.example.com/", "", "a b"] {
        let out = start(&["--allowed-host", bad]);
        assert_eq!(out.status.code(), Some(2), "--allowed-host {bad:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_login_cookie_is_a_random_session_not_the_token() {
    let server = RedisServer::start().unwrap();
    orders(&server).await;
    let board = Dashboard::start(&server, &["--token", "s3cret"]);
    let first = board.set_cookie("s3cret");
    let second = board.set_cookie("s3cret");
    for cookie in [&first, &second] {
        assert!(
            !cookie.contains("s3cret"),
            "the token is in the cookie: {cookie}"
        );
        assert!(cookie.starts_with("lockgate_session="), "{cookie}");
        assert!(
            cookie.contains("Max-Age=43200"),
            "sessions expire: {cookie}"
        );
    }
    let session = |c: &str| c.split(';').next().unwrap().to_owned();
    assert_ne!(
        session(&first),
        session(&second),
        "each login its own session"
    );
    assert_eq!(board.get_with_cookie("/", &session(&first)).0, 200);
    assert_eq!(board.get_with_cookie("/", &session(&second)).0, 200);
    // A made-up session, and the old cookie holding the token, are refused.
    let made_up = format!("lockgate_session={}", "ab".repeat(32));
    assert_eq!(board.get_with_cookie("/", &made_up).0, 401);
    assert_eq!(board.get_with_cookie("/", "lockgate_token=s3cret").0, 401);
    assert_eq!(board.get_with_cookie("/", "lockgate_session=s3cret").0, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_from_another_origin_is_refused() {
    let server = RedisServer::start().unwrap();
    let q = orders(&server).await;
    let board = Dashboard::start(&server, &[]);
    let token = csrf(&board.get("/queue/orders").1);
    let own = format!("127.0.0.1:{}", board.port());
    let remove = |origin: &str| {
        let headers = [("Origin", origin)];
        let form = format!("csrf={token}&id=o-1");
        board.send("POST", "/queue/orders/remove", Some(&own), &headers, &form)
    };
    // With the right token and Host, from a browser that sends `Origin`
    // but not `Sec-Fetch-Site`: another site, another port on this
    // machine, an opaque origin.
    let other_port = format!("http://localhost:{}", board.port() ^ 1);
    for origin in ["http://attacker.example", &other_port, "null", "file://"] {
        assert_eq!(remove(origin).status, 403, "Origin {origin}");
    }
    assert_eq!(counts(&q).await.0, 2);
    // From its own pages, it acts.
    assert_eq!(remove(&format!("http://{own}")).status, 303);
    assert_eq!(counts(&q).await.0, 1);
}
