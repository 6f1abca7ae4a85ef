//! Waiters woken by the release itself (`LockLayer::wake_on_release`), in
//! this process and in others: mutual exclusion holds, and a waiter sends
//! nothing to Redis while the holder is alive.
//!
//! The cross-process tests run this test binary again as child processes
//! (the ignored test `child`, driven by environment variables).

use crate::support;

use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::time::Duration;

use lockgate::{Backoff, BoxError, LockLayer, Locker, OnConflict, Outcome, ReleaseListener};
use redis::aio::ConnectionManager;
use support::{
    BOUNDED, acquired, manager, ms, now_ns, raw, script_calls, secs, server, spawn_child,
};
use tokio::time::{sleep, timeout};
use tower::{Layer, ServiceExt, service_fn};

/// A backoff that would poll every millisecond: any polling shows.
fn polling_backoff() -> Backoff {
    Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(20))
}

/// A layer over `conn` that retries with `backoff`, woken by `listener`.
fn waiting_layer(
    conn: ConnectionManager,
    ttl: Duration,
    backoff: Backoff,
    listener: ReleaseListener,
) -> LockLayer<ConnectionManager, impl Fn(&String) -> String + Send + Sync + 'static> {
    LockLayer::new(Locker::new(conn).ttl(ttl).unwrap(), |k: &String| k.clone())
        .on_conflict(OnConflict::retry(backoff))
        .wake_on_release(listener)
}

/// Loads the scripts and the listener's channel, so that counts below are
/// the waiter's own.
async fn warm_up(conn: &ConnectionManager) {
    let locker = Locker::new(conn.clone()).ttl(secs(5)).unwrap();
    let lease = acquired(&locker, "warm-up").await;
    assert!(locker.acquire("warm-up").await.unwrap().lease().is_none());
    locker.fence(&lease).await.unwrap();
    assert!(locker.release(&lease).await.unwrap());
}

#[tokio::test]
async fn a_waiter_sleeps_until_the_release_and_sends_nothing_meanwhile() {
    let server = server();
    let conn = manager(&server).await;
    warm_up(&conn).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "hot").await;

    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>("ran") }));
    let before = script_calls(&conn).await;
    let call = tokio::spawn(svc.oneshot("hot".to_owned()));
    // The holder keeps the lock for a while: a polling waiter (1 ms backoff)
    // would try some hundred times meanwhile.
    sleep(ms(400)).await;
    let while_held = script_calls(&conn).await - before;
    assert!(!call.is_finished());
    assert!(
        while_held <= 2,
        "the waiter polled while the holder was alive: {while_held} script calls"
    );
    assert!(holder.release(&lease).await.unwrap());
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
    // The contend that marked the lock, one after the wake-up, and this
    // release: nothing else.
    let all = script_calls(&conn).await - before;
    assert!(all <= 5, "{all} script calls for one wait");
}

/// The README's first layer: a locker made from the client, `retry`, no
/// listener wired by hand. The locker opens the process's listener on the
/// first wait (polling for the moment it takes), and the waiter then sleeps
/// until the release.
#[tokio::test]
async fn a_locker_made_from_a_client_wakes_waiters_without_wiring() {
    let server = server();
    let conn = manager(&server).await;
    warm_up(&conn).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "hot").await;

    let locker = Locker::connect(server.client()).await.unwrap();
    assert!(
        locker.release_listener().is_none(),
        "opened before any wait"
    );
    let layer = LockLayer::new(locker.clone(), |k: &String| k.clone())
        .on_conflict(OnConflict::retry(polling_backoff()));
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>("ran") }));
    let before = script_calls(&conn).await;
    let call = tokio::spawn(svc.clone().oneshot("hot".to_owned()));
    support::eventually("the listener is open", BOUNDED, async || {
        support::done_if(locker.release_listener().is_some(), "not yet")
    })
    .await;
    sleep(ms(50)).await; // the waiter subscribes and marks the lock
    let settled = script_calls(&conn).await;
    sleep(ms(400)).await;
    let while_held = script_calls(&conn).await - settled;
    assert!(!call.is_finished());
    assert!(
        while_held == 0,
        "the waiter polled while the holder was alive: {while_held} script calls"
    );
    assert!(holder.release(&lease).await.unwrap());
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
    let all = script_calls(&conn).await - before;
    assert!(all < 100, "{all} script calls for one wait: it polled");
}

