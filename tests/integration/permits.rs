//! Permits: at most n holders of a key at a time (`LockLayer::permits`,
//! `Permits` keys, `Locker::acquire_permit`), in this process and across
//! processes, with the same strategies as locks.
//!
//! The cross-process tests run this test binary again as child processes
//! (the ignored test `child`, driven by environment variables).

use crate::support;

use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lockgate::layer::DeferDelay;
use lockgate::{
    Acquisition, Backoff, BoxError, Contended, Error, HeldLock, Job, LockLayer, Locker, OnConflict,
    Outcome, Permits, Queue, ReleaseListener, Worker,
};
use serde::{Deserialize, Serialize};
use support::{BOUNDED, manager, ms, now_ns, script_calls, secs, server, spawn_child};
use tokio::time::{sleep, timeout};
use tower::{Layer, ServiceExt, service_fn};

const CHILD: &str = "LOCKGATE_PERMITS_CHILD";

/// The most intervals of `holds` (start, end) that overlap at one moment.
fn most_at_once(holds: &[(u128, u128)]) -> usize {
    support::most_at_once(holds.iter().copied())
}

/// Counts handlers running at once, and the most there ever were.
#[derive(Clone, Default)]
struct Gauge {
    running: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Gauge {
    async fn hold(&self, for_: Duration) {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        sleep(for_).await;
        self.running.fetch_sub(1, Ordering::SeqCst);
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }
}

fn waiting_backoff() -> Backoff {
    Backoff::exponential(ms(1), ms(20))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(30))
}

fn hot(_: &()) -> &'static str {
    "hot"
}

fn hot_n(_: &u32) -> &'static str {
    "hot"
}

/// Every email shares one key: a global limit.
fn all_emails(_: &Job<Email>) -> &'static str {
    "emails"
}

/// A child process: `tasks` tasks each make `calls` calls on key `hot`
/// with `permits` permits, through a waking `LockLayer`; each handled call
/// prints `held <start ns> <end ns>`. With `hold_forever`, each task
/// instead prints `holding` once it holds a permit and never lets go.
#[tokio::test]
#[ignore = "run as a child process by the cross-process tests"]
async fn child() {
    let Ok(spec) = std::env::var(CHILD) else {
        return;
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let [url, tasks, calls, permits, hold, ttl] = parts[..] else {
        panic!("bad {CHILD}: {spec}");
    };
    let (tasks, calls, permits, hold, ttl): (usize, usize, u32, u64, u64) = (
        tasks.parse().unwrap(),
        calls.parse().unwrap(),
        permits.parse().unwrap(),
        hold.parse().unwrap(),
        ttl.parse().unwrap(),
    );
    let client = redis::Client::open(url).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let listener = ReleaseListener::connect(client).await.unwrap();
    let layer = LockLayer::new(Locker::new(conn).ttl(ms(ttl)).unwrap(), hot)
        .permits(permits)
        .unwrap()
        .on_conflict(OnConflict::retry(waiting_backoff()))
        .wake_on_release(listener);
    let out = Arc::new(std::sync::Mutex::new(std::io::stdout()));
    let svc = layer.layer(service_fn(move |()| record(out.clone(), hold)));
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let svc = svc.clone();
        handles.push(tokio::spawn(async move {
            for _ in 0..calls {
                let outcome = svc.clone().oneshot(()).await.expect("call");
                assert_eq!(outcome, Outcome::Done(()));
            }
        }));
    }
    for handle in handles {
        handle.await.unwrap();
    }
}

/// A child's handler: holds its permit for `hold` ms (forever for 0) and
/// prints the interval.
async fn record(out: Arc<std::sync::Mutex<std::io::Stdout>>, hold: u64) -> Result<(), BoxError> {
    use std::io::Write;
    let start = now_ns();
    if hold == 0 {
        {
            let mut out = out.lock().unwrap();
            writeln!(out, "holding")?;
            out.flush()?;
        }
        std::future::pending::<()>().await;
    }
    sleep(ms(hold)).await;
    let end = now_ns();
    let mut out = out.lock().unwrap();
    writeln!(out, "held {start} {end}")?;
    out.flush()?;
    Ok(())
}

