//! Future types.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;

use crate::BoxError;
use crate::outcome::Outcome;

/// Response future of [`Lock`](super::Lock).
///
/// Boxed, because each of its steps (acquire, renew, release, defer) is a
/// boxed Redis call already. Dropping it releases a held lock at once
/// (through a spawned task) rather than leaving it to its TTL.
pub struct ResponseFuture<R> {
    inner: BoxFuture<'static, Result<Outcome<R>, BoxError>>,
}

impl<R> ResponseFuture<R> {
    pub(crate) fn new(inner: BoxFuture<'static, Result<Outcome<R>, BoxError>>) -> Self {
        Self { inner }
    }
}

impl<R> Future for ResponseFuture<R> {
    type Output = Result<Outcome<R>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<R> std::fmt::Debug for ResponseFuture<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
