//! lockgate as a least-privilege ACL user: the rule the README documents
//! (read from the README itself, so the two cannot drift apart) is enough
//! for everything, on a server whose `default` user is disabled; a command
//! the rule does not allow fails with an error that names it.

use crate::story;
use crate::support;

use lockgate::testing::RedisServer;
use lockgate::{Acquisition, Job, Locker, Queue, ReleaseListener, Worker};
use support::{ms, secs};

const PASSWORD: &str = "acl-test-secret";

/// The README's rule, with the test's password.
fn readme_rule() -> Vec<String> {
    let readme = include_str!("../../README.md");
    let line = readme
        .lines()
        .find(|line| line.starts_with("ACL SETUSER lockgate "))
        .expect("the README documents an ACL rule for a lockgate user");
    line.split_whitespace()
        .map(|word| match word {
            ">CHANGE-ME" => format!(">{PASSWORD}"),
            word => word.to_owned(),
        })
        .collect()
}

/// A server where `rule` is the only user that can log in.
fn server_with(rule: &[String]) -> RedisServer {
    let server = support::server();
    let mut cmd = redis::cmd(&rule[0]);
    for word in &rule[1..] {
        cmd.arg(word);
    }
    server.query::<()>(&cmd).expect("the rule is valid");
    server
        .query::<()>(redis::cmd("ACL").arg("SETUSER").arg("default").arg("off"))
        .expect("disabling default");
    server
}