#[tokio::test]
async fn three_processes_never_hold_more_than_three_permits_and_use_all_three() {
    let server = server();
    let (processes, tasks, calls) = (3, 3, 12);
    let spec = format!("{};{tasks};{calls};3;5;10000", server.url());
    let children: Vec<_> = (0..processes)
        .map(|_| spawn_child(module_path!(), CHILD, &spec))
        .collect();
    let mut holds = Vec::new();
    for child in children {
        let output = child.wait_with_output().expect("child output");
        assert!(output.status.success(), "a child process failed");
        let mine: Vec<(u128, u128)> = BufReader::new(&output.stdout[..])
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| {
                // The test harness may have printed on the same line first.
                let mut parts = line.split_once("held ")?.1.split(' ');
                Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
            })
            .collect();
        assert_eq!(mine.len(), tasks * calls, "a process lost calls");
        holds.extend(mine);
    }
    // Nine tasks want three permits: at most three at once, and under this
    // load all three are in use at some point.
    assert_eq!(most_at_once(&holds), 3, "permits in use at once");
}

/// Kills the child process when the test ends, failed or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn permits_of_a_killed_process_come_back_when_their_leases_end() {
    let server = server();
    let conn = manager(&server).await;
    // The child takes both permits (lease 600 ms, renewed while it lives)
    // and never lets go.
    let spec = format!("{};2;1;2;0;600", server.url());
    let mut child = KillOnDrop(spawn_child(module_path!(), CHILD, &spec));
    let stdout = child.0.stdout.take().unwrap();
    // (The test harness prints its own lines first.)
    let holding = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter(|line| line.ends_with("holding"))
        .take(2)
        .count();
    assert_eq!(holding, 2, "the child took both permits");
    let locker = Locker::new(conn.clone()).ttl(secs(5)).unwrap();
    let Acquisition::Contended(busy) = locker.acquire_permit("hot", 2).await.unwrap() else {
        panic!("both permits are the child's");
    };
    assert!(busy.retry_after() <= ms(600), "{busy:?}");
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    // A waiter gets both back once the leases end (no renewal any more).
    let layer = LockLayer::new(locker.clone(), hot_n)
        .permits(2)
        .unwrap()
        .on_conflict(OnConflict::retry(waiting_backoff()));
    let gauge = Gauge::default();
    let svc = layer.layer(service_fn({
        let gauge = gauge.clone();
        move |_: u32| {
            let gauge = gauge.clone();
            async move {
                gauge.hold(ms(200)).await;
                Ok::<_, BoxError>(())
            }
        }
    }));
    let calls: Vec<_> = (0..2).map(|n| svc.clone().oneshot(n)).collect();
    let done = timeout(BOUNDED, futures_util::future::join_all(calls))
        .await
        .expect("the dead process's permits came back");
    for outcome in done {
        assert_eq!(outcome.unwrap(), Outcome::Done(()));
    }
    assert_eq!(gauge.most(), 2, "both permits came back");
}

#[derive(Debug, Clone)]
struct Call {
    tenant: &'static str,
}

/// Tenants on different plans: the key function says how many permits.
fn plan(call: &Call) -> Permits<&'static str> {
    let permits = if call.tenant == "big" { 3 } else { 1 };
    Permits::new(call.tenant, permits)
}

