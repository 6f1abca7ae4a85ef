//! The metrics lockgate records through the `metrics` facade, scraped from
//! `examples/prometheus.rs` over HTTP while it runs: the counters move.

use crate::support;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lockgate::testing::RedisServer;

/// `GET /metrics` from `addr`; `None` while nothing answers there.
fn scrape(addr: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    response.starts_with("HTTP/1.1 200").then_some(response)
}

/// The samples of a Prometheus text page: `name{labels}` → value.
fn samples(page: &str) -> HashMap<String, f64> {
    page.lines()
        .filter(|line| line.starts_with("lockgate_"))
        .filter_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn the_prometheus_example_serves_counters_that_move() {
    let server =
        RedisServer::start().unwrap_or_else(|e| panic!("could not start redis-server: {e}"));
    let addr = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    };
    let mut example = std::process::Command::new(support::example("prometheus"))
        .env("REDIS_URL", server.url())
        .env("METRICS_ADDR", &addr)
        .env("RUN_FOR_MS", "6000")
        .stdout(Stdio::null())
        .spawn()
        .expect("running the example");
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = r#"lockgate_messages_done_total{queue="prometheus-orders"}"#;
    let first = loop {
        if let Some(page) = scrape(&addr)
            && samples(&page).get(done).is_some_and(|n| *n > 0.0)
        {
            break samples(&page);
        }
        assert!(
            example.try_wait().unwrap().is_none(),
            "the example ended before it served metrics"
        );
        assert!(Instant::now() < deadline, "no metrics at {addr}");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_millis(1000));
    let second = samples(&scrape(&addr).expect("a second scrape"));
    let status = example.wait().unwrap();
    assert!(status.success(), "the example failed: {status}");

    assert!(second[done] > first[done], "{first:?}\n{second:?}");
    let claimed = r#"lockgate_messages_claimed_total{queue="prometheus-orders"}"#;
    assert!(second[claimed] > first[claimed]);
    assert!(second["lockgate_lock_acquired_total"] > first["lockgate_lock_acquired_total"]);
    for name in [
        r#"lockgate_messages_retried_total{queue="prometheus-orders"}"#,
        r#"lockgate_handler_duration_seconds_count{queue="prometheus-orders"}"#,
        r#"lockgate_due_lag_seconds_count{queue="prometheus-orders"}"#,
        r#"lockgate_lock_contended_total{outcome="acquired"}"#,
        r#"lockgate_queue_messages{queue="prometheus-orders",state="due"}"#,
    ] {
        assert!(second.contains_key(name), "{name} missing: {second:?}");
    }
}
