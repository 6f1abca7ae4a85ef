//! Issue 39, item 2: a `LockLayer` over a closure handler whose `async`
//! block's output is inferred (`|r| async { Ok::<_, BoxError>(()) }`),
//! called with `oneshot` inside `tokio::spawn`, fails to compile with
//! "implementation of `From` is not general enough". The bound behind it
//! is `S::Error: Into<BoxError>`, which every tower middleware that boxes
//! errors has (tower's own `Timeout` fails the same way): inside the
//! spawned future the compiler erases the lifetime of the block's
//! `Box<dyn Error + 'static>` and cannot prove the conversion for every
//! lifetime (a known rustc limitation). The exact shape is kept as a
//! `compile_fail` doc test on `LockLayer` (it starts passing there, and
//! that test fails, the day rustc accepts it); here, the shapes that do
//! compile and that the docs recommend, each spawned and run.

use crate::support;

use lockgate::{BoxError, LockLayer, Locker};
use tower::{Service, ServiceBuilder, ServiceExt};

#[derive(Debug, Clone)]
struct Req {
    key: String,
}

async fn handle(_: Req) -> Result<(), BoxError> {
    Ok(())
}

async fn locker() -> (
    lockgate::testing::RedisServer,
    Locker<redis::aio::ConnectionManager>,
) {
    let server = support::server();
    let locker = Locker::new(support::manager(&server).await);
    (server, locker)
}

#[tokio::test]
async fn a_named_async_fn_handler_is_called_in_a_spawned_task() {
    let (_server, locker) = locker().await;
    let svc = ServiceBuilder::new()
        .layer(LockLayer::new(locker, |r: &Req| r.key.clone()))
        .service_fn(handle);
    let req = Req { key: "k".into() };
    let outcome = tokio::spawn(async move { svc.oneshot(req).await });
    assert!(!outcome.await.unwrap().unwrap().is_deferred());
}

#[tokio::test]
async fn a_closure_handler_called_with_ready_and_call_in_a_spawned_task() {
    let (_server, locker) = locker().await;
    let mut svc = ServiceBuilder::new()
        .layer(LockLayer::new(locker, |r: &Req| r.key.clone()))
        .service_fn(|_: Req| async { Ok::<_, BoxError>(()) });
    let req = Req { key: "k".into() };
    let outcome = tokio::spawn(async move { svc.ready().await?.call(req).await });
    assert!(!outcome.await.unwrap().unwrap().is_deferred());
}
