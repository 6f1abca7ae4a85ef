//! The end of a keyed message's turn at work (`lua/keyed_done.lua`): an
//! acknowledgement, which may hand the key over to its next messages, a
//! retry, a deferral, a release or a burial; and the rest of a run
//! settled, or read ahead, while one of its messages goes on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use redis::Cmd;
use redis::aio::ConnectionLike;

use super::{
    DONE, DoneReply, Held, Keyed, Layout, Log, Next, Outcome, RunArgs, Settled, Turn, attempt_of,
    millis, own_id, stored_id,
};
use crate::error::{Error, Result};
use crate::keys::rate_key;
use crate::lock::{Token, detect_publish};
use crate::queue::{ClaimToken, EventKind};
use crate::script::{Program, run};

/// A keyed message's turn to end in a done script's call (see
/// [`Keyed::done_many`]): its hold, its id, claim and failed attempts
/// before this one, how it ends, and the rest of its run. With `next` set
/// (an ack), the key's next messages (up to `run.max`) are claimed at once
/// under the same lock, leased for `next`.
pub(crate) struct Ending<'a> {
    pub(crate) held: &'a Arc<Held>,
    pub(crate) member: (&'a str, u64, u32),
    pub(crate) outcome: Outcome<'a>,
    pub(crate) next: Option<Duration>,
    pub(crate) run: RunArgs<'a>,
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// Ends a turn with `outcome`, and settles the rest of its run as
    /// `run` says. For an ack with `next` set, the key's next messages (up
    /// to `run.max`) are claimed at once under the same lock, leased for
    /// `next`. `failures`: the message's failed attempts before this one.
    pub(crate) async fn done(
        &self,
        held: &Arc<Held>,
        member: (&str, u64, u32),
        outcome: Outcome<'_>,
        (next, run): (Option<Duration>, RunArgs<'_>),
    ) -> Result<Settled> {
        let ending = Ending {
            held,
            member,
            outcome,
            next,
            run,
        };
        let calls = self.done_many(&[ending]).await?;
        let attempted = || format!("settling keyed message `{}`", member.0);
        let settled = calls.into_iter().next().map(|(_, settled)| settled);
        let settled = settled.ok_or_else(|| Error::reply(attempted(), "no call"))??;
        (settled.into_iter().next()).ok_or_else(|| Error::reply(attempted(), "no reply"))?
    }

    /// Ends several turns, each as [`done`](Self::done) ends one: the
    /// acknowledgements that claim the key's next messages in one script
    /// call (on a Redis Cluster, one per partition), every other ending in
    /// a call of its own (only a call that claims keeps the record that
    /// answers a resend, see `lua/keyed_done.lua`). Answers per call: the
    /// indexes of its endings, and their settlements in that order (each
    /// one's, or the error its block met), or the call's error.
    pub(crate) async fn done_many(&self, endings: &[Ending<'_>]) -> Result<Calls> {
        let describe = |n: usize| match endings {
            [one] => format!("settling keyed message `{}`", one.member.0),
            _ => format!("settling {n} keyed messages"),
        };
        let publish = detect_publish(&self.state.publish, self.conn)
            .await
            .map_err(Error::redis(describe(endings.len())))?;
        let cluster = self.layout().await? == Layout::Cluster;
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut joined: HashMap<u16, usize> = HashMap::new();
        for (n, ending) in endings.iter().enumerate() {
            let slot = if cluster {
                ending.held.partition.slot
            } else {
                0
            };
            match ending.next.and(joined.get(&slot)) {
                Some(&group) => groups[group].push(n),
                None => {
                    if ending.next.is_some() {
                        joined.insert(slot, groups.len());
                    }
                    groups.push(vec![n]);
                }
            }
        }
        let calls = groups.iter().map(|group| {
            let endings: Vec<&Ending<'_>> = group.iter().map(|&n| &endings[n]).collect();
            self.done_call(endings, publish, describe)
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut marks = Vec::new();
        let mut calls = Vec::with_capacity(groups.len());
        for (group, answer) in groups.into_iter().zip(answers) {
            let settled = answer.map(|answer| {
                let settled = answer.into_iter().map(|one| {
                    one.map(|(settled, mark)| {
                        marks.extend(mark);
                        settled
                    })
                });
                settled.collect()
            });
            calls.push((group, settled));
        }
        if !marks.is_empty() {
            marks.sort_unstable();
            marks.dedup();
            self.mark_all_after(&marks).await;
        }
        Ok(calls)
    }

    /// Ends `endings` in one call (see [`done_many`](Self::done_many)):
    /// each one's answer, and the partition to mark ready after it, if
    /// any; or the error its block met.
    async fn done_call(
        &self,
        endings: Vec<&Ending<'_>>,
        publish: &str,
        describe: impl Fn(usize) -> String + Copy,
    ) -> Result<Vec<Result<(Settled, Option<u16>)>>> {
        let attempted = || describe(endings.len());
        let tokens: Vec<Token> = endings.iter().map(|_| Token::random()).collect();
        let blocks: Vec<Block> = (endings.iter().zip(&tokens))
            .map(|(ending, next_token)| self.done_block(ending, next_token, publish))
            .collect();
        let completed =
            (endings.iter()).map(|ending| self.completed_of(ending.held, ending.run.handled));
        let completed = futures_util::future::try_join_all(completed).await?;
        let cmd = call_of(&blocks);
        // Resent while no answer comes only when every block claims (each
        // keeps the record that answers a resend): within the shortest
        // lease's window.
        let resend = endings.iter().map(|ending| ending.next).min().flatten();
        let replies = self.send_done(&cmd, resend, attempted).await;
        self.changed(endings.iter().map(|ending| ending.held.partition.slot));
        let replies: Vec<DoneReply> = replies?;
        if replies.len() != endings.len() {
            return Err(Error::reply(
                attempted(),
                format_args!("{} replies", replies.len()),
            ));
        }
        let mut answers = Vec::with_capacity(endings.len());
        let mut log = Log::default();
        let parts = endings.iter().zip(tokens).zip(completed);
        for (((ending, next_token), completed), reply) in parts.zip(replies) {
            answers.push(self.ended(ending, next_token, completed, reply, &mut log, attempted));
        }
        // Every block's events in one write.
        self.record(log).await;
        Ok(answers)
    }

    /// What a block's `reply` says of `ending` (see
    /// [`settled`](Self::settled)), its events added to `log`: the turn's
    /// settlement, and the partition to mark ready after it, if any.
    fn ended(
        &self,
        ending: &Ending<'_>,
        next_token: Token,
        completed: Vec<(String, Vec<u8>)>,
        (status, acked, nexts, flags): DoneReply,
        log: &mut Log,
        attempted: impl Fn() -> String + Copy,
    ) -> Result<(Settled, Option<u16>)> {
        let (id, claim, failures) = ending.member;
        let held = ending.held;
        let reply = (status, acked, nexts);
        let (acked, settled, mark) = self.settled(held, (claim, next_token), reply, attempted)?;
        // Nothing to build on the hot path unless something is recorded.
        if self.recording.events.is_none() && acked.is_empty() && completed.is_empty() {
            return Ok((settled, mark));
        }
        if settled != Settled::Lost {
            log.handled(held, ending.run.handled, flags.as_deref(), completed);
        }
        match (ending.outcome, &settled) {
            // The run's rest settled while a message goes on: the messages
            // read ahead are its only events.
            (Outcome::Return | Outcome::Ahead, Settled::Next(turns)) => {
                for turn in turns {
                    let next = (turn.id.as_str(), attempt_of(&turn.record));
                    log.event(EventKind::Claimed, &held.key, next);
                }
            }
            (Outcome::Return | Outcome::Ahead, _) => {}
            (outcome, _) => {
                let ended = (acked, &settled);
                log.append(outcome_log(held, (id, failures), outcome, ended));
            }
        }
        Ok((settled, mark))
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
        run: RunArgs<'_>,
        next: Option<Duration>,
    ) -> Result<Settled> {
        let Some(held) = at_work.held.as_ref() else {
            return Ok(Settled::Done);
        };
        let outcome = match next {
            Some(_) => Outcome::Ahead,
            None => Outcome::Return,
        };
        let member = (at_work.id.as_str(), at_work.claim, at_work.failures);
        self.done(held, member, outcome, (next, run)).await
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
    ) -> Result<Vec<DoneReply>> {
        let Some(lease) = next else {
            return self.run(&DONE, cmd, attempted).await;
        };
        let send = || async { run(&DONE, cmd, &mut self.conn.clone()).await };
        let window = crate::script::resend_window(lease);
        (crate::script::resending(window, send).await).map_err(Error::redis(attempted()))
    }

    /// `ending`'s block of a done script's call, the key's next messages
    /// (if it claims any) to be held under `next_token`.
    fn done_block(&self, ending: &Ending<'_>, next_token: &Token, publish: &str) -> Block {
        let (held, (id, claim, failures)) = (ending.held, ending.member);
        let lock = held.lock_key(&self.keys.prefix);
        let fences = match held.permits {
            0 => lock.clone(),
            _ => format!("{lock}:fences"),
        };
        let (waiters, rate) = (
            format!("{lock}:waiters"),
            rate_key(&self.keys.prefix, &held.key),
        );
        let mut keys = held.partition.keys.to_vec();
        let record = held.partition.record_of(next_token);
        keys.extend([lock, waiters, fences, rate, record]);
        let (op, delay) = match ending.outcome {
            Outcome::Ack => ("ack", None),
            Outcome::Retry { delay, .. } => ("retry", Some(delay)),
            Outcome::Defer { delay } => ("defer", Some(delay)),
            Outcome::Release => ("release", None),
            Outcome::Bury { .. } => ("bury", None),
            Outcome::Return => ("return", None),
            Outcome::Ahead => ("ahead", None),
        };
        let (_, error) = event_of(ending.outcome);
        let (dead_count, dead_age) = self.recording.dead.args();
        let flag = |on: bool| String::from(if on { "1" } else { "" });
        let ms = |d: Option<Duration>| d.map_or(String::new(), |d| millis(d).to_string());
        let next = ending.next;
        let mut args = vec![
            op.to_owned(),
            held.key.clone(),
            stored_id(&held.key, id),
            held.seq.clone(),
            claim.to_string(),
            held.token.as_str().to_owned(),
            ms(delay),
            error.to_owned(),
            publish.to_owned(),
            ms(next),
            next_token.as_str().to_owned(),
            flag(failures > 0),
            held.permits.to_string(),
            millis(crate::lock::HANDOFF).to_string(),
            flag(held.rated),
            flag(self.recording.completed.is_some()),
            dead_count,
            dead_age,
            ms(next.map(crate::script::resend_window)),
            ending.run.max.to_string(),
        ];
        ending.run.add_to(&mut args, &held.key);
        Block { keys, args }
    }

    /// What the done script answered for a block: the acknowledged record
    /// (if asked), how the turn ended (the next one claimed with
    /// `next_token`), and the partition to mark ready after it, if any.
    fn settled(
        &self,
        held: &Arc<Held>,
        (claim, next_token): (u64, Token),
        (status, acked, next): (u8, Vec<u8>, Next),
        attempted: impl Fn() -> String + Copy,
    ) -> Result<(Vec<u8>, Settled, Option<u16>)> {
        if status == BLOCK_FAILED {
            let error = String::from_utf8_lossy(&acked);
            return Err(Error::reply(
                attempted(),
                format_args!("the script failed: {error}"),
            ));
        }
        let mut mark = None;
        let settled = match (status, next) {
            (0, None) => {
                // Most often a resend whose first attempt ran (its reply
                // lost): that one let the key go, and its mark of the
                // partition never came. Marked after, at worst in vain.
                mark = Some(held.partition.slot);
                Settled::Lost
            }
            (1, None) => Settled::Done,
            (2, None) => {
                // The key is ready for the next claim, whoever makes it.
                mark = Some(held.partition.slot);
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
        Ok((acked, settled, mark))
    }
}

/// The status of a block whose settlement failed in the script (its error
/// in place of the acknowledged record), see `lua/keyed_done.lua`.
const BLOCK_FAILED: u8 = 255;

/// [`Keyed::done_many`]'s answer: per call, the indexes of its endings
/// and their settlements (or the error each one's block met), or the
/// call's error.
pub(crate) type Calls = Vec<(Vec<usize>, Result<Vec<Result<Settled>>>)>;

/// One block of a done script's call: its keys (the partition's, then its
/// own) and its arguments.
struct Block {
    keys: Vec<String>,
    args: Vec<String>,
}

/// The done script's call of `blocks` (see `lua/keyed_done.lua`): every
/// block's keys, then per block its arguments' count and its arguments.
fn call_of(blocks: &[Block]) -> Cmd {
    let keys: usize = blocks.iter().map(|block| block.keys.len()).sum();
    let mut cmd = DONE.call(keys);
    for block in blocks {
        cmd.arg(&block.keys[..]);
    }
    for block in blocks {
        cmd.arg(block.args.len()).arg(&block.args[..]);
    }
    cmd
}

/// The event a turn that ends with `outcome` records, and its error.
fn event_of(outcome: Outcome<'_>) -> (EventKind, &str) {
    match outcome {
        Outcome::Ack => (EventKind::Done, ""),
        Outcome::Retry { error, .. } => (EventKind::Retried, error),
        Outcome::Defer { .. } => (EventKind::Deferred, ""),
        Outcome::Release => (EventKind::Released, ""),
        Outcome::Bury { error } => (EventKind::Dead, error),
        Outcome::Return => (EventKind::Released, ""),
        Outcome::Ahead => (EventKind::Claimed, ""),
    }
}

/// The events (and completed entry) of a turn that ended with `outcome`: its
/// own, then the key let go or its next message claimed. `acked`: the
/// acknowledged record, when the completed stream keeps it.
fn outcome_log(
    held: &Held,
    (id, failures): (&str, u32),
    outcome: Outcome<'_>,
    (acked, settled): (Vec<u8>, &Settled),
) -> Log {
    let (kind, error) = event_of(outcome);
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
