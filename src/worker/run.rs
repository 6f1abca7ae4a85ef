//! The worker's loop as a type: each round claims into a buffer when it
//! runs low, starts buffered jobs on free handler slots, and, with nothing
//! due, sleeps until the doorbell or the next due time.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OwnedSemaphorePermit;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tower::{Service, ServiceExt};
use tracing::Instrument;

use super::{
    AckQueue, Conn, Count, Payload, Settlement, Shared, WorkerResponse, failure, handle,
    panic_message,
};
use crate::BoxError;
use crate::backoff::Backoff;
use crate::error::{Error, Result};
use crate::queue::{BLOCK, Claim, ClaimToken, Connector, Job, MAX_BATCH, Waiter};

/// What ends the loop: `Some` with how `run_until` returns.
pub(super) type Stop = Option<Result<()>>;

/// How long the server may refuse the worker's user (an ACL change under
/// way, a password being rotated) before the worker gives up with the error.
const DENIED_GRACE: Duration = Duration::from_secs(5);

/// The loop's state between rounds.
pub(super) struct Run<T, C, K: Connector, S> {
    pub(super) service: S,
    pub(super) shared: Arc<Shared<T, C>>,
    pub(super) acks: AckQueue<T>,
    pub(super) waiter: Waiter<K, C>,
    pub(super) tasks: JoinSet<()>,
    /// Claimed jobs waiting for a free handler slot: leased (and renewed)
    /// like running ones.
    pub(super) buffer: VecDeque<(u64, Job<T>)>,
    /// Redis errors in a row, for the pause after each.
    pub(super) failures: u32,
    /// Since when the server has refused this worker's user (NOPERM,
    /// authentication) its claims, and its idle waits, each without a
    /// success of the same in between.
    pub(super) claims_denied: Option<Instant>,
    pub(super) waits_denied: Option<Instant>,
    /// Whether a claim may find due messages (the schedule was not seen
    /// empty of due messages since the last wake-up).
    pub(super) maybe_due: bool,
    pub(super) next_due: Option<Instant>,
    /// Whether the loop ends once nothing is due and nothing it claimed is
    /// in flight (`Worker::run_until_idle`).
    pub(super) until_idle: bool,
    /// Under `until_idle`, whether the last claim came after everything
    /// settled (a settlement may make more due: a retry, a key's next).
    pub(super) last_look: bool,
    /// The keyed turns claimed into the buffer and not started yet (by
    /// seq): a key that waits here for a slot, its lock held (messages
    /// continued by their run's ack hold theirs and take the next slot).
    pub(super) claimed_keyed: std::collections::HashSet<u64>,
    /// Whether the last claim took no keyed turn for want of a free slot:
    /// keys may be ready, and the loop claims again once a slot frees.
    pub(super) keyed_capped: bool,
}