/// `poll_only` opts out: the same waiter polls with its backoff.
#[tokio::test]
async fn poll_only_makes_waiters_poll_even_with_a_listener() {
    let server = server();
    let conn = manager(&server).await;
    warm_up(&conn).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "hot").await;
    let locker = Locker::connect(server.client()).await.unwrap();
    let layer = LockLayer::new(locker, |k: &String| k.clone())
        .on_conflict(OnConflict::retry(polling_backoff()))
        .poll_only();
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>("ran") }));
    let before = script_calls(&conn).await;
    let call = tokio::spawn(svc.oneshot("hot".to_owned()));
    sleep(ms(300)).await;
    let while_held = script_calls(&conn).await - before;
    assert!(
        while_held > 20,
        "only {while_held} script calls: it did not poll"
    );
    assert!(holder.release(&lease).await.unwrap());
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
}

#[tokio::test]
async fn a_holder_that_dies_ends_the_wait_with_its_ttl() {
    let server = server();
    let conn = manager(&server).await;
    warm_up(&conn).await;
    // A holder that never releases (it died): only its TTL frees the key.
    let dead = Locker::new(manager(&server).await).ttl(ms(500)).unwrap();
    let _lease = acquired(&dead, "k").await;

    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>(()) }));
    let before = script_calls(&conn).await;
    let outcome = timeout(BOUNDED, svc.oneshot("k".to_owned()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    let calls = script_calls(&conn).await - before;
    assert!(calls <= 5, "the waiter polled: {calls} script calls");
}

#[tokio::test]
async fn the_wait_is_bounded_by_the_backoff_budget() {
    let server = server();
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let _lease = acquired(&holder, "k").await;
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let backoff = Backoff::exponential(ms(10), ms(10))
        .unwrap()
        .max_elapsed(ms(300));
    let layer = waiting_layer(manager(&server).await, secs(30), backoff, listener);
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>(()) }));
    let err = timeout(BOUNDED, svc.oneshot("k".to_owned()))
        .await
        .expect("the budget ends the wait")
        .unwrap_err();
    let busy = err
        .downcast_ref::<lockgate::Contended>()
        .expect("Contended");
    assert!(busy.retry_after() > secs(25), "{busy}");
}

/// The listener reconnects after the server kills its connection, and
/// waiters are woken by releases again.
#[tokio::test]
async fn the_listener_comes_back_after_its_connection_is_killed() {
    let server = server();
    let conn = manager(&server).await;
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>(()) }));
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();

    for round in 0..3 {
        let lease = acquired(&holder, "k").await;
        let call = tokio::spawn(svc.clone().oneshot("k".to_owned()));
        sleep(ms(100)).await;
        if round == 1 {
            // Kill every pub/sub connection (the listener's).
            let _: i64 = raw(&conn, &["CLIENT", "KILL", "TYPE", "pubsub"]).await;
            sleep(ms(300)).await;
        }
        assert!(!call.is_finished(), "round {round}: ran while held");
        assert!(holder.release(&lease).await.unwrap());
        let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
        assert_eq!(outcome, Outcome::Done(()), "round {round}");
    }
}

// ---------------------------------------------------------------------------
// Across processes
// ---------------------------------------------------------------------------

/// Environment variable that turns the ignored test `child` into a worker
/// process: `<redis url>;<tasks>;<calls per task>;<keys>;<hold ms>[;<permits>]`.
const CHILD: &str = "LOCKGATE_WAKE_CHILD";

