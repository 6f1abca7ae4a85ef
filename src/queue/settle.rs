//! Settling claimed messages: acknowledged (alone, in batches, or with
//! the key's next message claimed), retried, deferred, released or buried.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use redis::aio::ConnectionLike;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::keyed::{Ending, Held, MAX_RUN, Outcome, RunArgs, Settled, Turn};
use super::scripts::{self, Query};
use super::{
    Acked, Claim, ClaimToken, Job, MAX_BATCH, Queue, QueueKeys, by_shard, check_count, check_lease,
    from_unix_ms, in_groups, token,
};
use crate::error::{Error, Result};
use crate::lock::millis;

impl<T, C> Queue<T, C>
where
    T: Serialize + DeserializeOwned,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// Completes a claimed message: it is deleted. Returns `false`, changing
    /// nothing, when the claim is no longer held (its lease ran out and the
    /// message went back to the schedule or to another worker), or when the
    /// message is gone already (completed or removed).
    pub async fn ack<J: Claim>(&self, job: &J) -> Result<bool> {
        let job = token(job);
        if let Some(held) = &job.held {
            return self.settle_keyed(job, held, Outcome::Ack).await;
        }
        let acked = self.ack_batch(self.shard_of(job)?, &[job], "done").await?;
        Ok(acked.first() == Some(&Acked::Done))
    }

    /// Completes many claimed messages in one round trip (at most
    /// [`MAX_BATCH`] per call). Returns, per message, whether its claim was
    /// still held.
    pub async fn ack_many<'a, J, I>(&self, jobs: I) -> Result<Vec<bool>>
    where
        J: Claim + 'a,
        I: IntoIterator<Item = &'a J>,
    {
        let acked = self.ack_claims(jobs).await?;
        Ok(acked.into_iter().map(|a| a == Acked::Done).collect())
    }

    /// [`ack_many`](Self::ack_many), telling apart a claim lost to a lease
    /// that ran out from a message that is gone already (which, after a
    /// transport error, means an earlier copy of the call ran).
    pub(crate) async fn ack_claims<'a, J, I>(&self, jobs: I) -> Result<Vec<Acked>>
    where
        J: Claim + 'a,
        I: IntoIterator<Item = &'a J>,
    {
        // The unkeyed ones in one script call per shard, each keyed one in
        // its key's partition, all at once; the answers in the batch's
        // order. A keyed one found gone may have been acknowledged by an
        // earlier attempt whose reply was lost: the caller knows whether
        // one was.
        let jobs: Vec<&ClaimToken> = jobs.into_iter().map(token).collect();
        check_count("an ack_many batch", jobs.len(), 0..=MAX_BATCH)?;
        let shards = by_shard(&jobs)
            .into_iter()
            .map(|(shard, batch)| async move {
                let plain: Vec<&ClaimToken> = batch.iter().map(|(_, job)| *job).collect();
                let acked = (self.ack_batch(self.shards.get(shard)?, &plain, "done")).await?;
                Ok(batch.iter().map(|(n, _)| *n).zip(acked).collect::<Vec<_>>())
            });
        let keyed = jobs.iter().enumerate().filter(|(_, j)| j.held.is_some());
        let keyed = keyed.map(|(n, job)| async move {
            let acked = self.ack(*job).await?;
            Ok(vec![(n, if acked { Acked::Done } else { Acked::Gone })])
        });
        use futures_util::future::{join, join_all};
        let (shards, keyed) = join(join_all(shards), in_groups(keyed.collect())).await;
        let mut out = vec![Acked::NotHeld; jobs.len()];
        let mut failed = None;
        for answers in shards.into_iter().chain(keyed) {
            match answers {
                Ok(answers) => answers.into_iter().for_each(|(n, acked)| out[n] = acked),
                Err(error) => failed = failed.or(Some(error)),
            }
        }
        failed.map_or(Ok(out), Err)
    }

    /// Acknowledges unkeyed messages in one script call; `kind` names their
    /// event: `done`, or `deferred` for one that moved into its key's line
    /// (not kept on the completed stream).
    async fn ack_batch(
        &self,
        k: &QueueKeys,
        jobs: &[&ClaimToken],
        kind: &str,
    ) -> Result<Vec<Acked>> {
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        let mut call = scripts::ACK_MANY.prepare_invoke();
        let completed = self.recording.completed.unwrap_or_default().args();
        let keep = kind == "done" && self.recording.completed.is_some();
        call.key(&[&k.data, &k.active, &k.errors, &k.completed, &k.events])
            .key(&k.activity)
            .arg(self.events_arg())
            .arg(if keep { "1" } else { "" })
            .arg(completed.0)
            .arg(completed.1)
            .arg(kind);
        for job in jobs {
            call.arg(job.member())
                .arg(&job.id)
                .arg(if job.failures() > 0 { "1" } else { "0" })
                .arg(job.failures);
        }
        let attempted = || format!("acknowledging messages in queue `{}`", self.name());
        let acked: Vec<i64> = call.query_on(&self.conn, attempted).await?;
        Ok(acked
            .into_iter()
            .map(|a| match a {
                1 => Acked::Done,
                0 => Acked::NotHeld,
                _ => Acked::Gone,
            })
            .collect())
    }

    /// Puts a claimed message back on the schedule after a failure, due
    /// `delay` from now, counting a failed attempt and recording `error`.
    /// Returns the new due time, or `None` when the claim is no longer held.
    pub async fn retry<J: Claim>(
        &self,
        job: &J,
        delay: Duration,
        error: &str,
    ) -> Result<Option<SystemTime>> {
        let outcome = Outcome::Retry { delay, error };
        self.reschedule(token(job), outcome).await
    }

    /// Puts a claimed message back on the schedule because its lock was
    /// busy: counts a deferral, not a failed attempt. Returns the new due
    /// time, or `None` when the claim is no longer held.
    pub async fn defer<J: Claim>(&self, job: &J, delay: Duration) -> Result<Option<SystemTime>> {
        self.reschedule(token(job), Outcome::Defer { delay }).await
    }

    /// Moves a claimed, unkeyed message into the line of `key` (see
    /// [`PushOptions::key`]; `limits` as the keyed push takes them), due
    /// after `delay`, counting a deferral: a `LockLayer` found its key
    /// busy, and there it is claimed only with the key's lock. The copy
    /// goes into the key's partition first (same id, its counts kept), then
    /// the message leaves this queue: a crash in between leaves both, and
    /// the original comes back after its lease, so the message may run
    /// twice but is never lost. `None` when the claim is no longer held.
    pub(crate) async fn defer_to_key(
        &self,
        job: &ClaimToken,
        (key, limits): (&str, &str),
        delay: Duration,
    ) -> Result<Option<SystemTime>> {
        let attempted = || format!("deferring message `{}` into its key's line", job.id);
        if key.is_empty() || key.contains('\0') {
            return Err(Error::InvalidKey(format!(
                "message `{}` cannot join the line of a key that is empty or holds NUL",
                job.id
            )));
        }
        let k = self.shard_of(job)?;
        let (record, held): (Option<Vec<u8>>, Option<f64>) = redis::pipe()
            .hget(&k.data, &job.id)
            .zscore(&k.active, job.member())
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(attempted()))?;
        let (Some(record), Some(_)) = (record, held) else {
            return Ok(None);
        };
        let keyed = self.keyed();
        let (_, due) = keyed
            .take_in((key, limits), &job.id, millis(delay), &record)
            .await?;
        // Out of this queue, with a `deferred` event (the message goes on,
        // in its key's line).
        let removed = self.ack_batch(k, &[job], "deferred").await?;
        if removed.first() != Some(&Acked::Done) {
            tracing::warn!(id = %job.id, %key, "claim lost while the message moved into its key's line: it may run twice");
        }
        Ok(Some(from_unix_ms(due)))
    }

    /// Hands a claimed message back, due now, without counting a failure or
    /// a deferral (a worker shutting down before it could handle it).
    /// Returns `false` when the claim is no longer held.
    pub async fn release<J: Claim>(&self, job: &J) -> Result<bool> {
        let due = self.reschedule(token(job), Outcome::Release).await?;
        Ok(due.is_some())
    }

    /// Retries, defers or releases a claimed message.
    async fn reschedule(
        &self,
        job: &ClaimToken,
        outcome: Outcome<'_>,
    ) -> Result<Option<SystemTime>> {
        let (delay, counter, error) = match outcome {
            Outcome::Retry { delay, error } => (delay, "failure", error),
            Outcome::Defer { delay } => (delay, "deferral", ""),
            _ => (Duration::ZERO, "release", ""),
        };
        if let Some(held) = &job.held {
            let settled = self.settle_keyed(job, held, outcome).await?;
            return Ok(settled.then(|| SystemTime::now() + delay));
        }
        let k = self.shard_of(job)?;
        let attempted = || format!("rescheduling message `{}` ({counter})", job.id);
        let due: i64 = scripts::RESCHEDULE
            .key(&[&k.data, &k.schedule, &k.active, &k.errors])
            .key(&[&k.bell, &k.prioritized, &k.events, &k.activity])
            .arg(job.member())
            .arg(&job.id)
            .arg(millis(delay))
            .arg(counter)
            .arg(error)
            .arg(self.events_arg())
            .query_on(&self.conn, attempted)
            .await?;
        if due >= 0 {
            self.mark_shard_after(usize::from(job.shard), due).await;
        }
        Ok((due >= 0).then(|| from_unix_ms(due)))
    }

    /// Moves a claimed message to the dead letters with `error`, counting
    /// this delivery as a failed attempt. Returns `false`, changing nothing,
    /// when the claim is no longer held.
    pub async fn bury<J: Claim>(&self, job: &J, error: &str) -> Result<bool> {
        self.bury_with(job, error, true).await
    }

    /// Buries; `failed` says whether the delivery counts as a failed attempt
    /// (not so for undecodable payloads or too many deferrals).
    pub(crate) async fn bury_with<J: Claim>(
        &self,
        job: &J,
        error: &str,
        failed: bool,
    ) -> Result<bool> {
        let job = token(job);
        if let Some(held) = &job.held {
            return self.settle_keyed(job, held, Outcome::Bury { error }).await;
        }
        let (max_count, max_age) = self.recording.dead.args();
        let k = self.shard_of(job)?;
        let buried: i64 = scripts::BURY
            .key(&[&k.active, &k.dead, &k.errors, &k.data, &k.events])
            .key(&k.activity)
            .arg(job.member())
            .arg(&job.id)
            .arg(error)
            .arg(if failed { "1" } else { "0" })
            .arg(max_count)
            .arg(max_age)
            .arg(self.events_arg())
            .query_on(&self.conn, || format!("burying message `{}`", job.id))
            .await?;
        Ok(buried == 1)
    }

    /// Acknowledges a claimed message and, for a keyed one
    /// ([`PushOptions::key`](super::PushOptions::key)), claims its key's next message in line in the
    /// same script, under the same lock; its lease ends with the lock, or
    /// `lease` from now when the lock passes on under a new token or the
    /// key has permits. No next job when there is none, when other code
    /// waits for the lock, when the key's limits leave no room, or after
    /// [`MAX_RUN`] in a row. Returns whether `job`'s claim was held, and
    /// the next job. See docs/keyed.md, "Keyed messages".
    pub async fn ack_and_next<J: Claim>(
        &self,
        job: &J,
        lease: Duration,
    ) -> Result<(bool, Option<Job<T>>)> {
        let (held, next) = self.ack_run(std::slice::from_ref(job), lease, 1).await?;
        Ok((held, next.into_iter().next()))
    }

    /// Acknowledges a run of a key's messages and claims up to `max` of
    /// the key's next messages under the same lock, as
    /// [`ack_and_next`](Self::ack_and_next) claims one: a hot key pays one
    /// script per run. `run` is the messages handled one after another,
    /// oldest first, each claimed by the previous run's call (or by a
    /// claim, for the first): the last one's claim decides (`false`,
    /// nothing changed, when it was lost); the earlier ones are
    /// acknowledged with it. The next run comes in line order, to be
    /// handled one after another; when one of them fails, settle the
    /// others with [`cut_run`](Self::cut_run) first. A key with permits
    /// or a rate limit, or whose lock another fenced or waited for, goes
    /// on one message at a time. See docs/keyed.md, "Keyed messages".
    pub async fn ack_run<J: Claim>(
        &self,
        run: &[J],
        lease: Duration,
        max: usize,
    ) -> Result<(bool, Vec<Job<T>>)> {
        check_lease(lease)?;
        let Some((last, handled)) = run.split_last() else {
            return Err(Error::config("ack_run needs the run's messages, got none"));
        };
        check_count("a run's next messages", max, 1..=MAX_BATCH)?;
        let handled: Vec<ClaimToken> = handled.iter().map(|j| token(j).clone()).collect();
        self.ack_run_with(token(last), &handled, lease, (false, max))
            .await
    }

    /// Settles the rest of a run ([`ack_run`](Self::ack_run)) while one of
    /// its messages, `at_work`, goes on (about to be retried, deferred or
    /// buried, say): `handled`, the messages before it, are acknowledged,
    /// and `unstarted`, those after it, go back to their place in line.
    /// The key's lock stays with `at_work`, whose own settlement follows.
    /// A message whose claim was lost meanwhile (its lease ran out) is
    /// left as it is.
    pub async fn cut_run<J: Claim>(
        &self,
        at_work: &J,
        handled: &[J],
        unstarted: &[J],
    ) -> Result<()> {
        let tokens = |jobs: &[J]| jobs.iter().map(|j| token(j).clone()).collect::<Vec<_>>();
        let (handled, unstarted) = (tokens(handled), tokens(unstarted));
        self.cut_run_with(token(at_work), (&handled, &unstarted))
            .await
    }

    /// [`cut_run`](Self::cut_run) with the tokens.
    pub(crate) async fn cut_run_with(
        &self,
        at_work: &ClaimToken,
        (handled, unstarted): (&[ClaimToken], &[ClaimToken]),
    ) -> Result<()> {
        if handled.is_empty() && unstarted.is_empty() {
            return Ok(());
        }
        let run = RunArgs {
            max: 1,
            handled,
            unstarted,
        };
        self.keyed().settle_run(at_work, run).await
    }

    /// Reads ahead in a run ([`ack_run`](Self::ack_run)): while `at_work`,
    /// the last message of its run known so far, goes on at work,
    /// acknowledges `handled` (the run's messages before it) and claims
    /// up to `max` of the key's next messages in line into the run, under
    /// the same lock and claim number, leased for `lease`: a worker knows
    /// them before `at_work`'s handler returns, and starts the first at
    /// once. They come after `at_work` in the run: acknowledge them with
    /// [`ack_run`](Self::ack_run) (`at_work` first), or settle them with
    /// [`cut_run`](Self::cut_run). Returns whether `at_work`'s claim was
    /// held, and the messages claimed: none when the key has no more in
    /// line, has permits or a rate limit, when its lock was fenced or
    /// other code waits for it, or after [`MAX_RUN`] in a row. A resend
    /// whose first call ran answers what that call claimed. See
    /// docs/keyed.md, "Runs".
    pub async fn extend_run<J: Claim>(
        &self,
        at_work: &J,
        handled: &[J],
        lease: Duration,
        max: usize,
    ) -> Result<(bool, Vec<Job<T>>)> {
        check_lease(lease)?;
        check_count("a run's next messages", max, 1..=MAX_BATCH)?;
        let handled: Vec<ClaimToken> = handled.iter().map(|j| token(j).clone()).collect();
        (self.extend_run_with(token(at_work), &handled, lease, (false, max))).await
    }

    /// [`extend_run`](Self::extend_run) with the tokens; `run_on` lifts
    /// [`MAX_RUN`], as for [`ack_run_with`](Self::ack_run_with).
    pub(crate) async fn extend_run_with(
        &self,
        at_work: &ClaimToken,
        handled: &[ClaimToken],
        lease: Duration,
        (run_on, max): (bool, usize),
    ) -> Result<(bool, Vec<Job<T>>)> {
        let Some(held) = at_work.held.as_ref() else {
            return Err(Error::config(
                "extend_run needs a keyed message at work, got one without a key",
            ));
        };
        let run = RunArgs {
            max: run_room(held, (run_on, max)),
            handled,
            unstarted: &[],
        };
        match self.keyed().read_ahead(at_work, run, lease).await? {
            Settled::Lost => Ok((false, Vec::new())),
            Settled::Done => Ok((true, Vec::new())),
            Settled::Next(turns) => Ok((true, self.decode_run(turns, Some(at_work)).await.0)),
        }
    }

    /// [`ack_run`](Self::ack_run) of `handled` then `job`; `run_on` lifts
    /// [`MAX_RUN`] (the worker has a slot free for the keys that wait).
    pub(crate) async fn ack_run_with(
        &self,
        job: &ClaimToken,
        handled: &[ClaimToken],
        lease: Duration,
        room: (bool, usize),
    ) -> Result<(bool, Vec<Job<T>>)> {
        if job.held.is_none() {
            return Ok((self.ack(job).await?, Vec::new()));
        }
        let end = RunEnd { job, handled, room };
        let calls = self.ack_runs_with(&[end], lease).await?;
        let answer = calls.into_iter().next().map(|(_, answers)| answers);
        let attempted = || format!("acknowledging keyed message `{}`", job.id);
        let answers = answer.ok_or_else(|| Error::reply(attempted(), "no call"))??;
        (answers.into_iter().next()).ok_or_else(|| Error::reply(attempted(), "no reply"))?
    }

    /// Acknowledges several keys' runs in one round trip, each as
    /// [`ack_run`](Self::ack_run) acknowledges one (`run`, oldest first),
    /// claiming up to `max` of each key's next messages under its lock:
    /// one script call on one server, one per partition on a Redis
    /// Cluster, however many keys (a run that may claim no more, after
    /// [`MAX_RUN`] in a row, goes in a call of its own). At most
    /// [`MAX_BATCH`] runs, every message keyed.
    ///
    /// Answers per run, in order: whether its last message's claim was
    /// held and its key's next run, or the error its end met. Each run's
    /// end stands or fails alone: one refused in the script (its lock
    /// turned into another kind of key, say) leaves the others settled,
    /// and their next runs are in their answers, held for the caller. A
    /// call that got no answer may have run (see [`ack_many`](Self::ack_many)):
    /// its runs answer its error, and the next runs it claimed come back
    /// after their lease.
    pub async fn ack_runs<J: Claim>(
        &self,
        runs: &[&[J]],
        lease: Duration,
        max: usize,
    ) -> Result<Vec<Result<(bool, Vec<Job<T>>)>>> {
        check_lease(lease)?;
        check_count("an ack_runs batch", runs.len(), 0..=MAX_BATCH)?;
        check_count("a run's next messages", max, 1..=MAX_BATCH)?;
        let mut lasts = Vec::with_capacity(runs.len());
        for run in runs {
            let Some((last, handled)) = run.split_last() else {
                return Err(Error::config(
                    "ack_runs needs each run's messages, got none",
                ));
            };
            let handled: Vec<ClaimToken> = handled.iter().map(|j| token(j).clone()).collect();
            lasts.push((token(last), handled));
        }
        let ends: Vec<RunEnd<'_>> = (lasts.iter())
            .map(|(job, handled)| RunEnd {
                job,
                handled,
                room: (false, max),
            })
            .collect();
        let mut answers: Vec<Option<RunAnswer<T>>> = runs.iter().map(|_| None).collect();
        for (indexes, call) in self.ack_runs_with(&ends, lease).await? {
            match call {
                Ok(call) => {
                    for (n, answer) in indexes.into_iter().zip(call) {
                        answers[n] = Some(answer);
                    }
                }
                Err(error) => {
                    for n in indexes {
                        answers[n] = Some(Err(error.again()));
                    }
                }
            }
        }
        let attempted = || format!("acknowledging {} keyed runs", runs.len());
        let all = answers
            .into_iter()
            .map(|answer| answer.unwrap_or_else(|| Err(Error::reply(attempted(), "no reply"))));
        Ok(all.collect())
    }

    /// [`ack_runs`](Self::ack_runs) of `ends`, each with its own room
    /// (see [`ack_run_with`](Self::ack_run_with)). Answers per call: the
    /// indexes of its runs, and their answers in that order (or the error
    /// a run's block met), or the call's error (the others' answers
    /// stand).
    pub(crate) async fn ack_runs_with(
        &self,
        ends: &[RunEnd<'_>],
        lease: Duration,
    ) -> Result<Vec<(Vec<usize>, Result<Vec<RunAnswer<T>>>)>> {
        let mut endings = Vec::with_capacity(ends.len());
        for end in ends {
            let Some(held) = end.job.held.as_ref() else {
                return Err(Error::config(format!(
                    "ack_runs takes keyed messages; `{}` has no key",
                    end.job.id
                )));
            };
            let max = run_room(held, end.room);
            endings.push(Ending {
                held,
                member: (end.job.id.as_str(), end.job.claim, end.job.failures()),
                outcome: Outcome::Ack,
                next: (max > 0).then_some(lease),
                run: RunArgs {
                    max: max.max(1),
                    handled: end.handled,
                    unstarted: &[],
                },
            });
        }
        let mut calls = Vec::new();
        for (indexes, settled) in self.keyed().done_many(&endings).await? {
            let answers = match settled {
                Ok(settled) => Ok(self.runs_of(settled).await),
                Err(error) => Err(error),
            };
            calls.push((indexes, answers));
        }
        Ok(calls)
    }

    /// What acknowledging runs came to, per run: whether its claim was
    /// held, and the next run its call claimed.
    async fn runs_of(&self, settled: Vec<Result<Settled>>) -> Vec<RunAnswer<T>> {
        let mut answers = Vec::with_capacity(settled.len());
        for one in settled {
            answers.push(match one {
                Ok(Settled::Lost) => Ok((false, Vec::new())),
                Ok(Settled::Done) => Ok((true, Vec::new())),
                Ok(Settled::Next(turns)) => Ok((true, self.decode_run(turns, None).await.0)),
                Err(error) => Err(error),
            });
        }
        answers
    }

    /// A run's turns as jobs, up to the first that does not decode: that
    /// one and those after it go back in line under the run's hold
    /// ([`cut_run`](Self::cut_run)), so that it comes first in the next
    /// run; first in a run, it is buried, once the others went back (the
    /// `bool`: whether it was). `at_work`: the run's message that goes on
    /// at work while these were read ahead: the first goes back under it
    /// too, as its burial would let the key go.
    pub(super) async fn decode_run(
        &self,
        turns: Vec<Turn>,
        at_work: Option<&ClaimToken>,
    ) -> (Vec<Job<T>>, bool) {
        let mut jobs: Vec<Job<T>> = Vec::with_capacity(turns.len());
        let mut turns = turns.into_iter();
        while let Some(turn) = turns.next() {
            let bad = match self.decode_turn_only(turn) {
                Ok(job) => {
                    jobs.push(job);
                    continue;
                }
                Err(bad) => bad,
            };
            let token = bad.0.claim_ref().to_token();
            let rest = turns.map(|turn| Self::turn_token_of(&turn));
            match jobs.first().map(|first| first.claim_ref().0).or(at_work) {
                Some(at_work) => {
                    let unstarted: Vec<ClaimToken> = std::iter::once(token).chain(rest).collect();
                    self.cut_or_log(at_work, &unstarted).await;
                    return (jobs, false);
                }
                None => {
                    let unstarted: Vec<ClaimToken> = rest.collect();
                    self.cut_or_log(&token, &unstarted).await;
                    return (jobs, self.bury_undecodable(*bad).await);
                }
            }
        }
        (jobs, false)
    }

    /// Puts a run's `unstarted` messages back in line; a failure is logged
    /// (they come back when their lease runs out).
    async fn cut_or_log(&self, at_work: &ClaimToken, unstarted: &[ClaimToken]) {
        if let Err(error) = self.cut_run_with(at_work, (&[], unstarted)).await {
            tracing::warn!(id = %at_work.id(), %error, "could not put a run's messages back in line; they come back after their lease");
        }
    }

    /// Ends a keyed message's turn; `false` when its claim was lost.
    async fn settle_keyed(
        &self,
        job: &ClaimToken,
        held: &Arc<Held>,
        outcome: Outcome<'_>,
    ) -> Result<bool> {
        let member = (job.id.as_str(), job.claim, job.failures());
        // The run's messages handled before it, acknowledged first (a
        // worker's job handed to a service, see `ClaimToken::run_before`).
        let run = RunArgs {
            handled: job.run_before(),
            ..RunArgs::ONE
        };
        let settled = (self.keyed())
            .done(held, member, outcome, (None, run))
            .await?;
        Ok(settled != Settled::Lost)
    }
}

/// What acknowledging a run came to: whether its claim was held, and the
/// next run claimed.
pub(crate) type RunAnswer<T> = Result<(bool, Vec<Job<T>>)>;

/// A run to acknowledge in [`Queue::ack_runs_with`]: its last message,
/// those handled before it, and its room for the key's next messages
/// (`run_on`, `max`, see [`Queue::ack_run_with`]).
pub(crate) struct RunEnd<'a> {
    pub(crate) job: &'a ClaimToken,
    pub(crate) handled: &'a [ClaimToken],
    pub(crate) room: (bool, usize),
}

/// How many more messages a run under `held` may claim: `max`, and
/// without a slot free (`run_on` false) no more than [`MAX_RUN`] in a row,
/// after which the key lets go.
fn run_room(held: &Held, (run_on, max): (bool, usize)) -> u32 {
    let max = u32::try_from(max).unwrap_or(u32::MAX);
    if run_on {
        max
    } else {
        max.min(MAX_RUN.saturating_sub(held.run))
    }
}