impl<T: Payload, C: Conn, K, S> Run<T, C, K, S>
where
    K: Connector,
    S: Service<Job<T>> + Send + 'static,
    S::Response: WorkerResponse + Send + 'static,
    S::Error: Into<BoxError> + Send + 'static,
    S::Future: Send + 'static,
{
    /// Handler slots free for what is claimed next: those the buffered
    /// jobs will not take.
    fn free_slots(&self) -> usize {
        (self.shared.slots.available_permits()).saturating_sub(self.buffer.len())
    }

    /// Tells the runs at work whether a keyed turn claimed here waits in
    /// the buffer for a slot (see `Shared::yields`).
    fn note_waiting(&self) {
        self.shared.note_key_waits(!self.claimed_keyed.is_empty());
    }

    fn prefetch(&self) -> usize {
        let config = &self.shared.config;
        (config.prefetch).unwrap_or(config.concurrency.min(MAX_BATCH))
    }

    pub(super) async fn round(&mut self, shutdown: &mut (impl Future + Unpin)) -> Stop {
        while self.tasks.try_join_next().is_some() {}
        // Keyed messages an ack claimed start before anything else: their
        // key is held for them, and a claim's round trip would idle it.
        if self.take_continued()
            && let Some(stop) = self.start_buffered(shutdown).await
        {
            return Some(stop);
        }
        let (concurrency, prefetch) = (self.shared.config.concurrency, self.prefetch());
        let running = concurrency - self.shared.slots.available_permits();
        let room = (concurrency + prefetch).saturating_sub(running + self.buffer.len());
        // Refill once the buffer is down to half the prefetch, in batches
        // as large as the room allows (few round trips under backlog).
        if self.maybe_due
            && room > 0
            && self.buffer.len() <= prefetch / 2
            && let Err(stop) = self.refill(room.min(MAX_BATCH), shutdown).await
        {
            return stop;
        }
        if let Some(stop) = self.start_buffered(shutdown).await {
            return Some(stop);
        }
        if !self.buffer.is_empty() {
            // Every slot is busy: wait for one to free up.
            return self.wait_for_slot(shutdown).await;
        }
        if self.maybe_due {
            if self.shared.slots.available_permits() == 0 && prefetch == 0 {
                return self.wait_for_slot(shutdown).await;
            }
            return None;
        }
        self.idle(shutdown).await
    }

    /// Puts the keyed messages that acks claimed at the front of the
    /// buffer, their keys' locks being held for them; but after any job of
    /// the same key buffered already, which came earlier in the key's line
    /// (a key with permits has several at work).
    fn take_continued(&mut self) -> bool {
        let continued: Vec<_> = self.shared.continued().drain(..).collect();
        if continued.is_empty() {
            return false;
        }
        let mut front = 0;
        for (seq, job) in continued {
            let own = (self.buffer.iter())
                .rposition(|(_, buffered)| job.key().is_some() && buffered.key() == job.key());
            let at = own.map_or(front, |i| i + 1);
            self.buffer.insert(at, (seq, job));
            if at <= front {
                front += 1;
            }
        }
        true
    }

    /// Claims up to `max` jobs into the buffer, leased and tracked; `Err`
    /// ends the round (see `after_error`). Not raced against shutdown: a
    /// claim cancelled after the server ran it would strand its jobs until
    /// their lease ran out.
    async fn refill(
        &mut self,
        max: usize,
        shutdown: &mut (impl Future + Unpin),
    ) -> std::result::Result<(), Stop> {
        let shared = &self.shared;
        let sent = Instant::now();
        let lease = shared.config.lease;
        // Runs as long as the bounds of one claim allow (see `claim_runs`).
        let run = (shared.config.key_batch)
            .min(crate::queue::MAX_RUN as usize)
            .min(crate::queue::MAX_BATCH / max.max(1))
            .max(1);
        // No keyed turn without a free slot to start it: one claimed to
        // wait in the buffer holds its key, and its messages, from the
        // workers with a slot free.
        let keyed = if self.free_slots() == 0 { 0 } else { max };
        let claimed = match shared.queue.claim_runs_for(max, keyed, lease, run).await {
            Ok(claimed) => claimed,
            Err(error) => return Err(self.after_error(error, true, shutdown).await),
        };
        let claimed_at = Instant::now();
        shared
            .metrics
            .add(Count::Claimed, claimed.jobs.len() as u64);
        shared.metrics.add(Count::Dead, claimed.buried as u64);
        (self.failures, self.claims_denied) = (0, None);
        self.last_look &= claimed.jobs.is_empty();
        self.next_due = claimed.next_due.map(|d| claimed_at + d);
        // Each run's first goes in the buffer, the rest wait for it.
        let firsts = shared.track_claimed(claimed.jobs, sent + lease, run);
        // A full batch: more may be due. Keyed turns left for want of a
        // slot are looked for once one frees (see `idle`).
        self.keyed_capped = keyed == 0;
        self.maybe_due = firsts.len() == max;
        let keyed = firsts.iter().filter(|(_, job)| job.key().is_some());
        self.claimed_keyed.extend(keyed.map(|(seq, _)| *seq));
        self.buffer.extend(firsts);
        Ok(())
    }

    /// After a Redis error in a claim (`claiming`) or an idle wait: counts
    /// it, and ends the loop with it once the server has refused this
    /// worker's user for `DENIED_GRACE` (waiting does not help); else logs
    /// it and sleeps a jittered, growing pause (`Some(Ok(()))` when shutdown
    /// came first).
    async fn after_error(
        &mut self,
        error: Error,
        claiming: bool,
        shutdown: &mut (impl Future + Unpin),
    ) -> Stop {
        self.shared.metrics.count(Count::RedisErrors);
        let denied = match claiming {
            true => &mut self.claims_denied,
            false => &mut self.waits_denied,
        };
        if error.is_denied() && denied.get_or_insert_with(Instant::now).elapsed() >= DENIED_GRACE {
            return Some(Err(error));
        }
        let backoff = Backoff::exponential(Duration::from_millis(100), Duration::from_secs(5))
            .expect("constant arguments are valid");
        // At least half the cap, so that a dead server is not hammered.
        let pause = backoff.cap(self.failures) / 2 + backoff.delay(self.failures) / 2;
        self.failures = self.failures.saturating_add(1);
        tracing::warn!(%error, ?pause, "redis error in the worker loop; pausing");
        tokio::select! {
            biased;
            _ = shutdown => Some(Ok(())),
            () = tokio::time::sleep(pause) => None,
        }
    }

    /// Starts as many buffered jobs as there are free slots.
    async fn start_buffered(&mut self, shutdown: &mut (impl Future + Unpin)) -> Stop {
        while let Some((seq, job)) = self.buffer.pop_front() {
            let Ok(permit) = self.shared.slots.clone().try_acquire_owned() else {
                self.buffer.push_front((seq, job));
                return None;
            };
            let claimed = self.claimed_keyed.remove(&seq);
            let token = job.claim_ref().to_token();
            if self.shared.lost_while_buffered(seq, &token) {
                continue;
            }
            match self.shared.leased_for_start(seq, &token).await {
                Ok(true) => {}
                Ok(false) => continue,
                Err(error) => {
                    if claimed {
                        self.claimed_keyed.insert(seq);
                    }
                    self.buffer.push_front((seq, job));
                    return self.after_error(error, true, shutdown).await;
                }
            }
            let (deferrals, max) = (job.deferrals(), self.shared.config.max_deferrals);
            if let Some(max) = max.filter(|max| deferrals > *max) {
                let error =
                    format!("deferred {deferrals} times (limit {max}): its lock stayed busy");
                let settlement = Settlement::Bury {
                    error,
                    failed: false,
                };
                (self.shared).spawn_settle(&mut self.tasks, seq, token, settlement, permit);
                continue;
            }
            let ready = tokio::select! {
                biased;
                _ = &mut *shutdown => {
                    self.buffer.push_front((seq, job));
                    return Some(Ok(()));
                }
                ready = self.service.ready() => ready.map(|_| ()),
            };
            if let Err(error) = ready {
                // The service is broken for good: hand everything back.
                self.buffer.push_front((seq, job));
                return Some(Err(Error::Service(error.into())));
            }
            self.start(seq, job, token, permit);
        }
        None
    }

    /// Calls the service with `job` and spawns the call's handling.
    fn start(
        &mut self,
        seq: u64,
        mut job: Job<T>,
        token: ClaimToken,
        permit: OwnedSemaphorePermit,
    ) {
        // A later message of a run: whatever settles it by its own token
        // acknowledges the run's messages handled before it (the worker's
        // `token` does not: it cuts the run itself).
        if let Some(handled) = self.shared.handled_before(seq) {
            job.set_run_before(handled);
        }
        // Field names of OpenTelemetry's messaging conventions, so an
        // OpenTelemetry subscriber shows them as they are.
        let queue = self.shared.queue.name();
        let span = tracing::info_span!(
            "process",
            "otel.name" = %format_args!("process {queue}"),
            "otel.kind" = "consumer",
            "messaging.system" = "lockgate",
            "messaging.operation.type" = "process",
            "messaging.destination.name" = %queue,
            "messaging.message.id" = %token.id(),
            "messaging.lockgate.attempt" = token.attempt(),
        );
        if let Some(instruments) = self.shared.metrics.instruments() {
            // Due time by the server's clock, start by this host's.
            let lag = std::time::SystemTime::now()
                .duration_since(job.due_at())
                .unwrap_or_default();
            instruments.due_lag.record(lag.as_secs_f64());
        }
        let started = Instant::now();
        let held = self.shared.held_lock(seq, &token);
        // `call` itself may panic (code before a service_fn's async block, a
        // key function): that fails this message, not the worker.
        let call = std::panic::catch_unwind(AssertUnwindSafe(|| self.service.call(job)));
        match call {
            Ok(call) => {
                // A keyed job's handler holds its key's lock: it sees it
                // as `HeldLock::current()`, fences included.
                let call = async move {
                    match held {
                        Some(held) => held.scope(call).await,
                        None => call.await,
                    }
                };
                let handled = handle(
                    self.shared.clone(),
                    self.acks.clone(),
                    seq,
                    token,
                    (call, started),
                    permit,
                );
                self.tasks.spawn(handled.instrument(span));
            }
            Err(panic) => {
                let error = format!("service call panicked: {}", panic_message(&*panic));
                let settlement = failure(&self.shared.config, &token, error);
                (self.shared).spawn_settle(&mut self.tasks, seq, token, settlement, permit);
            }
        }
    }

    async fn wait_for_slot(&mut self, shutdown: &mut (impl Future + Unpin)) -> Stop {
        self.note_waiting();
        tokio::select! {
            biased;
            _ = &mut *shutdown => Some(Ok(())),
            permit = self.shared.slots.clone().acquire_owned() => {
                drop(permit);
                None
            }
        }
    }

    /// Nothing more is due: sleeps until the next due time, or until the
    /// doorbell rings. The cap is a safety net for a ring taken by a worker
    /// that was busy when it came.
    async fn idle(&mut self, shutdown: &mut (impl Future + Unpin)) -> Stop {
        self.note_waiting();
        let drained = self.until_idle && self.tasks.is_empty();
        if drained && self.shared.in_flight().is_empty() && self.shared.continued().is_empty() {
            if self.last_look {
                return Some(Ok(()));
            }
            // One more claim, after everything settled, says it for sure.
            (self.last_look, self.maybe_due) = (true, true);
            return None;
        }
        let now = Instant::now();
        let deadline = self
            .next_due
            .map_or(now + BLOCK, |due| due.min(now + BLOCK));
        // Waiting to drain, a handler's end is worth a look: it may have
        // been the last (its key's next message comes as `continued`).
        let watch_tasks = self.until_idle && !self.tasks.is_empty();
        // With no slot free, the doorbell is left to the workers that have
        // one: this one could start nothing it rang for.
        let full = self.shared.slots.available_permits() == 0;
        let woken = tokio::select! {
            biased;
            _ = &mut *shutdown => return Some(Ok(())),
            () = self.shared.continued_ready.notified() => return None,
            _ = self.tasks.join_next(), if watch_tasks => return None,
            // A slot freed (and no run's next message took it, which the
            // arm above sees first): what is due now, keyed turns the last
            // claim left included.
            permit = self.shared.slots.clone().acquire_owned(), if full || self.keyed_capped => {
                drop(permit);
                self.maybe_due = true;
                return None;
            }
            woken = self.waiter.wait(Some(deadline)), if !full => woken,
        };
        self.maybe_due = true;
        let Err(error) = woken else {
            self.waits_denied = None;
            return None;
        };
        self.after_error(error, false, shutdown).await
    }

    /// After the loop: hands back what was claimed but never started, and
    /// waits for the running handlers.
    pub(super) async fn finish(mut self) {
        let stopping = &self.shared.stopping;
        stopping.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.take_continued();
        for (seq, job) in self.buffer {
            let token = job.claim_ref().to_token();
            self.shared.cut_run(seq, &token).await;
            self.shared.release(&token).await;
            self.shared.in_flight().remove(&seq);
        }
        self.shared.drain(self.tasks).await;
        // Continued by an ack that had started before the loop stopped:
        // renewed until now, handed back unless the drain did already.
        let late: Vec<_> = self.shared.continued().drain(..).collect();
        for (seq, job) in late {
            if self.shared.in_flight().remove(&seq).is_some() {
                let token = job.claim_ref().to_token();
                self.shared.cut_run(seq, &token).await;
                self.shared.release(&token).await;
            }
        }
    }
}