/// A child process: `tasks` tasks each make `calls` calls over the hot
/// keys, through a waking `LockLayer`; each handled call prints
/// `held <key> <start ns> <end ns>`.
#[tokio::test]
#[ignore = "run as a child process by the cross-process tests"]
async fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let [url, tasks, calls, keys, hold, ref permits @ ..] = parts[..] else {
        panic!("bad {CHILD}: {spec}");
    };
    // Optional sixth part: permits per key (a lock when absent).
    let permits: u32 = permits.first().map_or(1, |p| p.parse().unwrap());
    let (tasks, calls, keys, hold): (usize, usize, usize, u64) = (
        tasks.parse().unwrap(),
        calls.parse().unwrap(),
        keys.parse().unwrap(),
        hold.parse().unwrap(),
    );
    let client = redis::Client::open(url).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let listener = ReleaseListener::connect(client).await.unwrap();
    let backoff = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(60));
    let layer = waiting_layer(conn, secs(10), backoff, listener);
    let layer = match permits {
        1 => layer,
        n => layer.permits(n).unwrap(),
    };
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let svc = layer.layer(service_fn(move |key: String| {
        record(out.clone(), key, hold)
    }));
    let mut handles = Vec::new();
    for task in 0..tasks {
        let svc = svc.clone();
        handles.push(tokio::spawn(async move {
            for call in 0..calls {
                let key = format!("hot-{}", (task + call) % keys);
                let outcome = svc.clone().oneshot(key).await.expect("call");
                assert_eq!(outcome, Outcome::Done(()));
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
}

/// A child's handler: holds the key for `hold` ms and prints the interval.
async fn record(
    out: Arc<std::sync::Mutex<std::io::Stdout>>,
    key: String,
    hold: u64,
) -> Result<(), BoxError> {
    use std::io::Write;
    let start = now_ns();
    sleep(ms(hold)).await;
    let end = now_ns();
    let mut out = out.lock().unwrap();
    writeln!(out, "held {key} {start} {end}")?;
    out.flush()?;
    Ok(())
}

/// `(key, start, end)` of every call a child handled.
fn holds_of(child: std::process::Child) -> Vec<(String, u128, u128)> {
    let output = child.wait_with_output().expect("child output");
    assert!(output.status.success(), "a child process failed");
    BufReader::new(&output.stdout[..])
        .lines()
        .map_while(Result::ok)
        .filter_map(|line| {
            // The test harness may have printed on the same line first.
            let mut parts = line.split_once("held ")?.1.split(' ');
            Some((
                parts.next()?.to_owned(),
                parts.next()?.parse().ok()?,
                parts.next()?.parse().ok()?,
            ))
        })
        .collect()
}

#[tokio::test]
async fn processes_hold_each_key_one_at_a_time_and_every_call_is_handled() {
    let server = server();
    let (processes, tasks, calls, keys) = (3, 4, 15, 2);
    let spec = format!("{};{tasks};{calls};{keys};2", server.url());
    let children: Vec<_> = (0..processes)
        .map(|_| spawn_child(module_path!(), CHILD, &spec))
        .collect();
    let mut holds: Vec<(String, u128, u128)> = Vec::new();
    for child in children {
        let mine = holds_of(child);
        assert_eq!(mine.len(), tasks * calls, "a process lost calls");
        holds.extend(mine);
    }
    assert_eq!(holds.len(), processes * tasks * calls);
    // Mutual exclusion by recorded intervals, per key, across processes.
    holds.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    for pair in holds.windows(2) {
        if pair[0].0 == pair[1].0 {
            assert!(
                pair[0].2 <= pair[1].1,
                "two holders of {} at once: {pair:?}",
                pair[0].0
            );
        }
    }
}

#[tokio::test]
async fn a_release_wakes_a_waiter_in_another_process() {
    let server = server();
    let conn = manager(&server).await;
    warm_up(&conn).await;
    // This process holds the key; a child waits for it with a 1 ms backoff
    // (it would poll hundreds of times if it were not woken).
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "hot-0").await;
    let child = spawn_child(module_path!(), CHILD, &format!("{};1;1;1;1", server.url()));
    // Until the child waits: it has marked the lock.
    support::eventually("the child waits", BOUNDED, async || {
        let value: String = raw(&conn, &["GET", &holder.lock_key("hot-0")]).await;
        support::done_if(value.ends_with('!'), &value)
    })
    .await;
    let before = script_calls(&conn).await;
    sleep(ms(300)).await;
    let while_held = script_calls(&conn).await - before;
    assert_eq!(while_held, 0, "the child polled while the holder was alive");
    let released_at = now_ns();
    assert!(holder.release(&lease).await.unwrap());
    let holds = holds_of(child);
    assert_eq!(holds.len(), 1);
    assert!(
        holds[0].1 >= released_at,
        "the child ran before the release"
    );
}

// ---------------------------------------------------------------------------
// The line of waiters: the lock is handed on in the order waiters came
// ---------------------------------------------------------------------------

/// How many waiters stand in `key`'s line (`<lock key>:waiters`).
async fn in_line(conn: &ConnectionManager, locker: &Locker<ConnectionManager>, key: &str) -> i64 {
    raw(
        conn,
        &["ZCARD", &format!("{}:waiters", locker.lock_key(key))],
    )
    .await
}

#[tokio::test]
async fn waiters_in_other_processes_take_the_lock_in_the_order_they_came() {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "hot-0").await;
    // Three processes come to the busy key one after the other; each holds
    // it for 20 ms once its turn comes.
    let mut children = Vec::new();
    for n in 1..=3 {
        children.push(spawn_child(
            module_path!(),
            CHILD,
            &format!("{};1;1;1;20", server.url()),
        ));
        support::eventually("the child stands in line", BOUNDED, async || {
            let waiting = in_line(&conn, &holder, "hot-0").await;
            support::done_if(waiting == n, waiting)
        })
        .await;
    }
    assert!(holder.release(&lease).await.unwrap());
    let starts: Vec<u128> = children
        .into_iter()
        .map(|child| {
            let holds = holds_of(child);
            assert_eq!(holds.len(), 1);
            holds[0].1
        })
        .collect();
    assert!(
        starts.windows(2).all(|pair| pair[0] < pair[1]),
        "not in the order they came: {starts:?}"
    );
    assert_eq!(
        in_line(&conn, &holder, "hot-0").await,
        0,
        "the line is empty"
    );
}

/// A waiter whose process is alive (its listener still subscribed) but
/// which never takes the lock handed to it (a long pause, a blocked thread,
/// a hang with the connection open) holds the key up for the hand-off time
/// at most. (A waiter whose process died is skipped at once:
/// `a_killed_process_s_waiters_in_line_do_not_hold_the_lock_up`.)
#[tokio::test]
async fn a_waiter_that_never_takes_the_lock_holds_it_up_for_the_hand_off_time_only() {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "k").await;
    // A waiter that stands first in line and whose process listens (its
    // presence channel is subscribed), but that never takes the lock.
    let dead = "deaddeaddeaddeaddeaddeaddeaddead";
    let line = format!("{}:waiters", holder.lock_key("k"));
    let _: i64 = raw(&conn, &["ZADD", &line, "1", dead]).await;
    let mut stalled = server.client().get_async_pubsub().await.unwrap();
    stalled
        .subscribe(format!("{}#deaddead", holder.lock_key("k")))
        .await
        .unwrap();

    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>("ran") }));
    let call = tokio::spawn(svc.oneshot("k".to_owned()));
    support::eventually(
        "the waiter stands in line behind the dead one",
        BOUNDED,
        async || {
            let waiting = in_line(&conn, &holder, "k").await;
            support::done_if(waiting == 2, waiting)
        },
    )
    .await;
    assert!(holder.release(&lease).await.unwrap());
    // Handed to the dead waiter first, which never takes it ...
    let value: Option<String> = raw(&conn, &["GET", &holder.lock_key("k")]).await;
    assert!(
        value.as_deref().is_some_and(|v| v.starts_with(dead)),
        "{value:?}"
    );
    // ... so it expires after the hand-off time, and the live waiter, told
    // of the hand-off, tries again then.
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
    assert_eq!(in_line(&conn, &holder, "k").await, 0, "the line is empty");
}

