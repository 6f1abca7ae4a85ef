//! Runs of a key's messages. A claim, or an acknowledgement, claims up to
//! [`Worker::key_batch`](super::Worker::key_batch) of a key's messages
//! under one lock ([`Queue::ack_run`](crate::Queue::ack_run)); they start
//! one after another, each as soon as the handler before it returns, with
//! no call in between. As the last one known starts, the run reads ahead
//! ([`Queue::extend_run`](crate::Queue::extend_run)): the ones handled are
//! acknowledged and the key's next messages join the run while it runs,
//! so a busy key goes on with no round trip between its messages. A run
//! that finds nothing more ends with its last one's acknowledgement,
//! which claims the next run if messages came meanwhile. A message
//! settled any other way (failed, buried, handed back) cuts its run
//! first: the ones handled before it are acknowledged, those after it go
//! back to their place in line, and the key's lock stays with it until
//! its own settlement.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, mpsc, oneshot};
use tokio::time::Instant;

use super::metrics::Count;
use super::{AckQueue, Conn, HAND_BACK_TIMEOUT, InFlight, Payload, Shared};
use crate::queue::{Claim, ClaimToken, Job, RunEnd};

/// The rest of a run, kept under the in-flight number of its message now
/// at work (or about to start).
pub(super) struct KeyRun<T> {
    /// Handled, to be acknowledged with the run's last: still in the
    /// in-flight table (renewed) until then.
    handled: Vec<(u64, ClaimToken)>,
    /// Still to start, in line order; tracked (renewed) already.
    rest: VecDeque<(u64, Job<T>)>,
    /// Whether the call that claimed its last messages got all it asked
    /// for: the key may have more in line, worth reading ahead for (a key
    /// with fewer pays no call for nothing).
    full: bool,
    /// A read ahead in flight: closed once its answer is in the run.
    ahead: Option<oneshot::Receiver<()>>,
    /// A read ahead whose answer never came: it may have claimed messages
    /// this worker does not know of, so the run ends without a hand-over
    /// (which would claim messages after them); the key's lock let go
    /// puts them back in line.
    unsure: bool,
}

impl<T> KeyRun<T> {
    fn new(handled: Vec<(u64, ClaimToken)>, rest: VecDeque<(u64, Job<T>)>, full: bool) -> Self {
        KeyRun {
            handled,
            rest,
            full,
            ahead: None,
            unsure: false,
        }
    }
}

/// The end of a run, waiting for its writer (see [`Shared::end_run`]).
pub(super) struct RunEnding<T> {
    /// The run's last message, and the ones handled before it.
    token: ClaimToken,
    handled: Vec<ClaimToken>,
    /// Whether a slot is free here, and how many of the key's next
    /// messages to claim (see `Queue::ack_run_with`).
    room: (bool, usize),
    answer: oneshot::Sender<Answer<T>>,
}

/// What ending a run came to (see [`Shared::end_runs`]).
pub(super) type Answer<T> = Option<(bool, Vec<Job<T>>)>;

/// The runs at work, by in-flight number.
pub(super) type Runs<T> = std::sync::Mutex<HashMap<u64, KeyRun<T>>>;

