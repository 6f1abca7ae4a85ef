//! The end of a keyed message's turn at work (`lua/keyed_done.lua`): an
//! acknowledgement, which may hand the key over to its next messages, a
//! retry, a deferral, a release or a burial; and the rest of a run
//! settled, or read ahead, while one of its messages goes on.

use std::sync::Arc;
use std::time::Duration;

use redis::Cmd;
use redis::aio::ConnectionLike;

use super::{
    DONE, DoneReply, Held, Keyed, Log, Next, Outcome, RunArgs, Settled, Turn, attempt_of, millis,
    own_id, stored_id,
};
use crate::error::{Error, Result};
use crate::keys;
use crate::lock::{Token, detect_publish};
use crate::queue::{ClaimToken, EventKind};
use crate::script::run;

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// Ends a turn with `outcome`, and settles the rest of its run as
    /// `run` says. For an ack with `next` set, the key's next messages (up
    /// to `run.max`) are claimed at once under the same lock, leased for
    /// `next`. `failures`: the message's failed attempts before this one.
    pub(crate) async fn done(
        &self,
        held: &Arc<Held>,
        (id, claim, failures): (&str, u64, u32),
        outcome: Outcome<'_>,
        (next, others): (Option<Duration>, RunArgs<'_>),
    ) -> Result<Settled> {
        let attempted = || format!("settling keyed message `{id}`");
        let publish = detect_publish(&self.state.publish, self.conn)
            .await
            .map_err(Error::redis(attempted()))?;
        let next_token = Token::random();
        let member = (id, claim, failures);
        let (mut cmd, kind, error) =
            self.done_call(held, member, outcome, (next, &next_token), publish);
        cmd.arg(others.max);
        others.add_to(&mut cmd, &held.key);
        let completed = self.completed_of(held, others.handled).await?;
        let (status, acked, nexts, flags) = self.send_done(&cmd, next, attempted).await?;
        let reply = (status, acked, nexts);
        let (acked, settled) = (self.settled(held, (claim, next_token), reply, attempted)).await?;
        // Nothing to build on the hot path unless something is recorded.
        if self.recording.events.is_some() || !acked.is_empty() || !completed.is_empty() {
            let mut log = Log::default();
            if settled != Settled::Lost {
                log.handled(held, others.handled, flags.as_deref(), completed);
            }
            log.append(outcome_log(
                held,
                (id, failures),
                (kind, error),
                (acked, &settled),
            ));
            self.record(log).await;
        }
        Ok(settled)
    }

    /// The records of a run's messages `handled` before this call, for the
    /// completed stream when the queue keeps one (else none): read before
    /// the call, which deletes them (they are at work under this hold, so
    /// nothing else changes them).
    async fn completed_of(
        &self,
        held: &Held,
        handled: &[ClaimToken],
    ) -> Result<Vec<(String, Vec<u8>)>> {
        if self.recording.completed.is_none() || handled.is_empty() {
            return Ok(Vec::new());
        }
        let ids = handled.iter().map(|token| stored_id(&held.key, &token.id));
        let records: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
            .arg(&held.partition.keys[0])
            .arg(ids.collect::<Vec<_>>())
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis(
                "reading a run's records for the completed stream",
            ))?;
        let pairs = handled.iter().zip(records);
        let kept = pairs.filter_map(|(token, record)| Some((token.id.clone(), record?)));
        Ok(kept.collect())
    }

    /// Settles the rest of a run while its message `at_work` goes on: the
    /// messages handled before it acknowledged, those not started back in
    /// line (see `lua/keyed_done.lua`); each only while still at work
    /// under the run's claim.
    pub(crate) async fn settle_run(&self, at_work: &ClaimToken, others: RunArgs<'_>) -> Result<()> {
        self.run_call(at_work, others, None).await.map(drop)
    }

    /// Reads ahead in `at_work`'s run: settles the rest of the run as
    /// [`settle_run`](Self::settle_run) does, and while `at_work` goes on,
    /// claims up to `others.max` of its key's next messages into the run,
    /// leased for `lease` (see `lua/keyed_done.lua`, "ahead"). `Next` with
    /// them; `Done` when none came; `Lost` when `at_work`'s claim is gone.
    pub(crate) async fn read_ahead(
        &self,
        at_work: &ClaimToken,
        others: RunArgs<'_>,
        lease: Duration,
    ) -> Result<Settled> {
        self.run_call(at_work, others, Some(lease)).await
    }

    /// [`settle_run`](Self::settle_run), or with `next` set
    /// [`read_ahead`](Self::read_ahead) (resent unchanged while no answer
    /// comes: its record answers a resend).
    async fn run_call(
        &self,
        at_work: &ClaimToken,
        others: RunArgs<'_>,
        next: Option<Duration>,
    ) -> Result<Settled> {
        let Some(held) = at_work.held.as_ref() else {
            return Ok(Settled::Done);
        };
        let attempted = || format!("settling the run of keyed message `{}`", at_work.id);
        let publish = detect_publish(&self.state.publish, self.conn)
            .await
            .map_err(Error::redis(attempted()))?;
        let member = (at_work.id.as_str(), at_work.claim, at_work.failures);
        let outcome = if next.is_some() {
            Outcome::Ahead
        } else {
            Outcome::Return
        };
        let next_token = Token::random();
        let (mut cmd, _, _) = self.done_call(held, member, outcome, (next, &next_token), publish);
        cmd.arg(others.max);
        others.add_to(&mut cmd, &held.key);
        let completed = self.completed_of(held, others.handled).await?;
        let (status, acked, nexts, flags) = self.send_done(&cmd, next, attempted).await?;
        let claim = (at_work.claim, next_token);
        let (_, settled) = (self.settled(held, claim, (status, acked, nexts), attempted)).await?;
        if settled != Settled::Lost && (self.recording.events.is_some() || !completed.is_empty()) {
            let mut log = Log::default();
            log.handled(held, others.handled, flags.as_deref(), completed);
            if let Settled::Next(turns) = &settled {
                for turn in turns {
                    let next = (turn.id.as_str(), attempt_of(&turn.record));
                    log.event(EventKind::Claimed, &held.key, next);
                }
            }
            self.record(log).await;
        }
        Ok(settled)
    }

    /// Runs the done script's call `cmd`. One that claims (`next`, the
    /// lease of what it claims) is resent unchanged while no answer comes:
    /// the script's record answers a resend with what the first call
    /// claimed (see `lua/keyed_done.lua`).
    async fn send_done(
        &self,
        cmd: &Cmd,
        next: Option<Duration>,
        attempted: impl Fn() -> String + Copy,
    ) -> Result<DoneReply> {
        let Some(lease) = next else {
            return self.run(&DONE, cmd, attempted).await;
        };
        let send = || async { run(&DONE, cmd, &mut self.conn.clone()).await };
        let window = crate::script::resend_window(lease);
        (crate::script::resending(window, send).await).map_err(Error::redis(attempted()))
    }

    /// The done script's call (see [`done`](Self::done)), with the event
    /// and the error it records.
    fn done_call<'o>(
        &self,
        held: &Held,
        (id, claim, failures): (&str, u64, u32),
        outcome: Outcome<'o>,
        (next, next_token): (Option<Duration>, &Token),
        publish: &str,
    ) -> (Cmd, EventKind, &'o str) {
        let mut cmd = held.partition.call(&DONE, 5);
        let lock = held.lock_key(&self.keys.prefix);
        cmd.arg(&lock).arg(format!("{lock}:waiters"));
        match held.permits {
            0 => cmd.arg(&lock),
            _ => cmd.arg(format!("{lock}:fences")),
        };
        cmd.arg(keys::rate_key(&self.keys.prefix, &held.key));
        cmd.arg(held.partition.record_of(next_token));
        let (op, kind, delay, error) = match outcome {
            Outcome::Ack => ("ack", EventKind::Done, None, ""),
            Outcome::Retry { delay, error } => ("retry", EventKind::Retried, Some(delay), error),
            Outcome::Defer { delay } => ("defer", EventKind::Deferred, Some(delay), ""),
            Outcome::Release => ("release", EventKind::Released, None, ""),
            Outcome::Bury { error } => ("bury", EventKind::Dead, None, error),
            Outcome::Return => ("return", EventKind::Released, None, ""),
            Outcome::Ahead => ("ahead", EventKind::Claimed, None, ""),
        };
        let (dead_count, dead_age) = self.recording.dead.args();
        let flag = |on: bool| if on { "1" } else { "" };
        let ms = |d: Option<Duration>| d.map_or(String::new(), |d| millis(d).to_string());
        cmd.arg(op)
            .arg(&held.key)
            .arg(stored_id(&held.key, id))
            .arg(&held.seq)
            .arg(claim)
            .arg(held.token.as_str())
            .arg(ms(delay))
            .arg(error)
            .arg(publish)
            .arg(ms(next))
            .arg(next_token.as_str())
            .arg(flag(failures > 0))
            .arg(held.permits)
            .arg(millis(crate::lock::HANDOFF))
            .arg(flag(held.rated))
            .arg(flag(self.recording.completed.is_some()))
            .arg(dead_count)
            .arg(dead_age)
            .arg(ms(next.map(crate::script::resend_window)));
        (cmd, kind, error)
    }

    /// What the done script answered: the acknowledged record (if asked),
    /// and how the turn ended, the next one claimed with `next_token`.
    async fn settled(
        &self,
        held: &Arc<Held>,
        (claim, next_token): (u64, Token),
        (status, acked, next): (u8, Vec<u8>, Next),
        attempted: impl Fn() -> String + Copy,
    ) -> Result<(Vec<u8>, Settled)> {
        let settled = match (status, next) {
            (0, None) => {
                // Most often a resend whose first attempt ran (its reply
                // lost): that one let the key go, and its mark of the
                // partition never came. Marked here, at worst in vain.
                self.mark_after(held.partition.slot).await;
                Settled::Lost
            }
            (1, None) => Settled::Done,
            (2, None) => {
                // The key is ready for the next claim, whoever makes it.
                self.mark_after(held.partition.slot).await;
                Settled::Done
            }
            (3, Some((renewed, nexts))) if !nexts.is_empty() => {
                // The lock passed on as it was, or under the new token.
                let token = if renewed == 1 { next_token } else { held.token };
                let turns = nexts
                    .into_iter()
                    .zip(1..)
                    .map(|((stored, seq, record), n)| {
                        let held = Held {
                            key: held.key.clone(),
                            token,
                            partition: held.partition.clone(),
                            run: held.run.saturating_add(n),
                            seq,
                            ..**held
                        };
                        Turn {
                            id: own_id(&held.key, &stored),
                            held: Arc::new(held),
                            claim,
                            record,
                        }
                    });
                Settled::Next(turns.collect())
            }
            other => return Err(Error::reply(attempted(), format_args!("{other:?}"))),
        };
        Ok((acked, settled))
    }
}

/// The events (and completed entry) of a turn that ended with `kind`: its
/// own, then the key let go or its next message claimed. `acked`: the
/// acknowledged record, when the completed stream keeps it.
fn outcome_log(
    held: &Held,
    (id, failures): (&str, u32),
    (kind, error): (EventKind, &str),
    (acked, settled): (Vec<u8>, &Settled),
) -> Log {
    let mut log = Log::default();
    if *settled == Settled::Lost {
        return log;
    }
    let attempt = failures.saturating_add(1);
    let key = held.key.as_str();
    log.with_error(kind, key, error, (id, attempt));
    if !acked.is_empty() {
        log.completed.push((id.to_owned(), acked));
    }
    match settled {
        Settled::Next(turns) => {
            for turn in turns {
                let next = (turn.id.as_str(), attempt_of(&turn.record));
                log.event(EventKind::Claimed, key, next);
            }
        }
        _ => log.event(EventKind::KeyReleased, key, (id, attempt)),
    }
    log
}