#[tokio::test]
async fn a_waiter_that_gives_up_leaves_the_line() {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "k").await;
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let backoff = Backoff::exponential(ms(10), ms(10))
        .unwrap()
        .max_elapsed(ms(200));
    let layer = waiting_layer(manager(&server).await, secs(30), backoff, listener);
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>(()) }));
    let call = tokio::spawn(svc.oneshot("k".to_owned()));
    support::eventually("the waiter stands in line", BOUNDED, async || {
        let waiting = in_line(&conn, &holder, "k").await;
        support::done_if(waiting == 1, waiting)
    })
    .await;
    let err = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap_err();
    assert!(err.downcast_ref::<lockgate::Contended>().is_some(), "{err}");
    support::eventually("the waiter left the line", BOUNDED, async || {
        let waiting = in_line(&conn, &holder, "k").await;
        support::done_if(waiting == 0, waiting)
    })
    .await;
    // So the release hands the lock to nobody: the key is free.
    assert!(holder.release(&lease).await.unwrap());
    assert!(!support::exists(&conn, &holder.lock_key("k")).await);
}

/// A lock handed over by a release lasts the hand-off time until its new
/// holder renews it: the renewal goes out at once, and the handler keeps
/// the lock for as long as it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handed_lock_is_kept_past_the_hand_off_time() {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let lease = acquired(&holder, "k").await;
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let started_tx = Arc::new(std::sync::Mutex::new(Some(started_tx)));
    let svc = layer.layer(service_fn(move |_k: String| {
        if let Some(tx) = started_tx.lock().unwrap().take() {
            let _ = tx.send(());
        }
        async {
            // Works for longer than the hand-off time.
            sleep(ms(1200)).await;
            Ok::<_, BoxError>("ran")
        }
    }));
    let call = tokio::spawn(svc.oneshot("k".to_owned()));
    support::eventually("the waiter stands in line", BOUNDED, async || {
        let waiting = in_line(&conn, &holder, "k").await;
        support::done_if(waiting == 1, waiting)
    })
    .await;
    assert!(holder.release(&lease).await.unwrap());
    timeout(BOUNDED, started).await.unwrap().unwrap();
    // Past the hand-off time, the lock is still the handler's.
    sleep(ms(800)).await;
    let other = Locker::new(manager(&server).await).ttl(secs(5)).unwrap();
    assert!(
        other.acquire("k").await.unwrap().lease().is_none(),
        "another holder took the lock while the handler ran"
    );
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
}