impl<T: Payload, C: Conn> Shared<T, C> {
    fn runs(&self) -> MutexGuard<'_, HashMap<u64, KeyRun<T>>> {
        // Plain inserts and removes: poisoning cannot leave it inconsistent.
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// After a keyed message's handler returned `Ok`: starts the next of
    /// its run, or acknowledges the run and claims the key's next run (one
    /// script), which the loop starts before anything else. Falls back to
    /// the batched acknowledgement (which retries) when the call fails,
    /// and once the loop stops. `flight`: the message's claim as the
    /// in-flight table had it.
    pub(super) async fn ack_and_continue(
        &self,
        (seq, flight): (u64, Option<InFlight>),
        token: ClaimToken,
        acks: AckQueue<T>,
        permit: OwnedSemaphorePermit,
    ) {
        self.ahead_landed(seq).await;
        let (mut handled, mut rest, full, hand_over) = match self.runs().remove(&seq) {
            Some(run) => (run.handled, run.rest, run.full, !run.unsure),
            None => (Vec::new(), VecDeque::new(), false, true),
        };
        let stopping = self.stopping.load(Ordering::Relaxed);
        if !stopping && let Some((next_seq, next)) = rest.pop_front() {
            // Renewed until the run's end acknowledges it.
            if let Some(flight) = flight {
                self.in_flight().insert(
                    seq,
                    InFlight {
                        held: None,
                        ..flight
                    },
                );
            }
            handled.push((seq, token));
            let at_work = next.claim_ref().to_token();
            let mut run = KeyRun::new(handled, rest, full);
            // The last one known starts: read ahead while it runs, unless
            // its slot goes to a key that waits for one (`yields`; asked
            // while this message still holds it).
            let reads_ahead = run.rest.is_empty() && full && at_work.reads_ahead();
            let reading = (reads_ahead && !self.yields()).then(|| {
                let (landed, ahead) = oneshot::channel();
                run.ahead = Some(ahead);
                (landed, run.handled.clone())
            });
            self.runs().insert(next_seq, run);
            // Its slot is the next one's, free before the loop looks (a
            // read ahead needs none).
            drop(permit);
            self.continue_with(next_seq, next);
            if let Some((landed, done)) = reading {
                self.read_ahead((next_seq, at_work), done, landed).await;
            }
            return;
        }
        if stopping {
            self.cut(&token, handled, rest).await;
            return self.queue_ack(&acks, token, true).await;
        }
        self.end_run(token, handled, hand_over, &acks).await;
    }

    /// The end of a run (`token`'s, after `handled`): acknowledges them
    /// all and, with `hand_over`, claims the key's next run, which the
    /// loop starts before anything else. Written by the run ender, with
    /// the other runs that end meanwhile (here when it is gone).
    async fn end_run(
        &self,
        token: ClaimToken,
        handled: Vec<(u64, ClaimToken)>,
        hand_over: bool,
        acks: &AckQueue<T>,
    ) {
        // With a slot free here, a key that waits is claimed here: the busy
        // key need not let go after MAX_RUN.
        let run_on = self.slots.available_permits() > 0;
        // Claims nothing when a key that waits here for a slot should have
        // this one's (`yields`): the key goes back in line, ready.
        let batch = match hand_over && !self.yields() {
            true => self.config.key_batch,
            false => 0,
        };
        let (answer, answered) = oneshot::channel();
        let ending = RunEnding {
            token: token.clone(),
            handled: handled.iter().map(|(_, token)| token.clone()).collect(),
            room: (run_on, batch),
            answer,
        };
        // The script leases the next run after this.
        let sent = Instant::now();
        if let Err(mpsc::error::SendError(ending)) = acks.ends.send(ending) {
            self.end_runs(vec![ending]).await;
        }
        let answer = answered.await.ok().flatten();
        self.forget(handled.iter().map(|(seq, _)| *seq));
        let ended = 1 + handled.len() as u64;
        match answer {
            Some((true, next)) => {
                self.metrics.add(Count::Done, ended);
                // Renewed from now on, not once the loop takes them: the
                // script gave them a whole lease, which must not lapse
                // while they wait for the loop.
                self.start_run(next, sent + self.config.lease);
            }
            Some((false, _)) => {
                self.metrics.add(Count::LostLeases, ended);
                tracing::warn!(id = %token.id(), "lease ran out before the message was acknowledged; it is handled again elsewhere");
            }
            None => {
                // The run's earlier messages first, the key kept: this
                // one's acknowledgement lets the key go, and with it any
                // message of the run still at work.
                self.cut(&token, handled, VecDeque::new()).await;
                self.queue_ack(acks, token, true).await;
            }
        }
    }

