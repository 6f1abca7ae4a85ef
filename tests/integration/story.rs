//! One run of what lockgate does on a connection, for the tests that change
//! how it connects (TLS, a least-privilege ACL user): a lock taken, refused,
//! fenced, extended and released; permits; a queue with immediate and
//! delayed messages; a `Worker` (its blocking wait on a connection of its
//! own) driving a `LockLayer` that waits for releases through the
//! `ReleaseListener` and defers messages into busy keys' lines; the queue's stats and
//! dead letters. Panics on the first thing that fails, saying what it was.

use std::time::Duration;

use lockgate::layer::DeferDelay;
use lockgate::queue::Connector;
use lockgate::{
    Acquisition, Backoff, BoxError, Job, LockLayer, Locker, OnConflict, Queue, ReleaseListener,
    Worker,
};
use redis::aio::ConnectionLike;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tower::ServiceBuilder;

use crate::support::{Holds, ms};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Msg {
    n: u32,
    key: String,
}

/// Runs the story under `prefix` (the prefix an ACL user's key patterns name).
pub async fn everything<C, K>(conn: C, connector: K, listener: ReleaseListener, prefix: &str)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Connector + Clone,
{
    let locker = Locker::new(conn.clone())
        .prefix(prefix)
        .unwrap()
        .ttl(Duration::from_secs(5))
        .unwrap();

    // A lock: taken, refused to another, fenced, extended, released.
    let Acquisition::Acquired(mut lease) = locker.acquire("account-1").await.expect("acquire")
    else {
        panic!("a free key was refused");
    };
    assert!(
        matches!(
            locker.acquire("account-1").await.expect("acquire again"),
            Acquisition::Contended(_)
        ),
        "a held key was given out twice"
    );
    assert!(locker.fence(&lease).await.expect("fence") >= 1);
    assert!(
        locker
            .extend(&mut lease, Duration::from_secs(5))
            .await
            .expect("extend")
    );
    assert!(locker.release(&lease).await.expect("release"));

    // Permits: two at a time.
    let first = locker
        .acquire_permit("pool", 2)
        .await
        .expect("permit")
        .lease();
    let second = locker
        .acquire_permit("pool", 2)
        .await
        .expect("permit")
        .lease();
    assert!(
        first.is_some() && second.is_some(),
        "two permits of two were refused"
    );
    let third = locker.acquire_permit("pool", 2).await.expect("permit");
    assert!(
        third.lease().is_none(),
        "a third permit of two was given out"
    );
    assert_eq!(
        locker.permit_holders("pool").await.expect("holders").len(),
        2
    );
    for lease in [first, second].into_iter().flatten() {
        assert!(locker.release(&lease).await.expect("release permit"));
    }

    // A queue with immediate and delayed messages over three hot keys, and a
    // poison message that ends dead.
    let queue: Queue<Msg, C> = Queue::new(conn.clone(), "story")
        .unwrap()
        .prefix(prefix)
        .unwrap()
        .record_events(10_000)
        .unwrap()
        .keep_completed(Some(10), Some(Duration::from_secs(60)))
        .unwrap();
    let total: u32 = 60;
    let keys = ["a", "b", "c"];
    let msgs: Vec<Msg> = (0..total - 5)
        .map(|n| Msg {
            n,
            key: keys[n as usize % keys.len()].into(),
        })
        .collect();
    queue.push_many(&msgs).await.expect("push_many");
    for n in total - 5..total {
        let msg = Msg {
            n,
            key: keys[n as usize % keys.len()].into(),
        };
        queue.push_after(&msg, ms(100)).await.expect("push_after");
    }
    let poison = Msg {
        n: u32::MAX,
        key: "poison".into(),
    };
    queue
        .push_with(&poison, lockgate::PushOptions::new().priority(9))
        .await
        .expect("push with a priority");

    let holds = Holds::default();
    let backoff = Backoff::exponential(ms(1), ms(5)).unwrap().max_attempts(2);
    let service = ServiceBuilder::new()
        .layer(
            LockLayer::new(locker.clone(), |job: &Job<Msg>| job.key.clone())
                .on_conflict(
                    OnConflict::retry(backoff)
                        .then_defer(queue.clone(), DeferDelay::until_released()),
                )
                .wake_on_release(listener),
        )
        .service_fn({
            let holds = holds.clone();
            move |job: Job<Msg>| {
                let holds = holds.clone();
                async move {
                    if job.n == u32::MAX {
                        return Err::<(), BoxError>("poison".into());
                    }
                    let start = Instant::now();
                    tokio::time::sleep(ms(3)).await;
                    holds.record(&job.key, job.n, start, Instant::now());
                    Ok(())
                }
            }
        });
    let worker = Worker::new(connector.clone(), queue.clone(), service)
        .concurrency(8)
        .unwrap()
        .max_attempts(1)
        .unwrap();
    let done = {
        let holds = holds.clone();
        let queue = queue.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let dead = queue.stats().await.map(|s| s.dead).unwrap_or(0);
                if (holds.handled() == total as usize && dead == 1) || Instant::now() > deadline {
                    break;
                }
                tokio::time::sleep(ms(20)).await;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), worker.run_until(done))
        .await
        .expect("the worker shut down in time")
        .expect("the worker ran without error");

    holds.assert_each_once(total as usize);
    holds.assert_exclusive();
    let stats = queue.stats().await.expect("stats");
    assert_eq!(
        (stats.due, stats.later, stats.active, stats.dead),
        (0, 0, 0, 1),
        "{stats:?}"
    );
    let dead = queue
        .dead_letters(None, 10)
        .await
        .expect("dead letters")
        .letters;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(queue.requeue_dead(&dead[0].id).await.expect("requeue"));
    assert_eq!(queue.completed(100).await.expect("completed").len(), 10);
    // The events, read back from the start: the first is a push.
    let mut events = std::pin::pin!(
        queue
            .events(connector, lockgate::queue::EventsFrom::Beginning)
            .await
            .expect("events")
    );
    let first = tokio::time::timeout(
        Duration::from_secs(5),
        futures_util::StreamExt::next(&mut events),
    )
    .await
    .expect("an event in time")
    .expect("the stream goes on")
    .expect("an event");
    assert_eq!(first.kind, lockgate::queue::EventKind::Pushed);
    queue.purge().await.expect("purge");
}
