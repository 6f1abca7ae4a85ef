//! One handler call: run under the message's claim, its panics caught, and
//! its outcome turned into the message's settlement.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;

use super::metrics::Count;
use super::{AckQueue, Config, Conn, Payload, Settlement, Shared, WorkerResponse};
use crate::BoxError;
use crate::queue::ClaimToken;

/// Runs one handler call and settles its message.
pub(super) async fn handle<T: Payload, C: Conn, R, E>(
    shared: Arc<Shared<T, C>>,
    acks: AckQueue<T>,
    seq: u64,
    token: ClaimToken,
    (call, started): (
        impl Future<Output = std::result::Result<R, E>> + Send,
        Instant,
    ),
    permit: OwnedSemaphorePermit,
) where
    R: WorkerResponse,
    E: Into<BoxError>,
{
    let mut cancel = shared.cancel.subscribe();
    let outcome = tokio::select! {
        biased;
        outcome = AssertUnwindSafe(call).catch_unwind() => outcome,
        // Shutdown outlived its timeout: drop the call, hand the message back.
        () = async { drop(cancel.wait_for(|cancelled| *cancelled).await) } => {
            shared.cut_run(seq, &token).await;
            shared.release(&token).await;
            shared.in_flight().remove(&seq);
            return;
        }
    };
    if let Some(instruments) = shared.metrics.instruments() {
        instruments.handler.record(started.elapsed().as_secs_f64());
    }
    // A read ahead of its run in flight lands first: the lease is renewed
    // meanwhile, and what it brought is the run's.
    shared.ahead_landed(seq).await;
    // Settling starts: stop renewing the lease. A renewal that found the
    // claim gone while the handler ran left a mark; what it means depends
    // on the outcome. A keyed message's lock is not the call's any more:
    // its clones (a task the handler spawned) must not act for the next.
    let flight = shared.in_flight().remove(&seq);
    if let Some(held) = flight.as_ref().and_then(|f| f.held.as_ref()) {
        held.mark_lost();
    }
    let refused = flight.as_ref().is_some_and(|f| f.refused);
    let settlement = settlement_of(&shared, &token, outcome);
    if refused && settlement.is_some() {
        // The claim is gone for good (claim numbers never repeat), so any
        // settlement would be refused: count the loss once, write nothing.
        // The rest of its run went with it.
        shared.drop_run(seq);
        shared.metrics.count(Count::LostLeases);
        tracing::warn!(id = %token.id(), "lease ran out while the handler ran; the message will be handled again");
        return;
    }
    if let Some(Settlement::Ack(true)) = settlement
        && token.held_lock().is_some()
    {
        return (shared.ack_and_continue((seq, flight), token, acks, permit)).await;
    }
    let Some(settlement) = settlement else {
        // Rescheduled in place by a `LockLayer`, by the job's own token:
        // that settlement acknowledged the run's messages handled before
        // it and put the rest back in line as it let the key go.
        return shared.forget_deferred_run(seq);
    };
    shared.cut_run(seq, &token).await;
    match settlement {
        Settlement::Ack(done) => shared.queue_ack(&acks, token, done).await,
        settlement => shared.settle(&token, settlement).await,
    }
}

/// How a handled message is settled: `None` when a LockLayer rescheduled it
/// in place.
fn settlement_of<T, C, R, E>(
    shared: &Shared<T, C>,
    token: &ClaimToken,
    outcome: std::thread::Result<std::result::Result<R, E>>,
) -> Option<Settlement>
where
    R: WorkerResponse,
    E: Into<BoxError>,
{
    match outcome {
        Ok(Ok(response)) => match response.deferred_as() {
            // Rescheduled in place by the LockLayer: nothing left to do. That
            // deferral ended the claim, so a renewal racing it was refused:
            // nothing was lost (the deferral's script proved the claim ours).
            Some(id) if id == token.id() => {
                shared.metrics.count(Count::Deferred);
                None
            }
            // Pushed as a new message (a `LockLayer` over the payload, or
            // into another queue): acknowledge the original.
            Some(_) => {
                shared.metrics.count(Count::Deferred);
                Some(Settlement::Ack(false))
            }
            None => Some(Settlement::Ack(true)),
        },
        Ok(Err(error)) => Some(failure(&shared.config, token, error_chain(&*error.into()))),
        Err(panic) => {
            let error = format!("handler panicked: {}", panic_message(&*panic));
            Some(failure(&shared.config, token, error))
        }
    }
}

pub(super) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

pub(super) fn failure(config: &Config, token: &ClaimToken, error: String) -> Settlement {
    if token.attempt() >= config.max_attempts {
        tracing::warn!(id = %token.id(), attempt = token.attempt(), %error, "message failed for the last time; burying it");
        // The dead letter says which limit it hit (recover's says
        // "lease expired N times (limit N)", a deferral cap "deferred N times").
        let (attempt, max) = (token.attempt(), config.max_attempts);
        let error = format!("failed {attempt} times (max_attempts {max}): {error}");
        Settlement::Bury {
            error,
            failed: true,
        }
    } else {
        tracing::info!(id = %token.id(), attempt = token.attempt(), %error, "message failed; retrying later");
        Settlement::Retry(error)
    }
}

/// An error and its sources, joined with ": ".
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let chain = std::iter::successors(Some(error), |error| error.source());
    let texts: Vec<String> = chain.map(|error| error.to_string()).collect();
    texts.join(": ")
}
