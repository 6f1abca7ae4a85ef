//! Claiming keyed messages: the partitions a claim visits are asked at
//! once, each for its share of the batch, each key's head taken with its
//! lock or a permit (`lua/keyed_claim.lua`), and the index settled after.

use std::sync::Arc;
use std::time::Duration;

use redis::Cmd;
use redis::aio::ConnectionLike;
use tokio::time::Instant;

use super::{
    CLAIM, CLAIMING_MS, Claimed, Held, Holds, INDEX_SETTLE, Keyed, Log, MORE, Partition, READY,
    RECHECK_MS, Taken, Turn, attempt_of, lock, millis, opened, own_id, shares,
};
use crate::error::{Error, Result};
use crate::keys::{self, SLOTS};
use crate::lock::Token;
use crate::queue::EventKind;
use crate::queue::scripts::Query;
use crate::script::{Program, run, run_after};

/// One block's answer of the claim script (see `lua/keyed_claim.lua`):
/// its claim number, when it has a key or a delayed message due next
/// (-1: none), the ready keys it names for the next call, the turns, the
/// keys other code keeps full (key, the lock or set to watch, ms until its
/// first lease ends), what the partition holds (0, 1, 2), the keys whose
/// claim a command refused (key, the error).
type Reply = (
    u64,
    i64,
    Vec<String>,
    Vec<Taken>,
    Vec<(String, String, u64)>,
    u8,
    Vec<(String, String)>,
);

/// What a claim call saw in a partition.
struct Answer {
    /// When it has a key or a delayed message due next (server ms).
    next_at: Option<i64>,
    /// The ready keys it names for the next call.
    named: Vec<String>,
    holds: Holds,
}

/// One partition's part of a claim call: its partition, its share of the
/// batch, its candidate keys and a fresh token for each.
struct Block {
    partition: Arc<Partition>,
    share: usize,
    candidates: Vec<String>,
    tokens: Vec<Token>,
}

impl Block {
    fn new_in(partition: Arc<Partition>, share: usize, candidates: Vec<String>) -> Self {
        let tokens = candidates.iter().map(|_| Token::random()).collect();
        Self {
            partition,
            share,
            candidates,
            tokens,
        }
    }

    /// `block`'s partition and share, with `candidates`.
    fn new(block: &Block, candidates: Vec<String>) -> Self {
        Self::new_in(block.partition.clone(), block.share, candidates)
    }
}

/// What a claim asks of each turn: its lease, and how many of a key's
/// messages it may take at once (a run, for a key with a lock and no rate
/// limit; 1: its head alone).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    pub(crate) lease: Duration,
    pub(crate) run: u32,
}