    /// Writes the ends of runs (see [`end_run`](Self::end_run)) in one
    /// round trip, answering each on its channel: whether its claim was
    /// held, and the key's next run; `None` when the call failed (logged
    /// here).
    pub(super) async fn end_runs(&self, ends: Vec<RunEnding<T>>) {
        if ends.is_empty() {
            return;
        }
        let runs: Vec<RunEnd<'_>> = (ends.iter())
            .map(|end| RunEnd {
                job: &end.token,
                handled: &end.handled,
                room: end.room,
            })
            .collect();
        let calls = self.queue.ack_runs_with(&runs, self.config.lease).await;
        let mut answers: Vec<Answer<T>> = ends.iter().map(|_| None).collect();
        match calls {
            Ok(calls) => {
                for (indexes, call) in calls {
                    match call {
                        Ok(call) => {
                            for (n, answer) in indexes.into_iter().zip(call) {
                                match answer {
                                    Ok(answer) => answers[n] = Some(answer),
                                    Err(error) => self.run_ends_failed(&error, 1),
                                }
                            }
                        }
                        Err(error) => self.run_ends_failed(&error, indexes.len()),
                    }
                }
            }
            Err(error) => self.run_ends_failed(&error, ends.len()),
        }
        for (end, answer) in ends.into_iter().zip(answers) {
            // Nobody waits for it (its task was aborted at shutdown): the
            // run claimed goes back in line.
            if let Err(Some((true, next))) = end.answer.send(answer) {
                self.hand_back_run(&next).await;
            }
        }
    }

    /// Hands back a run claimed for nobody: its first message released
    /// lets go of the key and puts the others back in line (see
    /// `Queue::cut_run`); failing that, they come back after their lease.
    async fn hand_back_run(&self, run: &[Job<T>]) {
        let Some(first) = run.first() else {
            return;
        };
        if let Err(error) = self.queue.release(first).await {
            tracing::warn!(%error, id = %first.id(), "could not hand back a run claimed at shutdown; it comes back after its lease");
        }
    }

    /// Notes that a call ending `n` runs failed: each falls back to the
    /// batched acknowledgement, which retries.
    fn run_ends_failed(&self, error: &crate::Error, n: usize) {
        self.metrics.count(Count::RedisErrors);
        tracing::warn!(%error, runs = n, "could not acknowledge keyed messages; retrying in the next batch");
    }

    /// Reads ahead in the run of message `seq` (`at_work`), the last one
    /// known, as it starts: acknowledges `done`, the run's messages before
    /// it, and claims the key's next messages into the run; closes
    /// `landed` once the answer is in the run. A message that ended
    /// meanwhile waited for it ([`ahead_landed`](Self::ahead_landed)); one
    /// settled otherwise cut its run already: what came back goes back in
    /// line under its claim.
    async fn read_ahead(
        &self,
        (seq, at_work): (u64, ClaimToken),
        done: Vec<(u64, ClaimToken)>,
        landed: oneshot::Sender<()>,
    ) {
        let run_on = self.slots.available_permits() > 0;
        let (lease, batch) = (self.config.lease, self.config.key_batch);
        let tokens: Vec<ClaimToken> = done.iter().map(|(_, token)| token.clone()).collect();
        let sent = Instant::now();
        let answer = (self.queue)
            .extend_run_with(&at_work, &tokens, lease, (run_on, batch))
            .await;
        let jobs = match answer {
            Ok((true, jobs)) => jobs,
            // Its own settlement finds the claim gone, and says so.
            Ok((false, _)) => return,
            Err(error) => {
                self.metrics.count(Count::RedisErrors);
                tracing::warn!(%error, id = %at_work.id(), "could not read ahead in a keyed run; the run ends with this message");
                if let Some(run) = self.runs().get_mut(&seq) {
                    run.unsure = true;
                }
                return;
            }
        };
        // Acknowledged: no longer renewed. The ones claimed are, from now.
        self.forget(done.iter().map(|(seq, _)| *seq));
        self.metrics.add(Count::Done, done.len() as u64);
        let full = jobs.len() >= batch;
        self.metrics.add(Count::Claimed, jobs.len() as u64);
        let tracked: Vec<(u64, Job<T>)> = {
            let mut in_flight = self.in_flight();
            let track = |job: Job<T>| (self.track(&mut in_flight, &job, sent + lease), job);
            jobs.into_iter().map(track).collect()
        };
        let cut = {
            let mut runs = self.runs();
            match runs.get_mut(&seq) {
                Some(run) => {
                    run.handled.clear();
                    run.rest.extend(tracked);
                    run.full = full;
                    None
                }
                None => Some(tracked),
            }
        };
        if let Some(tracked) = cut {
            self.cut(&at_work, Vec::new(), tracked.into()).await;
        }
        drop(landed);
    }