#[tokio::test]
async fn limits_given_per_call_hold() {
    let server = server();
    let conn = manager(&server).await;
    let layer = LockLayer::new(Locker::new(conn).ttl(secs(5)).unwrap(), plan)
        .on_conflict(OnConflict::retry(waiting_backoff()));
    let (big, small) = (Gauge::default(), Gauge::default());
    let svc = layer.layer(service_fn({
        let (big, small) = (big.clone(), small.clone());
        move |call: Call| {
            let gauge = if call.tenant == "big" {
                big.clone()
            } else {
                small.clone()
            };
            async move {
                // The handler sees its permit.
                let held = HeldLock::current().expect("held");
                assert_eq!(
                    held.permits(),
                    Some(if call.tenant == "big" { 3 } else { 1 })
                );
                gauge.hold(ms(20)).await;
                Ok::<_, BoxError>(())
            }
        }
    }));
    let calls: Vec<_> = (0..24)
        .map(|n| {
            let tenant = if n % 2 == 0 { "big" } else { "small" };
            svc.clone().oneshot(Call { tenant })
        })
        .collect();
    for outcome in timeout(BOUNDED, futures_util::future::join_all(calls))
        .await
        .unwrap()
    {
        assert_eq!(outcome.unwrap(), Outcome::Done(()));
    }
    assert_eq!(big.most(), 3, "the big tenant's three permits");
    assert_eq!(small.most(), 1, "the small tenant's one");
}

#[tokio::test]
async fn bad_permit_counts_are_configuration_errors() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn).ttl(secs(5)).unwrap();
    let layer = LockLayer::new(locker.clone(), |k: &String| k.clone());
    assert!(matches!(layer.clone().permits(0), Err(Error::Config(_))));
    let too_many = lockgate::lock::permits::MAX_PERMITS + 1;
    assert!(matches!(layer.permits(too_many), Err(Error::Config(_))));
    assert!(matches!(
        locker.acquire_permit("k", 0).await,
        Err(Error::Config(_))
    ));
    // From the key function: the call fails, the handler never runs.
    let svc = LockLayer::new(locker.clone(), |k: &String| Permits::new(k.clone(), 0)).layer(
        service_fn(|_: String| async {
            panic!("no handler runs without a valid limit");
            #[allow(unreachable_code)]
            Ok::<_, BoxError>(())
        }),
    );
    let error = svc.oneshot("k".into()).await.unwrap_err();
    assert!(
        matches!(error.downcast_ref::<Error>(), Some(Error::Config(_))),
        "{error}"
    );
}

#[tokio::test]
async fn fail_says_when_the_first_lease_ends() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn).ttl(secs(5)).unwrap();
    let first = locker
        .acquire_permit("k", 2)
        .await
        .unwrap()
        .lease()
        .unwrap();
    sleep(ms(50)).await;
    let _second = locker
        .acquire_permit("k", 2)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let svc = LockLayer::new(locker.clone(), |k: &String| k.clone())
        .permits(2)
        .unwrap()
        .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    let error = svc.clone().oneshot("k".into()).await.unwrap_err();
    let busy = error.downcast_ref::<Contended>().expect("Contended");
    // The first lease ends first: 5 s after it was taken, 50 ms earlier.
    assert!(busy.retry_after() <= secs(5) - ms(50), "{busy:?}");
    assert!(busy.retry_after() > secs(4), "{busy:?}");
    // One back, one free.
    assert!(locker.release(&first).await.unwrap());
    assert_eq!(svc.oneshot("k".into()).await.unwrap(), Outcome::Done(()));
}

#[tokio::test]
async fn a_release_wakes_a_waiter_that_sends_nothing_meanwhile() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(10)).unwrap();
    let held = locker
        .acquire_permit("k", 1)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    // A backoff of 1 ms would poll hundreds of times if it were not woken.
    let polling = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(20));
    let svc = LockLayer::new(locker.clone(), |k: &String| k.clone())
        .permits(1)
        .unwrap()
        .on_conflict(OnConflict::retry(polling))
        .wake_on_release(listener)
        .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    let waiter = tokio::spawn(svc.oneshot("k".into()));
    sleep(ms(100)).await;
    let before = script_calls(&conn).await;
    sleep(ms(300)).await;
    let during = script_calls(&conn).await - before;
    assert!(
        during <= 1,
        "the waiter polled: {during} script calls while the holder lived"
    );
    assert!(locker.release(&held).await.unwrap());
    let outcome = timeout(secs(2), waiter).await.expect("woken").unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Done(()));
}