/// How many entries stand in the line of `line_key`.
async fn line_len(conn: &ConnectionManager, line_key: &str) -> i64 {
    raw(conn, &["ZCARD", line_key]).await
}

/// A child process with 8 tasks waiting for key `hot-0` (a lock, or one of
/// `permits` permits, all held by this process) stands first in the key's
/// line, a live waiter of this process behind it; the child is killed
/// (SIGKILL), then one lock or permit is released. Returns how long after
/// the release the live waiter's handler started.
async fn idle_after_killing_waiters(permits: u32) -> Duration {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let (leases, line) = match permits {
        1 => (
            vec![acquired(&holder, "hot-0").await],
            format!("{}:waiters", holder.lock_key("hot-0")),
        ),
        n => {
            let mut leases = Vec::new();
            for _ in 0..n {
                let lease = holder.acquire_permit("hot-0", n).await.unwrap().lease();
                leases.push(lease.expect("a free permit"));
            }
            (leases, format!("{}:waiters", holder.permits_key("hot-0")))
        }
    };
    let spec = format!("{};8;1;1;1;{permits}", server.url());
    let mut child = spawn_child(module_path!(), CHILD, &spec);
    // As many of its waiters as may stand in line (one per permit).
    let expected = i64::from(permits);
    support::eventually("the child's waiters stand in line", BOUNDED, async || {
        let n = line_len(&conn, &line).await;
        support::done_if(n >= expected, n)
    })
    .await;
    let started = Arc::new(std::sync::Mutex::new(None));
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let layer = match permits {
        1 => layer,
        n => layer.permits(n).unwrap(),
    };
    let svc = layer.layer(service_fn({
        let started = started.clone();
        move |_k: String| {
            started
                .lock()
                .unwrap()
                .get_or_insert(tokio::time::Instant::now());
            async { Ok::<_, BoxError>(()) }
        }
    }));
    let before = line_len(&conn, &line).await;
    let call = tokio::spawn(svc.oneshot("hot-0".to_owned()));
    support::eventually("the live waiter stands in line", BOUNDED, async || {
        let n = line_len(&conn, &line).await;
        support::done_if(n > before, n)
    })
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    let released = tokio::time::Instant::now();
    assert!(holder.release(&leases[0]).await.unwrap());
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    let idle = started.lock().unwrap().expect("the handler ran") - released;
    println!("release → the live waiter starts: {idle:?}");
    idle
}