/// A client that logs in as the lockgate user.
fn client(server: &RedisServer) -> redis::Client {
    let url = format!("redis://lockgate:{PASSWORD}@127.0.0.1:{}/", server.port());
    redis::Client::open(url).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_works_as_the_readme_acl_user_with_default_disabled() {
    let server = server_with(&readme_rule());
    // No way in without the user.
    let anonymous = redis::Client::open(server.url()).unwrap();
    let mut conn = anonymous.get_multiplexed_async_connection().await.unwrap();
    let refused: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    assert!(refused.is_err(), "the default user still works");

    let client = client(&server);
    let conn = client.get_connection_manager().await.unwrap();
    let listener = ReleaseListener::connect(client.clone()).await.unwrap();
    story::everything(conn, client, listener, "lockgate").await;
}

#[tokio::test]
async fn a_worker_whose_user_may_not_block_stops_with_an_error_naming_blpop() {
    let rule: Vec<String> = readme_rule()
        .into_iter()
        .filter(|word| word != "+blpop")
        .collect();
    let server = server_with(&rule);
    let client = client(&server);
    let conn = client.get_connection_manager().await.unwrap();
    let queue: Queue<u32, _> = Queue::new(conn, "denied").unwrap();
    queue.push(1).await.unwrap();
    let handled = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = tower::service_fn({
        let handled = handled.clone();
        move |_: Job<u32>| {
            handled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async { Ok::<_, lockgate::BoxError>(()) }
        }
    });
    let worker = Worker::new(client, queue.clone(), service);
    // It stops once the refusal has lasted 5 s.
    let error = tokio::time::timeout(secs(30), worker.run_until(std::future::pending::<()>()))
        .await
        .expect("the worker stopped rather than waiting for a permission")
        .expect_err("the worker ran without BLPOP");
    assert!(error.is_denied(), "{error:?}");
    assert!(error.to_string().contains("blpop"), "{error}");
    // What was due was handled before the worker went idle.
    assert_eq!(handled.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(queue.stats().await.unwrap().due, 0);
}

#[tokio::test]
async fn keys_outside_the_users_pattern_are_refused_with_a_clear_error() {
    let server = server_with(&readme_rule());
    let conn = client(&server).get_connection_manager().await.unwrap();
    let allowed = Locker::new(conn.clone()).ttl(secs(1)).unwrap();
    assert!(matches!(
        allowed.acquire("k").await.unwrap(),
        Acquisition::Acquired(_)
    ));
    let other = Locker::new(conn)
        .prefix("other")
        .unwrap()
        .ttl(secs(1))
        .unwrap();
    let error = tokio::time::timeout(ms(5000), other.acquire("k"))
        .await
        .expect("no hang")
        .expect_err("a key outside ~lockgate:* was written");
    assert!(error.is_denied(), "{error:?}");
    assert!(
        error.to_string().to_lowercase().contains("no permissions"),
        "{error}"
    );
}

/// Keyed messages under the README's rule: pushed, claimed with their
/// key's lock, handled, continued, recovered and re-driven.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_messages_work_as_the_readme_acl_user() {
    let server = server_with(&readme_rule());
    let client = client(&server);
    let conn = client.get_connection_manager().await.unwrap();
    let queue: Queue<u32, _> = Queue::new(conn.clone(), "keyed")
        .unwrap()
        .record_events(100)
        .unwrap();
    for n in 0..20u32 {
        let options = lockgate::PushOptions::new().key(format!("k{}", n % 4));
        queue.push_with(n, options).await.unwrap();
    }
    let handled = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let service = tower::service_fn({
        let handled = handled.clone();
        move |job: Job<u32>| {
            let first = handled.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0;
            async move {
                if first {
                    return Err::<(), lockgate::BoxError>(format!("{} failed", *job).into());
                }
                Ok(())
            }
        }
    });
    // Seen, and one removed, before the worker starts.
    assert_eq!(queue.key_stats(10).await.unwrap().keys, 4);
    assert_eq!(queue.peek(10).await.unwrap().waiting.len(), 4);
    let last = lockgate::PushOptions::new().id("last").key("k0");
    queue.push_with(99, last).await.unwrap();
    assert!(queue.remove("last").await.unwrap());
    let worker = Worker::new(client, queue.clone(), service)
        .retry_backoff(lockgate::Backoff::exponential(ms(10), ms(20)).unwrap());
    let run = tokio::spawn(worker.run_until(tokio::time::sleep(secs(3))));
    support::eventually("every keyed message handled", secs(10), async || {
        let stats = queue.stats().await.map_err(|e| e.to_string())?;
        support::done_if(stats.due + stats.later + stats.active == 0, stats)
    })
    .await;
    run.await.unwrap().unwrap();
    assert_eq!(handled.load(std::sync::atomic::Ordering::Relaxed), 21);
    assert_eq!(queue.recover(3).await.unwrap().requeued, 0);
    assert_eq!(queue.requeue_all_dead().await.unwrap(), 0);
    let events = queue.events_after("0-0", 1000).await.unwrap();
    assert!(
        events
            .iter()
            .any(|e| e.kind == lockgate::queue::EventKind::KeyReleased)
    );
}

/// A reader whose user may not `SET` (the README's rule without it) still
/// reads `recent_stats`: the reading it cannot keep for the queue's other
/// handles is returned all the same.
#[tokio::test]
async fn recent_stats_read_for_a_user_that_may_not_keep_the_reading() {
    let writer = readme_rule();
    let mut reader: Vec<String> = writer.iter().filter(|w| *w != "+set").cloned().collect();
    reader[2] = "reader".to_owned();
    let server = support::server();
    for rule in [&writer, &reader] {
        let mut cmd = redis::cmd(&rule[0]);
        cmd.arg(&rule[1..]);
        server.query::<()>(&cmd).expect("the rule is valid");
    }
    let conn = client(&server).get_connection_manager().await.unwrap();
    let queue: Queue<u32, _> = Queue::new(conn, "read").unwrap();
    let keyed = (0..3u32).map(|n| (n, lockgate::PushOptions::new().key(format!("k{n}"))));
    queue.push_many_with(keyed).await.unwrap();
    let url = format!("redis://reader:{PASSWORD}@127.0.0.1:{}/", server.port());
    let reader = redis::Client::open(url).unwrap();
    let conn = reader.get_connection_manager().await.unwrap();
    let handle: Queue<u32, _> = Queue::new(conn, "read").unwrap();
    let stats = handle.recent_stats(secs(10)).await.unwrap();
    assert_eq!((stats.due, stats.keys), (3, 3));
}