#[tokio::test]
async fn fences_increase_holders_are_listed_and_leases_renew() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn).ttl(ms(500)).unwrap();
    let mut leases = Vec::new();
    for _ in 0..3 {
        leases.push(
            locker
                .acquire_permit("k", 3)
                .await
                .unwrap()
                .lease()
                .unwrap(),
        );
    }
    assert!(
        locker
            .acquire_permit("k", 3)
            .await
            .unwrap()
            .lease()
            .is_none()
    );
    let mut fences = Vec::new();
    for lease in &leases {
        fences.push(locker.fence(lease).await.unwrap());
        // Asking again returns the same fence.
        assert_eq!(locker.fence(lease).await.unwrap(), *fences.last().unwrap());
    }
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    let holders = locker.permit_holders("k").await.unwrap();
    assert_eq!(holders.len(), 3);
    let mut listed: Vec<u64> = holders.iter().filter_map(|h| h.fence).collect();
    listed.sort();
    assert_eq!(listed, fences);
    assert!(holders.iter().all(|h| h.remaining <= ms(500)));
    // Renewed, one outlives its first lease; the others run out.
    let mut kept = leases.remove(0);
    for _ in 0..4 {
        sleep(ms(200)).await;
        assert!(locker.extend(&mut kept, ms(500)).await.unwrap());
    }
    let holders = locker.permit_holders("k").await.unwrap();
    assert_eq!(holders.len(), 1);
    assert_eq!(holders[0].token, kept.token());
    // A lease that ran out is not renewed, and its fence is refused.
    assert!(!locker.extend(&mut leases[0], ms(500)).await.unwrap());
    let fresh = locker
        .acquire_permit("k", 3)
        .await
        .unwrap()
        .lease()
        .unwrap();
    assert!(locker.fence(&fresh).await.unwrap() > fences[2]);
    assert!(locker.release(&kept).await.unwrap());
    assert!(locker.release(&fresh).await.unwrap());
    assert!(locker.permit_holders("k").await.unwrap().is_empty());
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Email {
    n: u32,
}

#[tokio::test]
async fn a_global_limit_holds_across_workers() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Email> = Queue::new(conn.clone(), "emails").unwrap();
    let emails: Vec<Email> = (0..30).map(|n| Email { n }).collect();
    queue.push_many(&emails).await.unwrap();
    let gauge = Gauge::default();
    let handled = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for _ in 0..3 {
        let conn = manager(&server).await;
        let queue: Queue<Email> = Queue::new(conn.clone(), "emails").unwrap();
        // One key for every message: at most 2 handlers across all workers.
        let layer = LockLayer::new(Locker::new(conn).ttl(secs(5)).unwrap(), all_emails)
            .permits(2)
            .unwrap()
            .on_conflict(OnConflict::retry(waiting_backoff()));
        let (gauge, handled) = (gauge.clone(), handled.clone());
        let svc = layer.layer(service_fn(move |job: Job<Email>| {
            let (gauge, handled) = (gauge.clone(), handled.clone());
            async move {
                gauge.hold(ms(10)).await;
                handled.lock().unwrap().push(job.n);
                Ok::<_, BoxError>(())
            }
        }));
        let worker = Worker::new(server.client(), queue, svc)
            .concurrency(4)
            .unwrap();
        let mut stopped = stopped.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    support::eventually("all emails are handled", BOUNDED, async || {
        let n = handled.lock().unwrap().len();
        support::done_if(n >= 30, n)
    })
    .await;
    stop.send(true).unwrap();
    for worker in workers {
        worker.await.unwrap().unwrap();
    }
    let mut handled = handled.lock().unwrap().clone();
    handled.sort();
    assert_eq!(handled, (0..30).collect::<Vec<_>>(), "each once");
    assert_eq!(gauge.most(), 2, "two handlers at most, and two in use");
}