    /// Waits for the read ahead in flight in message `seq`'s run, if any,
    /// to land in the run.
    pub(super) async fn ahead_landed(&self, seq: u64) {
        let ahead = self.runs().get_mut(&seq).and_then(|run| run.ahead.take());
        if let Some(ahead) = ahead {
            // Closed once landed, whichever way the call went.
            let _ = ahead.await;
        }
    }

    /// The messages of message `seq`'s run handled before it, not
    /// acknowledged yet; `None` for none.
    pub(super) fn handled_before(&self, seq: u64) -> Option<Arc<[ClaimToken]>> {
        let runs = self.runs();
        let handled = &runs.get(&seq)?.handled;
        (!handled.is_empty()).then(|| handled.iter().map(|(_, token)| token.clone()).collect())
    }

    /// Tracks the jobs a claim took, leased until `leased_until`: each
    /// run's first (a job of its own, for most) is returned for the
    /// buffer, the rest of its run kept to start after it, as a run an
    /// acknowledgement claimed (see `Queue::claim_runs`).
    pub(super) fn track_claimed(
        &self,
        jobs: Vec<Job<T>>,
        leased_until: Instant,
        run: usize,
    ) -> Vec<(u64, Job<T>)> {
        let mut firsts: Vec<(u64, Job<T>)> = Vec::with_capacity(jobs.len());
        let mut runs: Vec<(u64, KeyRun<T>)> = Vec::new();
        {
            let mut in_flight = self.in_flight();
            for job in jobs {
                let seq = self.track(&mut in_flight, &job, leased_until);
                let first = firsts.last().map(|(first, _)| *first);
                match (first, job.claim_ref().continues_run()) {
                    (Some(first), true) => match runs.last_mut() {
                        Some((of, run)) if *of == first => run.rest.push_back((seq, job)),
                        _ => {
                            let rest = VecDeque::from([(seq, job)]);
                            let handled = Vec::new();
                            runs.push((first, KeyRun::new(handled, rest, false)));
                        }
                    },
                    _ => firsts.push((seq, job)),
                }
            }
        }
        for (_, key_run) in &mut runs {
            key_run.full = 1 + key_run.rest.len() >= run;
        }
        self.runs().extend(runs);
        firsts
    }

    /// Tracks a run an acknowledgement claimed, leased until
    /// `leased_until`, and hands its first message to the loop.
    fn start_run(&self, jobs: Vec<Job<T>>, leased_until: Instant) {
        self.metrics.add(Count::Claimed, jobs.len() as u64);
        let mut run: VecDeque<(u64, Job<T>)> = {
            let mut in_flight = self.in_flight();
            let track = |job: Job<T>| (self.track(&mut in_flight, &job, leased_until), job);
            jobs.into_iter().map(track).collect()
        };
        let Some((seq, first)) = run.pop_front() else {
            return;
        };
        if !run.is_empty() {
            let full = 1 + run.len() >= self.config.key_batch;
            self.runs().insert(seq, KeyRun::new(Vec::new(), run, full));
        }
        self.continue_with(seq, first);
    }

    fn continue_with(&self, seq: u64, job: Job<T>) {
        self.continued().push_back((seq, job));
        self.continued_ready.notify_one();
    }

    /// Before message `seq` (`token`) is settled otherwise than by an ack
    /// that goes on with its run: settles the rest of its run while the
    /// key's lock is still its own.
    pub(super) async fn cut_run(&self, seq: u64, token: &ClaimToken) {
        self.ahead_landed(seq).await;
        let Some(run) = self.runs().remove(&seq) else {
            return;
        };
        self.cut(token, run.handled, run.rest).await;
    }

