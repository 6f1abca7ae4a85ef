//! Rate limits per key (`RateLimitLayer`, `Locker::admit`): never more than
//! r admissions in any window of the period by the server's clock, exact
//! `retry_after`s, and deferred messages that run in the slot they were
//! deferred to.

use crate::support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockgate::layer::{DeferDelay, RateLimitLayer, RateSlot};
use lockgate::lock::rate::{Admission, MAX_RATE, Rate};
use lockgate::{
    Backoff, BoxError, Contended, Error, Job, LockLayer, Locker, OnConflict, Outcome, Queue, Worker,
};
use serde::{Deserialize, Serialize};
use support::{BOUNDED, manager, ms, secs, server};
use tokio::time::{sleep, timeout};
use tower::{Layer, ServiceBuilder, ServiceExt, service_fn};

fn us(t: SystemTime) -> u128 {
    t.duration_since(UNIX_EPOCH).unwrap().as_micros()
}

/// The most of the sorted `times` (µs) in any window `[t, t + window)`.
fn most_in_window(times: &[u128], window: Duration) -> usize {
    let window = window.as_micros();
    let mut most = 0;
    let mut start = 0;
    for end in 0..times.len() {
        while times[end] - times[start] >= window {
            start += 1;
        }
        most = most.max(end - start + 1);
    }
    most
}

