//! [`RateLimitLayer`]: at most r calls per period per key, cluster-wide.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use redis::aio::ConnectionLike;
use tokio::time::Instant;
use tower::Service;

use super::future::ResponseFuture;
use super::service::call_ready;
use super::strategy::{Fail, GiveUp, OnConflict};
use super::{LockKey, message_id};
use crate::BoxError;
use crate::lock::rate::{Decision, Rate, server_time};
use crate::lock::{Locker, Token};
use crate::outcome::Outcome;

tokio::task_local! {
    static CURRENT: RateSlot;
}

/// The slot a [`RateLimitLayer`] admitted the running call in: its key and
/// the admission time by the server's clock. Read it from inside the
/// handler with [`RateSlot::current`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateSlot {
    key: String,
    at: SystemTime,
}

impl RateSlot {
    /// The slot of the call running now, when called from a handler under a
    /// `RateLimitLayer` (the innermost one); `None` elsewhere.
    pub fn current() -> Option<RateSlot> {
        CURRENT.try_with(Clone::clone).ok()
    }

    /// The user's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// When the call was admitted, by the server's clock: for a message
    /// that reserved its slot, the slot's time (it starts then, plus the
    /// queue's delivery lag).
    pub fn at(&self) -> SystemTime {
        self.at
    }
}

/// Admits at most r calls per period per key, cluster-wide (see
/// [`lock::rate`](crate::lock::rate) for how), and applies an
/// [`OnConflict`] strategy to the calls over the limit: `fail()` answers
/// [`Contended`](crate::Contended) whose `retry_after` is exactly when the
/// next slot opens; `retry` waits until then, within the backoff's budget;
/// `then_defer(queue, DeferDelay::until_allowed())` reserves the slot for
/// the message. `DeferDelay::until_released()` fails the call with
/// [`Error::Config`](crate::Error::Config). Nothing is held while the
/// handler runs: stack it outside a [`LockLayer`](crate::LockLayer) for "at
/// most n at a time and at most r per second" per key. A key function
/// returning `None` calls through. See docs/limits.md, "Rate limits per key".
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), lockgate::BoxError> {
/// # let server = lockgate::testing::RedisServer::start()?;
/// # let conn = server.connection_manager().await?;
/// use std::time::Duration;
/// use lockgate::layer::RateLimitLayer;
/// use lockgate::lock::rate::Rate;
/// use lockgate::{Locker, Outcome};
/// use tower::{ServiceBuilder, ServiceExt};
///
/// fn account(call: &(String, u64)) -> String { call.0.clone() }
///
/// // At most 100 calls per second per account, at most 10 back to back.
/// let rate = Rate::new(100, Duration::from_secs(1))?.burst(10)?;
/// let service = ServiceBuilder::new()
///     .layer(RateLimitLayer::new(Locker::new(conn), account, rate))
///     .service_fn(|(_, amount): (String, u64)| async move { Ok::<_, lockgate::BoxError>(amount) });
/// let outcome = service.oneshot(("acc-1".into(), 7)).await?;
/// assert_eq!(outcome, Outcome::Done(7));
/// # Ok(()) }
/// ```
pub struct RateLimitLayer<C, F, D = Fail> {
    config: Arc<RateConfig<C, F, D>>,
}

struct RateConfig<C, F, D> {
    locker: Locker<C>,
    key_fn: F,
    rate: Rate,
    on_conflict: OnConflict<D>,
}

impl<C, F, D> Clone for RateLimitLayer<C, F, D> {
    fn clone(&self) -> Self {
        Self {
            config: self.config.clone(),
        }
    }
}

impl<C, F, D: std::fmt::Debug> std::fmt::Debug for RateLimitLayer<C, F, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("rate", &self.config.rate)
            .field("on_conflict", &self.config.on_conflict)
            .finish_non_exhaustive()
    }
}

impl<C, F> RateLimitLayer<C, F, Fail> {
    /// Limits calls to `rate` per key; `key_fn` gives each request's key.
    /// The locker gives the connection and the key prefix. Over the limit,
    /// calls fail with [`Contended`](crate::Contended) until
    /// [`on_conflict`](Self::on_conflict) says otherwise.
    pub fn new(locker: Locker<C>, key_fn: F, rate: Rate) -> Self {
        Self {
            config: Arc::new(RateConfig {
                locker,
                key_fn,
                rate,
                on_conflict: OnConflict::fail(),
            }),
        }
    }
}