/// How many ready keys a claim of up to `max` turns in a partition names
/// for its next call.
fn names_for(max: usize) -> usize {
    (2 * max).max(16)
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Keyed<'_, C> {
    /// Claims up to `max` turns of ready keys across the partitions
    /// `slots` (named by the queue's claim as due at the server's `now`),
    /// each with its key's lock for `terms.lease`: a key's head, or a run
    /// of its first messages (`terms.run`), in line order. The partitions' index entries
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
        terms: Terms,
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
        let cluster = self.is_cluster().await?;
        // On a cluster the scripts cannot reach the queue's leases index
        // (another slot's): the claim lowers the entries of the partitions
        // it visits to the leases it may give, before it gives them and
        // again after (a recovery sweep's settlement of the entry may have
        // come between, see `lua/leases_settle.lua`).
        let leases_until =
            now.saturating_add(i64::try_from(millis(terms.lease)).unwrap_or(i64::MAX));
        let first = match cluster {
            true => {
                let mut pipe = redis::pipe();
                pipe.add_command(raise).ignore();
                pipe.add_command(self.note_leases(&slots, leases_until))
                    .ignore();
                (pipe.query_async::<()>(&mut self.conn.clone()).await)
                    .map_err(Error::redis(attempted()))?;
                None
            }
            false => Some(raise),
        };
        let (seen, claimed, mut failed) =
            (self.claim_shares(&slots, (now, max, terms), (cluster, first))).await;
        // After a claim that took turns, the note rides with the index's
        // settlement (both in the queue's slot).
        let note = (cluster && !claimed.turns.is_empty()).then(|| {
            let mut leased: Vec<u16> = (claimed.turns.iter())
                .map(|turn| turn.held.partition.slot)
                .collect();
            leased.sort_unstable();
            leased.dedup();
            self.note_leases(&leased, leases_until)
        });
        let (mut lowered, mut idle) = (Vec::new(), Vec::new());
        for (slot, saw) in seen {
            // A partition not visited (or not claimed) is due as it was.
            match saw {
                (Some(at), _) => lowered.push((at.max(0), slot)),
                (None, Holds::AtWork) => {}
                (None, holds) => idle.push((slot, holds == Holds::Nothing)),
            }
        }
        if let Err(error) = self.settle_index(lowered, idle, raised_to, note).await {
            failed.get_or_insert(error);
        }
        match failed {
            Some(error) if claimed.turns.is_empty() => Err(error),
            Some(error) => {
                // The turns taken hold their keys' locks: they must reach
                // the caller.
                tracing::warn!(queue = %self.keys.name, %error, "a call of a keyed claim failed (a partition's, or the index's settlement); returning the turns taken");
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
        (now, max, terms): (i64, usize, Terms),
        (cluster, mut first): (bool, Option<Cmd>),
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
            let wave = wave.collect();
            let results = (self.claim_wave(wave, (now, terms), (cluster, first.take()))).await;
            let mut full = Vec::new();
            for ((i, share), (result, took)) in visits.iter().zip(results) {
                match result {
                    Ok(saw) => seen[*i].1 = saw,
                    Err(error) => {
                        failed.get_or_insert(error);
                    }
                }
                if took.turns_taken() == *share {
                    full.push(*i);
                }
                claimed.absorb(took);
            }
            let room = max.saturating_sub(claimed.turns_taken());
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
    /// nothing waits, as `lua/index_settle.lua` says; rings the bell when
    /// one is due at once (others may have looked while the claim hid it,
    /// and wait). One round trip: the script call, after `note` (a
    /// claim's note to the leases index, safe to repeat) when given.
    async fn settle_index(
        &self,
        lowered: Vec<(i64, u16)>,
        idle: Vec<(u16, bool)>,
        raised_to: i64,
        note: Option<Cmd>,
    ) -> Result<()> {
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        if lowered.is_empty() && idle.is_empty() {
            return match note {
                Some(note) => note.query_on::<(), _>(self.conn, attempted).await,
                None => Ok(()),
            };
        }
        let mut cmd = INDEX_SETTLE.call(2);
        let now = raised_to - CLAIMING_MS;
        cmd.arg(&self.keys.partitions).arg(&self.keys.bell);
        cmd.arg(raised_to).arg(now + RECHECK_MS).arg(now);
        for (at, slot) in lowered {
            cmd.arg(slot).arg(at);
        }
        for (slot, empty) in idle {
            cmd.arg(slot).arg(if empty { "empty" } else { "idle" });
        }
        let settled = match &note {
            Some(note) => run_after::<i64>(&INDEX_SETTLE, note, &cmd, &mut self.conn.clone()).await,
            None => run::<i64>(&INDEX_SETTLE, &cmd, &mut self.conn.clone()).await,
        };
        settled.map(drop).map_err(|e| Error::redis(attempted())(e))
    }

    /// Claims up to `share` turns in each partition of `visits` (slot,
    /// share): on one server in one call over them all; on a cluster,
    /// where a script reaches one slot, a call per partition, all at once
    /// (`first`, the index's raise, rides with the first request). Per
    /// visit, what its claim saw (or its error) and what it took.
    async fn claim_wave(
        &self,
        visits: Vec<(u16, usize)>,
        (now, terms): (i64, Terms),
        (cluster, mut first): (bool, Option<Cmd>),
    ) -> Vec<(Result<(Option<i64>, Holds)>, Claimed)> {
        let per_call = if cluster { 1 } else { visits.len().max(1) };
        let calls = visits.chunks(per_call).map(|visits| {
            let first = first.take();
            async move { self.claim_visits(visits, (now, terms), first).await }
        });
        let calls: Vec<_> = calls.collect();
        let results = futures_util::future::join_all(calls).await;
        results.into_iter().flatten().collect()
    }

    /// Claims in the partitions of `visits` in one claim call (all on one
    /// server), and again in those whose first call named keys it made
    /// ready; brings each visit's `next_at` forward to when its partition
    /// has a key or a delayed message due next (server ms). Per visit,
    /// what its index entry is to be lowered to (none: nothing waits
    /// there) and what it holds, or the error of a call (given to the
    /// first visit: the others are left due as they were), and the turns
    /// it took. A partition without candidates named by its last claim has
    /// its ready keys read first, in one command each, all in one round
    /// trip; a claim call without candidates looks (and names them) only
    /// where none is ready (a delayed message may be due).
    async fn claim_visits(
        &self,
        visits: &[(u16, usize)],
        (now, terms): (i64, Terms),
        first: Option<Cmd>,
    ) -> Vec<(Result<(Option<i64>, Holds)>, Claimed)> {
        let mut took: Vec<Claimed> = visits.iter().map(|_| Claimed::default()).collect();
        let failed = |error: Error, took: Vec<Claimed>| {
            let mut error = Some(Err(error));
            let unvisited = || Ok((Some(now), Holds::AtWork));
            let saw = std::iter::from_fn(move || Some(error.take().unwrap_or_else(unvisited)));
            saw.zip(took).collect()
        };
        let (mut blocks, first) = match self.blocks(visits, now, first).await {
            Ok(blocks) => blocks,
            Err(error) => return failed(error, took),
        };
        let mut replies = match self.claim_blocks(&blocks, (terms, first), &mut took).await {
            Ok(replies) => replies,
            Err(error) => return failed(error, took),
        };
        // Where a call without candidates named keys it made ready (due
        // delayed messages), claim them.
        let again: Vec<usize> = (0..blocks.len())
            .filter(|i| blocks[*i].candidates.is_empty() && !replies[*i].named.is_empty())
            .collect();
        if !again.is_empty() {
            let mut more = Vec::with_capacity(again.len());
            for i in &again {
                let named = std::mem::take(&mut replies[*i].named);
                more.push(Block::new(&blocks[*i], named));
            }
            let mut more_took: Vec<Claimed> = more.iter().map(|_| Claimed::default()).collect();
            let result = (self.claim_blocks(&more, (terms, None), &mut more_took)).await;
            for (i, took_again) in again.iter().zip(more_took) {
                took[*i].absorb(took_again);
            }
            match result {
                Ok(more_replies) => {
                    for ((i, reply), block) in again.iter().zip(more_replies).zip(more) {
                        replies[*i] = reply;
                        blocks[*i] = block;
                    }
                }
                Err(error) => return failed(error, took),
            }
        }
        let mut out = Vec::with_capacity(blocks.len());
        for ((block, reply), mut took) in blocks.iter().zip(replies).zip(took) {
            // Keys named for the next call are due now: the worker claims
            // again at once rather than sleeping.
            let lower_to = if reply.named.is_empty() {
                lock(&self.state.candidates).remove(&block.partition.slot);
                reply.next_at
            } else {
                lock(&self.state.candidates).insert(block.partition.slot, reply.named);
                Some(0)
            };
            took.due_next(lower_to);
            out.push((Ok((lower_to, reply.holds)), took));
        }
        out
    }

    /// Each visit's block: its partition, its share, and its candidates:
    /// those its last claim named, else its keys ready at `now` (server
    /// ms), read in one command per partition, all in one round trip
    /// after `first`. The claim that takes them checks each again. Gives
    /// `first` back when nothing was read (it rides with the claim).
    async fn blocks(
        &self,
        visits: &[(u16, usize)],
        now: i64,
        first: Option<Cmd>,
    ) -> Result<(Vec<Block>, Option<Cmd>)> {
        let mut blocks = Vec::with_capacity(visits.len());
        for (slot, share) in visits {
            let candidates = lock(&self.state.candidates).remove(slot);
            let partition = self.partition(*slot).await?;
            blocks.push(Block::new_in(
                partition,
                *share,
                candidates.unwrap_or_default(),
            ));
        }
        let unnamed: Vec<usize> = (0..blocks.len())
            .filter(|i| blocks[*i].candidates.is_empty())
            .collect();
        if unnamed.is_empty() {
            return Ok((blocks, first));
        }
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        let mut pipe = redis::pipe();
        if let Some(first) = first {
            pipe.add_command(first).ignore();
        }
        for i in &unnamed {
            let most = isize::try_from(names_for(blocks[*i].share)).unwrap_or(isize::MAX);
            let ready = &blocks[*i].partition.keys[READY];
            pipe.zrangebyscore_limit(ready, 0, now, 0, most);
        }
        let named: Vec<Vec<String>> =
            (pipe.query_async(&mut self.conn.clone()).await).map_err(Error::redis(attempted()))?;
        for (i, named) in unnamed.into_iter().zip(named) {
            blocks[i] = Block::new(&blocks[i], named);
        }
        Ok((blocks, None))
    }

    /// One claim call over `blocks` (one partition each, all on one
    /// server; after `first`, in the same round trip), resent unchanged
    /// while no answer comes: the call's record answers a resend (see
    /// `lua/keyed_claim.lua`). Each block's turns go to its `took`;
    /// returns each block's answer.
    async fn claim_blocks(
        &self,
        blocks: &[Block],
        (terms, first): (Terms, Option<Cmd>),
        took: &mut [Claimed],
    ) -> Result<Vec<Answer>> {
        if blocks.is_empty() {
            return Ok(Vec::new());
        }
        let window = crate::script::resend_window(terms.lease);
        let cmd = self.claim_call(blocks, terms, window);
        let attempted = || format!("claiming keyed messages of queue `{}`", self.keys.name);
        let send = || async {
            let conn = &mut self.conn.clone();
            match &first {
                Some(first) => run_after(&CLAIM, first, &cmd, conn).await,
                None => run(&CLAIM, &cmd, conn).await,
            }
        };
        let replies = crate::script::resending(window, send).await;
        self.changed(blocks.iter().map(|block| block.partition.slot));
        let replies: Vec<Reply> = replies.map_err(Error::redis(attempted()))?;
        if replies.len() != blocks.len() {
            let replies = replies.len();
            return Err(Error::reply(attempted(), format_args!("{replies} answers")));
        }
        let mut answers = Vec::with_capacity(blocks.len());
        let mut log = Log::default();
        for ((block, reply), took) in blocks.iter().zip(replies).zip(took.iter_mut()) {
            let (claim, next_at, named, taken, blocked, holds, refused) = reply;
            for (key, error) in refused {
                tracing::warn!(queue = %self.keys.name, %key, %error, "a keyed message's key could not be claimed (is its lock another kind of Redis key?); the other keys go on, and it is tried again after a lease");
            }
            for (key, watched, left) in blocked {
                self.watch_release(key, watched, Duration::from_millis(left));
            }
            let turns = self.turns(block, claim, taken);
            if self.recording.events.is_some() {
                for turn in &turns {
                    let attempt = attempt_of(&turn.record);
                    log.event(EventKind::Claimed, &turn.held.key, (&turn.id, attempt));
                }
            }
            took.turns.extend(turns);
            let holds = match holds {
                0 => Holds::Nothing,
                1 => Holds::AtWork,
                _ => Holds::Waiting,
            };
            let next_at = (next_at >= 0).then_some(next_at);
            answers.push(Answer {
                next_at,
                named,
                holds,
            });
        }
        if self.recording.events.is_some() {
            self.record(log).await;
        }
        Ok(answers)
    }

    /// The claim script's call over `blocks` (see `lua/keyed_claim.lua`):
    /// each block's partition and candidates' keys, the call's record, then
    /// the arguments; `window`: how long the record is kept.
    fn claim_call(&self, blocks: &[Block], terms: Terms, window: Duration) -> Cmd {
        let prefix = &self.keys.prefix;
        let Some(head) = blocks.first() else {
            return CLAIM.call(0);
        };
        let keys = blocks.iter().map(|b| MORE + 4 * b.candidates.len());
        let mut cmd = CLAIM.call(keys.sum::<usize>() + 1);
        for block in blocks {
            cmd.arg(&block.partition.keys[..]);
            for key in &block.candidates {
                let set = crate::lock::permits::permits_key(prefix, key);
                cmd.arg(keys::lock_key(prefix, key))
                    .arg(&set)
                    .arg(format!("{set}:waiters"))
                    .arg(keys::rate_key(prefix, key));
            }
        }
        // One record for the call, in the first block's slot (a call over
        // several blocks is on one server).
        cmd.arg(head.partition.record());
        cmd.arg(millis(terms.lease))
            .arg(millis(window))
            .arg(terms.run.max(1))
            .arg(rand::random::<u32>());
        for block in blocks {
            let share = block.share;
            cmd.arg(share)
                .arg(names_for(share))
                .arg(block.candidates.len());
            for (key, token) in block.candidates.iter().zip(&block.tokens) {
                cmd.arg(key).arg(token.as_str());
            }
        }
        cmd
    }

    /// Lowers the leases index's entries of the partitions of `slots` to
    /// `until` (adding those without one): on a cluster, a claim's note of
    /// the leases it may give there (see [`claim`](Self::claim)).
    fn note_leases(&self, slots: &[u16], until: i64) -> Cmd {
        let mut cmd = redis::cmd("ZADD");
        cmd.arg(self.leases_index()).arg("LT");
        for slot in slots {
            cmd.arg(until).arg(crate::keys::slot_tag(*slot));
        }
        cmd
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

    /// The turns a claim script took in `block`; each key is one of its
    /// candidates, claimed with its token; a run's messages count the
    /// messages before them (`Held::run`).
    fn turns(&self, block: &Block, claim: u64, taken: Vec<Taken>) -> Vec<Turn> {
        let text = |bytes: Vec<u8>| String::from_utf8(bytes).ok();
        let (candidates, tokens) = (&block.candidates, &block.tokens);
        let mut turns: Vec<Turn> = Vec::with_capacity(taken.len());
        for (key, id, seq, permits, rated, record) in taken {
            let found = candidates.iter().position(|k| k.as_bytes() == key);
            let (Some(i), Some(stored), Some(seq)) = (found, text(id), text(seq)) else {
                // Cannot happen with lockgate's script; if it does, the
                // entry comes back after its lease.
                tracing::error!(queue = %self.keys.name, "keyed claim returned a malformed entry");
                continue;
            };
            // A run's messages follow its first, under one token.
            let run = match turns.last() {
                Some(last) if last.held.key == candidates[i] => last.held.run.saturating_add(1),
                _ => 0,
            };
            let held = Held {
                key: candidates[i].clone(),
                token: tokens[i],
                permits,
                rated,
                partition: block.partition.clone(),
                run,
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
