//! Claiming keyed messages: the partitions a claim visits are asked at
//! once, each for its share of the batch, each key's head taken with its
//! lock or a permit (`lua/keyed_claim.lua`), and the index settled after.

use std::sync::Arc;
use std::time::Duration;

use redis::Cmd;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::{
    CLAIM, CLAIMING_MS, Claimed, Held, Holds, INDEX_SETTLE, Keyed, Log, Partition, READY,
    RECHECK_MS, Taken, Turn, attempt_of, lock, millis, opened, own_id, shares,
};
use crate::error::{Error, Result};
use crate::keys::{self, SLOTS};
use crate::lock::Token;
use crate::queue::EventKind;
use crate::queue::scripts::Query;
use crate::script::{evalsha, run, run_after};

/// How many ready keys a claim of up to `max` turns in a partition names
/// for its next call.
fn names_for(max: usize) -> usize {
    (2 * max).max(16)
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// Claims up to `max` heads of ready keys' lines across the partitions
    /// `slots` (named by the queue's claim as due at the server's `now`),
    /// each with its key's lock for `lease`. The partitions' index entries
    /// are raised [`CLAIMING_MS`] ahead before the claims and settled after
    /// them, in one round trip: lowered to what each claim saw; where
    /// nothing waits, left raised while a message is at work (the end of
    /// its turn marks the partition, but a turn whose reply was lost never
    /// does: the raise expires instead), else looked at again after
    /// [`RECHECK_MS`], or, with no message at all, out of the index; each
    /// only if a push did not lower it meanwhile (`lua/index_settle.lua`).
    pub(crate) async fn claim(
        &self,
        slots: &[u16],
        now: i64,
        max: usize,
        lease: Duration,
    ) -> Result<Claimed> {
        let slots: Vec<u16> = slots.iter().copied().filter(|s| *s < SLOTS).collect();
        if slots.is_empty() {
            return Ok(Claimed::default());
        }
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        let raised_to = now + CLAIMING_MS;
        let raise = self.index(&["XX"], slots.iter().map(|slot| (raised_to, *slot)));
        // On one server the raise rides with the first claim (a pipeline
        // keeps their order); on a cluster the index is on another node.
        let first = match self.is_cluster().await? {
            true => {
                raise.query_on::<(), _>(self.conn, attempted).await?;
                None
            }
            false => Some(raise),
        };
        let (seen, claimed, mut failed) = self.claim_shares(&slots, (now, max, lease), first).await;
        let (mut lowered, mut idle) = (Vec::new(), Vec::new());
        for (slot, saw) in seen {
            // A partition not visited (or not claimed) is due as it was.
            match saw {
                (Some(at), _) => lowered.push((at.max(0), slot)),
                (None, Holds::AtWork) => {}
                (None, holds) => idle.push((slot, holds == Holds::Nothing)),
            }
        }
        if let Err(error) = self.settle_index(lowered, idle, raised_to).await {
            failed.get_or_insert(error);
        }
        match failed {
            Some(error) if claimed.turns.is_empty() => Err(error),
            Some(error) => {
                // The turns taken hold their keys' locks: they must reach
                // the caller.
                tracing::warn!(queue = %self.keys.name, %error, "a keyed partition could not be claimed from; returning what the others gave");
                Ok(claimed)
            }
            None => Ok(claimed),
        }
    }

    /// Claims up to `max` turns in `slots`: each partition its share, all at
    /// once; those that filled theirs (they may hold more) share what room
    /// is left, once. Returns per slot what its claim saw (due as it was
    /// when not visited), the turns taken, and the first error.
    async fn claim_shares(
        &self,
        slots: &[u16],
        (now, max, lease): (i64, usize, Duration),
        mut first: Option<Cmd>,
    ) -> (Vec<(u16, (Option<i64>, Holds))>, Claimed, Option<Error>) {
        let mut seen: Vec<(u16, (Option<i64>, Holds))> = slots
            .iter()
            .map(|slot| (*slot, (Some(now), Holds::AtWork)))
            .collect();
        let (mut claimed, mut failed) = (Claimed::default(), None);
        let mut visits: Vec<(usize, usize)> =
            (0..seen.len()).zip(shares(max, seen.len())).collect();
        for _wave in 0..2 {
            visits.retain(|(_, share)| *share > 0);
            let wave = visits.iter().map(|(i, share)| (seen[*i].0, *share));
            let results = (self.claim_wave(wave.collect(), (now, lease), first.take())).await;
            let mut full = Vec::new();
            for ((i, share), (result, took)) in visits.iter().zip(results) {
                match result {
                    Ok(saw) => seen[*i].1 = saw,
                    Err(error) => {
                        failed.get_or_insert(error);
                    }
                }
                if took.turns.len() == *share {
                    full.push(*i);
                }
                claimed.absorb(took);
            }
            let room = max - claimed.turns.len();
            if failed.is_some() || room == 0 || full.is_empty() {
                break;
            }
            let shares = shares(room, full.len());
            visits = full.into_iter().zip(shares).collect();
        }
        (seen, claimed, failed)
    }

    /// Settles the index entries of the partitions a claim visited, raised
    /// to `raised_to`: `lowered` (score, slot) to what the claim saw; the
    /// `idle` ones (slot, whether it held no message at all), where
    /// nothing waits, as `lua/index_settle.lua` says. One script call (no
    /// pipeline: on a cluster, a script alone is the plainest request).
    async fn settle_index(
        &self,
        lowered: Vec<(i64, u16)>,
        idle: Vec<(u16, bool)>,
        raised_to: i64,
    ) -> Result<()> {
        if lowered.is_empty() && idle.is_empty() {
            return Ok(());
        }
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        let mut cmd = evalsha(&INDEX_SETTLE, 1);
        let recheck = raised_to - CLAIMING_MS + RECHECK_MS;
        cmd.arg(&self.keys.partitions).arg(raised_to).arg(recheck);
        for (at, slot) in lowered {
            cmd.arg(slot).arg(at);
        }
        for (slot, empty) in idle {
            cmd.arg(slot).arg(if empty { "empty" } else { "idle" });
        }
        self.run::<i64>(&INDEX_SETTLE, &cmd, attempted)
            .await
            .map(drop)
    }

    /// Claims in one partition, and brings `claimed.next_at` forward to
    /// when it has a key or a delayed message due next (server ms); returns
    /// what its index entry is to be lowered to (none: nothing waits
    /// there), and what it holds. (`first` goes in the same round trip as
    /// its first request.) A partition without candidates named by its
    /// last claim has its ready keys read first, in one command; only when
    /// none is ready (a delayed message may be due) does a claim call
    /// without candidates look, and name them.
    async fn claim_in(
        &self,
        slot: u16,
        (now, share, lease): (i64, usize, Duration),
        mut first: Option<Cmd>,
        claimed: &mut Claimed,
    ) -> Result<(Option<i64>, Holds)> {
        let partition = self.partition(slot).await?;
        let mut candidates = lock(&self.state.candidates)
            .remove(&slot)
            .unwrap_or_default();
        if candidates.is_empty() {
            let most = names_for(share);
            candidates = (self.ready_keys(&partition, now, most, first.take())).await?;
        }
        let limits = (share, lease);
        let mut reply = (self.claim_keys(&partition, &candidates, limits, first)).await?;
        if candidates.is_empty() && !reply.2.is_empty() {
            // A claim call that found none ready named those it made
            // ready (due delayed messages): claim them.
            candidates = std::mem::take(&mut reply.2);
            reply = (self.claim_keys(&partition, &candidates, limits, None)).await?;
        }
        let (turns, next_at, named, holds) = reply;
        claimed.turns.extend(turns);
        // Keys named for the next call are due now: the worker claims
        // again at once rather than sleeping.
        let lower_to = if named.is_empty() {
            lock(&self.state.candidates).remove(&slot);
            next_at
        } else {
            lock(&self.state.candidates).insert(slot, named);
            Some(0)
        };
        claimed.due_next(lower_to);
        Ok((lower_to, holds))
    }

    /// Up to `most` keys of `partition` ready at `now` (server ms), as a
    /// claim call names them, read in one command (after `first`, in the
    /// same round trip). The claim that takes them checks each again.
    async fn ready_keys(
        &self,
        partition: &Partition,
        now: i64,
        most: usize,
        first: Option<Cmd>,
    ) -> Result<Vec<String>> {
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        let mut pipe = redis::pipe();
        if let Some(first) = first {
            pipe.add_command(first).ignore();
        }
        let most = isize::try_from(most).unwrap_or(isize::MAX);
        pipe.zrangebyscore_limit(&partition.keys[READY], 0, now, 0, most);
        let (keys,): (Vec<String>,) =
            (pipe.query_async(&mut self.conn.clone()).await).map_err(Error::redis(attempted()))?;
        Ok(keys)
    }

    /// Claims up to `share` turns in each partition of `visits` (slot,
    /// share), all at once (`first`, the index's raise, rides with the
    /// first); per visit, what its claim saw (or its error) and what it
    /// took.
    async fn claim_wave(
        &self,
        visits: Vec<(u16, usize)>,
        (now, lease): (i64, Duration),
        mut first: Option<Cmd>,
    ) -> Vec<(Result<(Option<i64>, Holds)>, Claimed)> {
        let each = visits.into_iter().map(|(slot, share)| {
            let first = first.take();
            async move {
                let mut took = Claimed::default();
                let saw = (self.claim_in(slot, (now, share, lease), first, &mut took)).await;
                (saw, took)
            }
        });
        futures_util::future::join_all(each).await
    }

    /// A `ZADD` with `flags` of each (score, slot) to the queue's index of
    /// partitions.
    fn index(&self, flags: &[&str], entries: impl IntoIterator<Item = (i64, u16)>) -> Cmd {
        let mut cmd = redis::cmd("ZADD");
        cmd.arg(&self.keys.partitions).arg(flags);
        for (at, slot) in entries {
            cmd.arg(at).arg(slot);
        }
        cmd
    }

    /// Makes `key` ready when other code lets go of its lock, or of one of
    /// its permits (`lock_key`: the lock or the permits' set; the release
    /// publishes, as the claim marked it waited for): listened for in a
    /// task of its own, which ends at that release or at the first lease's
    /// expiry, when the key is ready anyway. Without a listener, the key
    /// waits for the expiry.
    fn watch_release(&self, key: String, lock_key: String, left: Duration) {
        let Some(auto) = self.state.listener.get().cloned() else {
            return;
        };
        if !lock(&self.state.watched).insert(key.clone()) {
            return;
        }
        let (conn, keys, state) = (self.conn.clone(), self.keys.clone(), self.state.clone());
        let recording = self.recording;
        tokio::spawn(async move {
            let keyed = Keyed {
                conn: &conn,
                keys: &keys,
                state: &state,
                recording,
            };
            let until = Instant::now() + left;
            if let Some(listener) = opened(&auto, until).await {
                let mut watch = listener.watch(&lock_key, crate::lock::process_tag());
                if watch.ready(Some(until)).await {
                    // A release before the subscription was heard by
                    // nobody: look once now, then at each release.
                    let _ = keyed.unblock(&key).await;
                    let _ = tokio::time::timeout_at(until, watch.woken()).await;
                }
            }
            let _ = keyed.unblock(&key).await;
            lock(&state.watched).remove(&key);
        });
    }

    /// One claim script call (after `first`, in the same round trip): the
    /// turns, the next due time, the ready keys named for the next call,
    /// and what the partition holds.
    async fn claim_keys(
        &self,
        partition: &Arc<Partition>,
        candidates: &[String],
        (max, lease): (usize, Duration),
        first: Option<Cmd>,
    ) -> Result<(Vec<Turn>, Option<i64>, Vec<String>, Holds)> {
        let prefix = &self.keys.prefix;
        let mut cmd = partition.call(&CLAIM, 4 * candidates.len() + 1);
        for key in candidates {
            let set = crate::lock::permits::permits_key(prefix, key);
            cmd.arg(keys::lock_key(prefix, key))
                .arg(&set)
                .arg(format!("{set}:waiters"))
                .arg(keys::rate_key(prefix, key));
        }
        let window = crate::script::resend_window(lease);
        cmd.arg(partition.record());
        cmd.arg(millis(lease)).arg(max).arg(names_for(max));
        cmd.arg(millis(window));
        let tokens: Vec<Token> = candidates.iter().map(|_| Token::random()).collect();
        for (key, token) in candidates.iter().zip(&tokens) {
            cmd.arg(key).arg(token.as_str());
        }
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        type Reply = (
            u64,
            i64,
            Vec<String>,
            Vec<Taken>,
            Vec<(String, String, u64)>,
            u8,
        );
        // Resent unchanged while no answer comes: the script's record of
        // its first run answers a resend (see `lua/keyed_claim.lua`).
        let reply: Reply = match &first {
            Some(first) => {
                let send =
                    || async { run_after(&CLAIM, first, &cmd, &mut self.conn.clone()).await };
                crate::script::resending(window, send).await
            }
            None => {
                let send = || async { run(&CLAIM, &cmd, &mut self.conn.clone()).await };
                crate::script::resending(window, send).await
            }
        }
        .map_err(Error::redis(attempted()))?;
        let (claim, next_at, named, taken, blocked, holds) = reply;
        for (key, watched, left) in blocked {
            self.watch_release(key, watched, Duration::from_millis(left));
        }
        let turns = self.turns(partition, (candidates, &tokens), claim, taken);
        if self.recording.events.is_some() {
            let mut log = Log::default();
            for turn in &turns {
                let attempt = attempt_of(&turn.record);
                log.event(EventKind::Claimed, &turn.held.key, (&turn.id, attempt));
            }
            self.record(log).await;
        }
        let holds = match holds {
            0 => Holds::Nothing,
            1 => Holds::AtWork,
            _ => Holds::Waiting,
        };
        Ok((turns, (next_at >= 0).then_some(next_at), named, holds))
    }

    /// The turns a claim script took; each key is one of `candidates`,
    /// claimed with its token in `tokens`.
    fn turns(
        &self,
        partition: &Arc<Partition>,
        (candidates, tokens): (&[String], &[Token]),
        claim: u64,
        taken: Vec<Taken>,
    ) -> Vec<Turn> {
        let text = |bytes: Vec<u8>| String::from_utf8(bytes).ok();
        let mut turns = Vec::with_capacity(taken.len());
        for (key, id, seq, permits, rated, record) in taken {
            let found = candidates.iter().position(|k| k.as_bytes() == key);
            let (Some(i), Some(stored), Some(seq)) = (found, text(id), text(seq)) else {
                // Cannot happen with lockgate's script; if it does, the
                // entry comes back after its lease.
                tracing::error!(queue = %self.keys.name, "keyed claim returned a malformed entry");
                continue;
            };
            let held = Held {
                key: candidates[i].clone(),
                token: tokens[i],
                permits,
                rated,
                partition: partition.clone(),
                run: 0,
                seq,
            };
            turns.push(Turn {
                id: own_id(&candidates[i], &stored),
                held: Arc::new(held),
                claim,
                record,
            });
        }
        turns
    }
}