impl<C: Clone, F: Clone, D> RateLimitLayer<C, F, D> {
    /// Sets what happens to a call over the limit.
    pub fn on_conflict<D2>(self, strategy: OnConflict<D2>) -> RateLimitLayer<C, F, D2> {
        RateLimitLayer {
            config: Arc::new(RateConfig {
                locker: self.config.locker.clone(),
                key_fn: self.config.key_fn.clone(),
                rate: self.config.rate,
                on_conflict: strategy,
            }),
        }
    }
}

impl<S, C, F, D> tower::Layer<S> for RateLimitLayer<C, F, D> {
    type Service = RateLimit<S, C, F, D>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            config: self.config.clone(),
        }
    }
}

/// Admits calls to the inner service under a rate limit per key. Made by
/// [`RateLimitLayer`].
pub struct RateLimit<S, C, F, D> {
    inner: S,
    config: Arc<RateConfig<C, F, D>>,
}

impl<S: Clone, C, F, D> Clone for RateLimit<S, C, F, D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, C, F, D> std::fmt::Debug for RateLimit<S, C, F, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("rate", &self.config.rate)
            .finish_non_exhaustive()
    }
}

impl<S, C, F, D, Req, K> Service<Req> for RateLimit<S, C, F, D>
where
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    S::Response: Send + 'static,
    Req: Send + 'static,
    F: Fn(&Req) -> K + Send + Sync + 'static,
    K: LockKey,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    D: GiveUp<Req>,
{
    type Response = Outcome<S::Response>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let key = (self.config.key_fn)(&req).into_lock_key();
        let config = self.config.clone();
        // The message's id, as for the LockLayer: to push it under, or to
        // hand on to the layers inside once admitted.
        let id = message_id::take();
        ResponseFuture::new(Box::pin(async move {
            match key {
                None => call_ready(inner, req, id).await,
                Some(key) => admitted_call(config, inner, key, req, id).await,
            }
        }))
    }
}

/// Admission (waiting or deferring as configured), then the call.
async fn admitted_call<S, C, F, D, Req>(
    config: Arc<RateConfig<C, F, D>>,
    mut inner: S,
    key: String,
    req: Req,
    id: Option<String>,
) -> Result<Outcome<S::Response>, BoxError>
where
    S: Service<Req> + Send + 'static,
    S::Error: Into<BoxError>,
    C: ConnectionLike + Clone + Send + Sync + 'static,
    D: GiveUp<Req>,
{
    let (locker, rate) = (&config.locker, &config.rate);
    let then = &config.on_conflict.then;
    if then.until_released() {
        return Err(crate::Error::Config(format!(
            "a rate limit has no release to wait for on `{key}`: use DeferDelay::until_allowed()"
        ))
        .into());
    }
    // A job deferred in place until its slot reserves it under its own id,
    // and finds it when it comes back.
    let reserves = then.reserves_slot(&req).map(str::to_owned);
    let token = Token::random();
    let member = reserves.as_deref().unwrap_or(token.as_str());
    let started = Instant::now();
    let retry = config.on_conflict.retry;
    let mut tries: u32 = 0;
    let at = loop {
        tries = tries.saturating_add(1);
        let wait = match locker.decide(&key, rate, member, false).await? {
            Decision::Admitted(at) => break at,
            Decision::Later { wait, .. } => wait,
        };
        if let Some(backoff) = retry {
            // Again exactly when the slot opens, if the budget allows a try
            // then.
            let within_attempts = backoff.max_attempts.is_none_or(|n| tries < n);
            let within_time = backoff
                .max_elapsed
                .is_none_or(|limit| started.elapsed() + wait <= limit);
            if within_attempts && within_time {
                tracing::trace!(%key, tries, ?wait, "over the rate; waiting for the next slot");
                Box::pin(tokio::time::sleep(wait)).await;
                continue;
            }
        }
        // Giving up. A deferral until the slot reserves it (unless it
        // opened meanwhile: then the call runs now).
        let wait = match reserves {
            Some(_) => match locker.decide(&key, rate, member, true).await? {
                Decision::Admitted(at) => break at,
                Decision::Later { wait, .. } => wait,
            },
            None => wait,
        };
        tracing::debug!(%key, tries, ?wait, "over the rate; giving up");
        let busy = crate::Contended::new(key, wait);
        let give_up = message_id::provide(id, || then.give_up(req, busy));
        let (id, due) = Box::pin(give_up).await?;
        return Ok(Outcome::Deferred { id, due });
    };
    let slot = RateSlot {
        key,
        at: server_time(at),
    };
    let call = message_id::provide(id, || inner.call(req));
    let done = CURRENT.scope(slot, call).await;
    done.map(Outcome::Done).map_err(Into::into)
}