    /// Acknowledges `handled` and puts `rest` back in line, under
    /// `token`'s hold; a failure is logged (they come back after their
    /// lease, the handled ones to be handled again).
    async fn cut(
        &self,
        token: &ClaimToken,
        handled: Vec<(u64, ClaimToken)>,
        rest: VecDeque<(u64, Job<T>)>,
    ) {
        if handled.is_empty() && rest.is_empty() {
            return;
        }
        let done: Vec<ClaimToken> = handled.iter().map(|(_, token)| token.clone()).collect();
        let unstarted: Vec<ClaimToken> = rest
            .iter()
            .map(|(_, job)| job.claim_ref().to_token())
            .collect();
        let write = self.queue.cut_run_with(token, (&done, &unstarted));
        // At shutdown, bounded as a hand-back is (see `Shared::release`).
        let written = match self.stopping.load(Ordering::Relaxed) {
            true if self.hand_back_stalled.load(Ordering::Relaxed) => None,
            true => match tokio::time::timeout(HAND_BACK_TIMEOUT, write).await {
                Ok(written) => Some(written),
                Err(_) => {
                    self.hand_back_stalled.store(true, Ordering::Relaxed);
                    None
                }
            },
            false => Some(write.await),
        };
        match written {
            Some(Ok(())) => self.metrics.add(Count::Done, done.len() as u64),
            Some(Err(error)) => {
                self.metrics.count(Count::RedisErrors);
                tracing::warn!(%error, id = %token.id(), "could not settle the rest of a keyed run; its messages come back after their lease");
            }
            None => {
                self.metrics.count(Count::RedisErrors);
                tracing::warn!(id = %token.id(), "shutdown: no answer in time; the rest of a keyed run comes back after its lease");
            }
        }
        self.forget(handled.iter().map(|(seq, _)| *seq));
        self.forget(rest.iter().map(|(seq, _)| *seq));
    }

    /// At shutdown, once the handlers that outlived it were cancelled or
    /// aborted: settles the runs left before their claims are handed back,
    /// so that a handled message is acknowledged, not handed back to run
    /// again. Any message of a run names its key, hold and claim.
    pub(super) async fn cut_left_runs(&self) {
        let runs: Vec<(u64, KeyRun<T>)> = self.runs().drain().collect();
        for (seq, run) in runs {
            let at_work = self.in_flight().get(&seq).map(|f| f.token.clone());
            let anchor = at_work
                .or_else(|| run.handled.first().map(|(_, token)| token.clone()))
                .or_else(|| run.rest.front().map(|(_, job)| job.claim_ref().to_token()));
            if let Some(anchor) = anchor {
                self.cut(&anchor, run.handled, run.rest).await;
            }
        }
    }

    /// Forgets the run of message `seq`, which a `LockLayer` deferred in
    /// place by the job's own token: that settlement acknowledged the
    /// messages handled before it (counted done here) and put the rest
    /// back in line.
    pub(super) fn forget_deferred_run(&self, seq: u64) {
        let Some(run) = self.runs().remove(&seq) else {
            return;
        };
        self.metrics.add(Count::Done, run.handled.len() as u64);
        self.forget(run.handled.iter().map(|(seq, _)| *seq));
        self.forget(run.rest.iter().map(|(seq, _)| *seq));
    }

    /// Forgets the run of message `seq`, whose claim was lost: its other
    /// messages' claims went with it (they come back after their lease).
    pub(super) fn drop_run(&self, seq: u64) {
        let Some(run) = self.runs().remove(&seq) else {
            return;
        };
        self.forget(run.handled.iter().map(|(seq, _)| *seq));
        self.forget(run.rest.iter().map(|(seq, _)| *seq));
    }

    /// Stops renewing the claims `seqs`.
    fn forget(&self, seqs: impl Iterator<Item = u64>) {
        let mut in_flight = self.in_flight();
        for seq in seqs {
            in_flight.remove(&seq);
        }
    }
}