#[tokio::test]
async fn admissions_never_exceed_the_limit_in_any_window() {
    let server = server();
    let rate = Rate::new(20, ms(200)).unwrap();
    let times = Arc::new(Mutex::new(Vec::new()));
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    // Eight askers, each on a connection of its own, for six periods.
    for _ in 0..8 {
        let locker = Locker::new(manager(&server).await);
        let times = times.clone();
        tasks.push(tokio::spawn(async move {
            while started.elapsed() < ms(1_200) {
                match locker.admit("api", &rate).await.unwrap() {
                    Admission::Admitted(at) => times.lock().unwrap().push(us(at)),
                    Admission::Limited(busy) => {
                        assert!(busy.retry_after() <= ms(200), "{busy:?}");
                        sleep(busy.retry_after()).await;
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let mut times = times.lock().unwrap().clone();
    times.sort();
    assert_eq!(most_in_window(&times, ms(200)), 20, "admissions per period");
    // Six periods' worth, give or take the edges.
    assert!(
        (100..=140).contains(&times.len()),
        "{} admitted",
        times.len()
    );
}

#[tokio::test]
async fn a_burst_setting_spreads_admissions() {
    let server = server();
    let locker = Locker::new(manager(&server).await);
    // 10 per 200 ms, at most 2 in any 40 ms.
    let rate = Rate::new(10, ms(200)).unwrap().burst(2).unwrap();
    let mut times = Vec::new();
    let started = tokio::time::Instant::now();
    while started.elapsed() < ms(600) {
        match locker.admit("k", &rate).await.unwrap() {
            Admission::Admitted(at) => times.push(us(at)),
            Admission::Limited(busy) => sleep(busy.retry_after()).await,
        }
    }
    times.sort();
    assert_eq!(most_in_window(&times, ms(40)), 2);
    assert!(most_in_window(&times, ms(200)) <= 10);
}

#[tokio::test]
async fn fail_says_exactly_when_the_next_slot_opens() {
    let server = server();
    let locker = Locker::new(manager(&server).await);
    let rate = Rate::new(2, secs(1)).unwrap();
    let svc = RateLimitLayer::new(locker, |k: &String| k.clone(), rate)
        .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    for _ in 0..2 {
        assert_eq!(
            svc.clone().oneshot("k".into()).await.unwrap(),
            Outcome::Done(())
        );
    }
    let error = svc.clone().oneshot("k".into()).await.unwrap_err();
    let busy = error.downcast_ref::<Contended>().expect("Contended");
    assert!(
        busy.retry_after() > ms(900) && busy.retry_after() <= secs(1),
        "{busy:?}"
    );
    sleep(busy.retry_after()).await;
    assert_eq!(svc.oneshot("k".into()).await.unwrap(), Outcome::Done(()));
}

#[tokio::test]
async fn retry_waits_for_the_slot_within_its_budget() {
    let server = server();
    let locker = Locker::new(manager(&server).await);
    let rate = Rate::new(2, ms(300)).unwrap();
    let backoff = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(5));
    let slots = Arc::new(Mutex::new(Vec::new()));
    let svc = RateLimitLayer::new(locker.clone(), |k: &String| k.clone(), rate)
        .on_conflict(OnConflict::retry(backoff))
        .layer(service_fn({
            let slots = slots.clone();
            move |_: String| {
                let slots = slots.clone();
                async move {
                    slots
                        .lock()
                        .unwrap()
                        .push(us(RateSlot::current().unwrap().at()));
                    Ok::<_, BoxError>(())
                }
            }
        }));
    let calls: Vec<_> = (0..6)
        .map(|_| svc.clone().oneshot("k".to_owned()))
        .collect();
    for outcome in timeout(BOUNDED, futures_util::future::join_all(calls))
        .await
        .unwrap()
    {
        assert_eq!(outcome.unwrap(), Outcome::Done(()));
    }
    let mut slots = slots.lock().unwrap().clone();
    slots.sort();
    assert_eq!(most_in_window(&slots, ms(300)), 2);
    // A budget shorter than the wait gives up at once.
    let short = Backoff::exponential(ms(1), ms(1))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(ms(50));
    let impatient = RateLimitLayer::new(locker, |k: &String| k.clone(), rate)
        .on_conflict(OnConflict::retry(short).then_fail())
        .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    let error = impatient.oneshot("k".into()).await.unwrap_err();
    assert!(error.downcast_ref::<Contended>().is_some(), "{error}");
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Call {
    n: u32,
}

#[tokio::test]
async fn deferred_messages_run_in_the_slot_they_were_deferred_to() {
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<Call> = Queue::new(conn.clone(), "calls").unwrap();
    let calls: Vec<Call> = (0..20).map(|n| Call { n }).collect();
    queue.push_many(&calls).await.unwrap();
    let period = ms(300);
    let rate = Rate::new(5, period).unwrap();
    // (message, deferrals, slot µs, start µs)
    let runs = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for _ in 0..2 {
        let conn = manager(&server).await;
        let queue: Queue<Call> = Queue::new(conn.clone(), "calls").unwrap();
        let runs = runs.clone();
        let svc = RateLimitLayer::new(Locker::new(conn), |_: &Job<Call>| "api", rate)
            .on_conflict(OnConflict::defer(
                queue.clone(),
                DeferDelay::until_allowed(),
            ))
            .layer(service_fn(move |job: Job<Call>| {
                let runs = runs.clone();
                async move {
                    let start = us(SystemTime::now());
                    let slot = us(RateSlot::current().unwrap().at());
                    runs.lock()
                        .unwrap()
                        .push((job.n, job.deferrals(), slot, start));
                    Ok::<_, BoxError>(())
                }
            }));
        let worker = Worker::new(server.client(), queue, svc)
            .concurrency(10)
            .unwrap();
        let mut stopped = stopped.clone();
        workers.push(tokio::spawn(worker.run_until(async move {
            let _ = stopped.wait_for(|s| *s).await;
        })));
    }
    support::eventually("every call has run", BOUNDED, async || {
        let n = runs.lock().unwrap().len();
        support::done_if(n >= 20, n)
    })
    .await;
    stop.send(true).unwrap();
    for worker in workers {
        worker.await.unwrap().unwrap();
    }
    let runs = runs.lock().unwrap().clone();
    let mut ns: Vec<u32> = runs.iter().map(|r| r.0).collect();
    ns.sort();
    assert_eq!(ns, (0..20).collect::<Vec<_>>(), "each once");
    let mut slots: Vec<u128> = runs.iter().map(|r| r.2).collect();
    slots.sort();
    assert_eq!(most_in_window(&slots, period), 5, "admissions per period");
    for (n, deferrals, slot, start) in &runs {
        // Deferred once at most: back in its reserved slot, and started in
        // that slot's period (the queue delivers it a few ms late at most).
        assert!(*deferrals <= 1, "message {n} deferred {deferrals} times");
        assert!(
            *start + 1_000 >= *slot,
            "message {n} started before its slot"
        );
        assert!(
            *start < *slot + period.as_micros(),
            "message {n} started {} µs after its slot",
            start - slot
        );
    }
    assert!(
        runs.iter().filter(|r| r.1 == 1).count() >= 15,
        "most waited for a slot"
    );
}

#[tokio::test]
async fn bad_rates_are_configuration_errors() {
    let cases = [
        Rate::new(0, secs(1)),
        Rate::new(MAX_RATE + 1, secs(1)),
        Rate::new(1, Duration::ZERO),
        Rate::new(1, Duration::from_micros(999)),
        Rate::new(1, Duration::from_secs(400 * 24 * 3600)),
        Rate::new(10, secs(1)).and_then(|r| r.burst(0)),
        Rate::new(10, secs(1)).and_then(|r| r.burst(11)),
        // 1,000,000 per ms with bursts of 1: under 1 µs apart.
        Rate::new(MAX_RATE, ms(1)).and_then(|r| r.burst(1)),
    ];
    for case in cases {
        assert!(matches!(case, Err(Error::Config(_))), "{case:?}");
    }
    // Waiting in a key's line until released is for locks.
    let server = server();
    let conn = manager(&server).await;
    let queue: Queue<String> = Queue::new(conn.clone(), "q").unwrap();
    let svc = RateLimitLayer::new(
        Locker::new(conn),
        |k: &String| k.clone(),
        Rate::new(1, secs(1)).unwrap(),
    )
    .on_conflict(OnConflict::defer(queue, DeferDelay::until_released()))
    .layer(service_fn(|_: String| async { Ok::<_, BoxError>(()) }));
    let error = svc.oneshot("k".into()).await.unwrap_err();
    assert!(
        matches!(error.downcast_ref::<Error>(), Some(Error::Config(_))),
        "{error}"
    );
}

#[allow(clippy::ptr_arg)] // the requests are `String`s
fn key(k: &String) -> String {
    k.clone()
}

#[tokio::test]
async fn a_rate_limit_stacks_with_permits() {
    let server = server();
    let conn = manager(&server).await;
    let locker = Locker::new(conn).ttl(secs(5)).unwrap();
    let backoff = Backoff::exponential(ms(1), ms(5))
        .unwrap()
        .unlimited_attempts()
        .max_elapsed(secs(10));
    let running = Arc::new(Mutex::new((0usize, 0usize)));
    let slots = Arc::new(Mutex::new(Vec::new()));
    let svc = ServiceBuilder::new()
        .layer(
            RateLimitLayer::new(locker.clone(), key, Rate::new(6, ms(200)).unwrap())
                .on_conflict(OnConflict::retry(backoff)),
        )
        .layer(
            LockLayer::new(locker, key)
                .permits(2)
                .unwrap()
                .on_conflict(OnConflict::retry(backoff)),
        )
        .service_fn({
            let (running, slots) = (running.clone(), slots.clone());
            move |_: String| {
                let (running, slots) = (running.clone(), slots.clone());
                async move {
                    slots
                        .lock()
                        .unwrap()
                        .push(us(RateSlot::current().unwrap().at()));
                    {
                        let mut r = running.lock().unwrap();
                        r.0 += 1;
                        r.1 = r.1.max(r.0);
                    }
                    sleep(ms(30)).await;
                    running.lock().unwrap().0 -= 1;
                    Ok::<_, BoxError>(())
                }
            }
        });
    let calls: Vec<_> = (0..18)
        .map(|_| svc.clone().oneshot("k".to_owned()))
        .collect();
    for outcome in timeout(BOUNDED, futures_util::future::join_all(calls))
        .await
        .unwrap()
    {
        assert_eq!(outcome.unwrap(), Outcome::Done(Outcome::Done(())));
    }
    assert_eq!(running.lock().unwrap().1, 2, "two at a time");
    let mut slots = slots.lock().unwrap().clone();
    slots.sort();
    assert!(most_in_window(&slots, ms(200)) <= 6);
}