/// A process killed (SIGKILL) with waiters in a key's line: the release
/// skips all of them at once (their process no longer listens) and hands
/// the key to the live waiter behind them. On the old code each release
/// handed the key to a dead waiter for the 500 ms hand-off time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_s_waiters_in_line_do_not_hold_the_lock_up() {
    let idle = idle_after_killing_waiters(1).await;
    assert!(
        idle < ms(200),
        "the key waited {idle:?} for its dead waiters (the hand-off time is 500 ms)"
    );
}

/// The same with permits: a process holding none of a key's 3 permits but
/// with several waiters in its line is killed; a freed permit goes to a
/// live waiter at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_s_waiters_for_permits_do_not_hold_them_up() {
    let idle = idle_after_killing_waiters(3).await;
    assert!(
        idle < ms(200),
        "the permit waited {idle:?} for dead waiters (the hand-off time is 500 ms)"
    );
}

/// A line with more waiters of dead processes in front than a release
/// looks at (`LINE_LOOK` in line.lua, 64; issue 38: a release used to look
/// at up to 16 processes' first 1,000 waiters each, 20 ms and more on a
/// long line): the release drops 64 of them, hands the key to nobody and
/// wakes every waiter, so the live waiter behind them takes it; the rest of
/// the dead waiters stay for later releases.
async fn a_long_dead_line_wakes_the_live_waiter(permits: u32) {
    let server = server();
    let conn = manager(&server).await;
    let holder = Locker::new(manager(&server).await).ttl(secs(30)).unwrap();
    let (lease, line) = match permits {
        1 => (
            acquired(&holder, "k").await,
            format!("{}:waiters", holder.lock_key("k")),
        ),
        n => {
            let lease = holder.acquire_permit("k", n).await.unwrap().lease();
            for _ in 1..n {
                assert!(
                    holder
                        .acquire_permit("k", n)
                        .await
                        .unwrap()
                        .lease()
                        .is_some()
                );
            }
            (
                lease.unwrap(),
                format!("{}:waiters", holder.permits_key("k")),
            )
        }
    };
    // 200 waiters of 20 dead processes, in front.
    let mut zadd = redis::cmd("ZADD");
    zadd.arg(&line);
    for i in 0..200 {
        let token = format!("dead{:04}{i:024}", i % 20);
        let member = match permits {
            1 => token,
            n => format!("{token}/{n}"),
        };
        zadd.arg(i + 1).arg(member);
    }
    let _: i64 = zadd.query_async(&mut conn.clone()).await.unwrap();
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let layer = waiting_layer(
        manager(&server).await,
        secs(30),
        polling_backoff(),
        listener,
    );
    let layer = match permits {
        1 => layer,
        n => layer.permits(n).unwrap(),
    };
    let svc = layer.layer(service_fn(|_k: String| async { Ok::<_, BoxError>("ran") }));
    let call = tokio::spawn(svc.oneshot("k".to_owned()));
    support::eventually("the live waiter stands behind them", BOUNDED, async || {
        let n = line_len(&conn, &line).await;
        support::done_if(n == 201, n)
    })
    .await;
    assert!(holder.release(&lease).await.unwrap());
    let outcome = timeout(BOUNDED, call).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done("ran"));
    // 64 dropped, and the live waiter left the line. Its own release then
    // looks again for permits (a permit's release always looks down its
    // line; a lock's only when a waiter marked it): 64 more.
    let left = if permits == 1 { 200 - 64 } else { 200 - 2 * 64 };
    support::eventually("the dead waiters looked at left", BOUNDED, async || {
        let n = line_len(&conn, &line).await;
        support::done_if(n == left, n)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_s_line_of_many_dead_waiters_costs_a_release_64_of_them() {
    a_long_dead_line_wakes_the_live_waiter(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_line_of_many_dead_waiters_costs_a_release_64_of_them() {
    a_long_dead_line_wakes_the_live_waiter(2).await;
}