#[tokio::test]
async fn a_timed_defer_puts_the_message_aside() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(5)).unwrap();
    let queue: Queue<String> = Queue::new(conn.clone(), "later").unwrap();
    let _held = locker
        .acquire_permit("k", 1)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let svc = LockLayer::new(locker.clone(), |k: &String| k.clone())
        .permits(1)
        .unwrap()
        .on_conflict(OnConflict::defer(queue.clone(), DeferDelay::Fixed(ms(500))))
        .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    let Outcome::Deferred { .. } = svc.oneshot("k".into()).await.unwrap() else {
        panic!("deferred");
    };
    assert_eq!(queue.stats().await.unwrap().later, 1);
}

/// How many waiters stand in the line of `key`'s permits.
async fn in_line(
    conn: &redis::aio::ConnectionManager,
    locker: &Locker<redis::aio::ConnectionManager>,
    key: &str,
) -> i64 {
    support::raw(
        conn,
        &["ZCARD", &format!("{}:waiters", locker.permits_key(key))],
    )
    .await
}

/// A layer of its own (as in another process: its own local queue) that
/// waits, woken by releases, for one of `permits` permits, and records
/// `n` when its handler runs.
fn waiting_for_permits(
    locker: &Locker<redis::aio::ConnectionManager>,
    listener: &ReleaseListener,
    permits: u32,
    n: u32,
    order: Arc<std::sync::Mutex<Vec<u32>>>,
) -> impl tower::Service<
    String,
    Response = Outcome<()>,
    Error = BoxError,
    Future = impl std::future::Future<Output = Result<Outcome<()>, BoxError>> + Send,
> + Send
+ 'static {
    LockLayer::new(locker.clone(), |k: &String| k.clone())
        .permits(permits)
        .unwrap()
        .on_conflict(OnConflict::retry(waiting_backoff()))
        .wake_on_release(listener.clone())
        .layer(service_fn(move |_: String| {
            let order = order.clone();
            async move {
                order.lock().unwrap().push(n);
                // Long enough that a permit handed on before this one's
                // started cannot be seen to overtake it.
                sleep(ms(100)).await;
                Ok::<_, BoxError>(())
            }
        }))
}

#[tokio::test]
async fn freed_permits_go_to_the_waiters_in_the_order_they_came() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(10)).unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            locker
                .acquire_permit("k", 2)
                .await
                .unwrap()
                .lease()
                .unwrap(),
        );
    }
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiters = Vec::new();
    for n in 1..=4 {
        let svc = waiting_for_permits(&locker, &listener, 2, n, order.clone());
        waiters.push(tokio::spawn(svc.oneshot("k".into())));
        support::eventually("the waiter stands in line", BOUNDED, async || {
            let waiting = in_line(&conn, &locker, "k").await;
            support::done_if(waiting == i64::from(n), waiting)
        })
        .await;
    }
    // Each release hands its permit to the first in line.
    for lease in &held {
        assert!(locker.release(lease).await.unwrap());
    }
    for waiter in waiters {
        let outcome = timeout(BOUNDED, waiter).await.unwrap().unwrap().unwrap();
        assert_eq!(outcome, Outcome::Done(()));
    }
    let order = order.lock().unwrap().clone();
    // Two at a time: 1 and 2 first (in either order of their handlers'
    // starts), then 3 and 4.
    let (first, second) = order.split_at(2);
    assert!(
        first.iter().all(|n| *n <= 2) && second.iter().all(|n| *n >= 3),
        "not in the order they came: {order:?}"
    );
    assert_eq!(in_line(&conn, &locker, "k").await, 0);
}

#[tokio::test]
async fn a_permit_is_not_handed_to_a_waiter_whose_own_limit_it_would_exceed() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(10)).unwrap();
    // Three hold permits of a key that admits three.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            locker
                .acquire_permit("k", 3)
                .await
                .unwrap()
                .lease()
                .unwrap(),
        );
    }
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    // A waiter that asks for one holder at most (a smaller plan) comes first.
    let svc = waiting_for_permits(&locker, &listener, 1, 1, order.clone());
    let waiter = tokio::spawn(svc.oneshot("k".into()));
    support::eventually("the waiter stands in line", BOUNDED, async || {
        let waiting = in_line(&conn, &locker, "k").await;
        support::done_if(waiting == 1, waiting)
    })
    .await;
    // Two leave: one holder is left, which its limit does not allow.
    for lease in &held[..2] {
        assert!(locker.release(lease).await.unwrap());
    }
    sleep(ms(100)).await;
    assert!(
        order.lock().unwrap().is_empty(),
        "ran beside another holder"
    );
    assert_eq!(locker.permit_holders("k").await.unwrap().len(), 1);
    // The last one leaves: now it is handed the permit.
    assert!(locker.release(&held[2]).await.unwrap());
    let outcome = timeout(BOUNDED, waiter).await.unwrap().unwrap().unwrap();
    assert_eq!(outcome, Outcome::Done(()));
    assert_eq!(*order.lock().unwrap(), [1]);
}

#[tokio::test]
async fn a_release_never_shortens_a_holders_lease_through_its_old_place_in_line() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(10)).unwrap();
    let other = locker
        .acquire_permit("k", 2)
        .await
        .unwrap()
        .lease()
        .unwrap();
    let holder = locker
        .acquire_permit("k", 2)
        .await
        .unwrap()
        .lease()
        .unwrap();
    // The holder once stood in line (it waited, then took its permit while
    // it could not hear releases): its old place is still there.
    let line = format!("{}:waiters", locker.permits_key("k"));
    let place = format!("{}/2", holder.token());
    let _: i64 = support::raw(&conn, &["ZADD", &line, "1", &place]).await;
    // Another holder leaves: the holder is not handed a second permit, and
    // its lease keeps its length.
    assert!(locker.release(&other).await.unwrap());
    let holders = locker.permit_holders("k").await.unwrap();
    assert_eq!(holders.len(), 1, "{holders:?}");
    assert!(holders[0].remaining > secs(5), "{holders:?}");
    assert_eq!(
        in_line(&conn, &locker, "k").await,
        0,
        "its old place is gone"
    );
}

#[tokio::test]
async fn a_waiter_whose_limit_is_full_does_not_hold_up_the_waiters_behind_it() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn.clone()).ttl(secs(10)).unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(
            locker
                .acquire_permit("k", 3)
                .await
                .unwrap()
                .lease()
                .unwrap(),
        );
    }
    let listener = ReleaseListener::connect(server.client()).await.unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    // First in line: a waiter that wants to be alone; behind it, one that
    // admits three holders.
    let mut waiters = Vec::new();
    for (n, limit) in [(1, 1), (2, 3)] {
        let svc = waiting_for_permits(&locker, &listener, limit, n, order.clone());
        waiters.push(tokio::spawn(svc.oneshot("k".into())));
        support::eventually("the waiter stands in line", BOUNDED, async || {
            let waiting = in_line(&conn, &locker, "k").await;
            support::done_if(waiting == i64::from(n), waiting)
        })
        .await;
    }
    // One leaves: two hold on, so the permit goes to the second waiter.
    assert!(locker.release(&held[2]).await.unwrap());
    let second = waiters.pop().unwrap();
    let outcome = timeout(secs(2), second).await.expect("handed on").unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Done(()));
    assert_eq!(*order.lock().unwrap(), [2]);
    // The others leave: the first waiter's turn.
    for lease in &held[..2] {
        assert!(locker.release(lease).await.unwrap());
    }
    let first = waiters.pop().unwrap();
    let outcome = timeout(BOUNDED, first).await.unwrap().unwrap();
    assert_eq!(outcome.unwrap(), Outcome::Done(()));
    assert_eq!(*order.lock().unwrap(), [2, 1]);
}
