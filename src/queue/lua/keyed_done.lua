-- Settles keyed messages' turns at work, one block each, in one call:
-- several keys' turns ending at once pay one script, not one each (on a
-- Redis Cluster, blocks of one partition; on one server, of any). Each
-- block is settled as below, as a call of its own would be.
-- Per block: KEYS, the partition's 14 keys then the block's own 5 (as
-- KEYS[15..19] below); ARGV, how many arguments it has, then those (as
-- ARGV[1..] below). Returns the blocks' replies, in their order.
--
-- Ends a keyed message's turn at work (see keyed.lua) if the caller still
-- holds its claim, and lets go of its key's lock or permit; or, for an ack
-- whose caller asked for the next message (ARGV[10]), keeps it and claims
-- the key's next message at once, if the key's rate limit admits it now
-- and unless other code waits for the lock or a permit: then it lets go,
-- the lock going to the first waiter in its line as a `Locker`'s release
-- hands it (release.lua), so that a key's messages and other code take
-- turns. The caller bounds such runs (MAX_RUN, see keyed.rs).
-- KEYS[1..14]: the partition   KEYS[15] (LOCK): the key's lock, or its
-- permits' set   KEYS[16] (WAITERS): the lock's or the set's line of waiters
-- KEYS[17] (FENCES): the set's fences (for a lock: the lock)
-- KEYS[18] (RATE_LOG): the key's rate limit log
-- ARGV[1]: "ack", "retry" (a failed attempt), "defer" (no attempt used),
--   "release" (back as it was) or "bury"
-- ARGV[2..6]: the key, the id, its seq, its claim, the lock's (permit's) token
-- ARGV[7]: the delay in ms (retry, defer)   ARGV[8]: the error (retry, bury)
-- ARGV[9]: "PUBLISH" or "SPUBLISH"   ARGV[10]: for an ack, the next
--   message's lease in ms ("" to let go)   ARGV[11]: a token for the next
-- ARGV[12]: "1" when the message may have an error on record (an ack deletes it)
-- ARGV[13]: the key's permits ("0": its lock)   ARGV[14]: the hand-off ms of
--   a lock or permit to a waiter (release.lua's)
-- ARGV[15]: "1" when the key has a rate limit (its claim said so)
-- ARGV[16]: "1" to answer an acknowledged message's record (completed stream)
-- ARGV[17], ARGV[18]: the dead letters' max count and max age in ms ("" for
--   no limit), which a burial applies to the partition
-- KEYS[19] (RECORD): this call's record, kept ARGV[19] ms by an ack asking
--   for the next message, and by a read ahead that took or acknowledged
--   any: "<status>f<#flags>:<flags>" (which of the messages handled
--   before it the call acknowledged, as its reply says) then
--   "<acknowledged record>", or for status 3 "<renewed 0/1><count>:" then
--   per next message "<seq (16 digits)><#id>:<id>", then the acknowledged
--   record (a record without the "f" part, an earlier version's, says
--   nothing of them). It makes the call safe to resend (see
--   claim.lua): a resend, finding its claim gone, answers what the first
--   call did (the next messages it claimed, those that still hold),
--   instead of a lost claim and next messages leased to nobody until
--   their lease runs out.
-- ARGV[20]: how many of the key's next messages a hand-over may claim at
--   once (a run, see below), 1 or more (0 for none, read ahead)
-- ARGV[21]: how many earlier messages of the same run (the same key, hold
--   and claim number) the caller handled before this one, then each one's
--   stored id and seq: acknowledged first, in the same call
-- then how many messages of the run the caller will not start, then each
--   one's stored id and seq: back in line at their place (a run cut short)
-- ARGV[1] may also be "return": only the two lists are applied (the
--   message stays at work, the key's lock held for it); each listed
--   message is settled only while at work under this claim number (which
--   no other claim ever has), so it answers 1 whatever it found.
-- Or "ahead" (read ahead): the messages handled before this one are
--   acknowledged, and, while this one goes on at work, the usual
--   hand-over claims the key's next messages into its run at once, so
--   that they are known before it ends (see below). Answers status 3 with
--   them, 1 when none came (the lists applied all the same), 0 when this
--   message's claim is gone. The hand-over's record answers a resend.
-- A run of more than one message is noted (see note_run): whatever lets
-- go of the key puts the run's messages still at work back in line, so
-- that the key is never free while a message of it is at work.
--
-- A run: the usual hand-over claims up to ARGV[20] of the key's next
-- messages, each under the same claim number and lease, in line order.
-- The caller runs them one after another and acknowledges them together
-- with the last (or, when one of them fails, acknowledges the ones before
-- it and returns the ones after it, then settles the failed one as any
-- other): a hot key pays one script per run, not per message. A run's
-- messages are at work, so nothing else claims them; a worker that dies
-- part way leaves them to recovery, which puts them back in line.
-- A retried or deferred message goes back first in line: a key with a lock
-- waits out the delay; a key with permits goes on with its next messages
-- meanwhile, the delayed one aside on the schedule until it is due.
-- Returns {status, the acknowledged record or "", for status 3 {1 when
-- held under the new token ARGV[11] or 0 under ARGV[6], {{each next
-- message's id, seq and record}, ...}}, else false, which of the messages
-- listed as handled before this one it acknowledged: "1" or "0" each, in
-- their order (a resend: what the first call's record says; false when it
-- says nothing)}. Status 0: the claim is no longer held
-- (nothing changed); 1: done, the key let go; 2: the same, and the key
-- ready for a claim; 3: the key's next message claimed under the same lock
-- and claim number.
--
-- The usual hand-over (a lock, no rate limit, no fence issued, nobody
-- waiting) passes the lock on under its token. Every message a hand-over
-- claims starts with a whole lease, `ARGV[10]` from now, and the lock is
-- renewed with it: the worker renews a message only once it knows of it,
-- and a chain of short messages may move on several times between a
-- renewal's reading and its call, so a lease inherited from the first
-- message of a chain would run out under the chain (issue 35). A fenced
-- lock gets a new token, so that the next message's fence is its own.

-- The server's time, read once per call: its blocks settle at one moment
-- (`main` forgets it: a function's state outlives its calls).
local read_time, clock = server_time, nil
local function server_time()
  clock = clock or {read_time()}
  return clock[1], clock[2]
end
local function now_ms()
  return (server_time())
end

-- The call's own keys and arguments (set by `main`): below, KEYS and
-- ARGV are the block at hand's (see settle).
local CALL_KEYS, CALL_ARGV

-- The block at hand: its keys and arguments, numbered as a call of one
-- block would have them (the partition's keys through K too, see
-- enter_partition), and what the block found of them. The functions
-- below read them, defined once per call rather than once per block:
-- enter_block sets every one of them before anything else.
local KEYS, ARGV
local LOCK, WAITERS, FENCES, RATE_LOG, RECORD = MORE + 1, MORE + 2, MORE + 3, MORE + 4, MORE + 5
local op, key, id, seq, token, limit, own_member, at_work, ahead, run_max
-- The key's lock as the block found it (a key with a lock), read before
-- its first write (see read_first).
local lock_value
-- The run's messages listed: handled before this one, not started.
local done_ids, done_members, returned_from, returned_ids, returned_members
-- The acknowledged record, if asked; which of those handled before it
-- this call acknowledged (see the reply): one listed may have left the
-- active set before (acknowledged by an earlier call that listed it, or
-- back in line after its lease).
local acked, done_here
-- While more than one message of the key is at work under this claim (a
-- run), the limits hash lists them (RUN_FIELD, "<key>\0run" -> "<claim>:"
-- then "<#member>:<member>" per line member), so that whatever lets go of
-- the key puts those still at work back in line: a caller that settles a
-- run's message out of turn must not leave the key free while another is
-- at work. `run_seen`: what run_before read of it.
-- `line_empty`: true once the block found the key's line empty (an ack
-- that asked for the next message, and none was there), until something
-- puts a message back in it: the turn's end then needs not read it again.
-- `ended_here`: the run's messages the block took out of the active set
-- itself (the one it settles, those it acknowledged before it): see
-- return_run. `limits_left`: see return_run. `hand_over`: an ack that
-- asks for the key's next message.
local RUN_FIELD, run_seen, line_empty, ended_here, limits_left, hand_over

-- The run's messages listed from ARGV[`from`] on (a count, then stored id
-- and seq each): their ids, their active members (NONE, never written,
-- for none); and where the next list starts.
local NONE = {}
local function listed(from)
  if (tonumber(ARGV[from]) or 0) == 0 then return NONE, NONE, from + 1 end
  local ids, members = {}, {}
  for i = 1, tonumber(ARGV[from]) or 0 do
    local listed_id, listed_seq = ARGV[from + 2 * i - 1], ARGV[from + 2 * i]
    ids[i] = listed_id
    members[i] = line_member(key, listed_seq, listed_id) .. ':' .. ARGV[5]
  end
  return ids, members, from + 1 + 2 * #ids
end

-- A resend: what the first call did, from its record; the next message
-- it claimed while that still holds (else the ack alone).
local function resent()
  local kept = ARGV[10] ~= '' and redis.call('GET', KEYS[RECORD])
  if not kept then return {0, '', false, false} end
  local status, flags, rest = tonumber(string.sub(kept, 1, 1)), false, 2
  if string.sub(kept, 2, 2) == 'f' then
    local length, at = string.match(kept, '^(%d+):()', 3)
    flags, rest = string.sub(kept, at, at + tonumber(length) - 1), at + tonumber(length)
  end
  if status ~= 3 then return {status, string.sub(kept, rest), false, flags} end
  local renewed = tonumber(string.sub(kept, rest, rest))
  local count, from = string.match(kept, '^(%d+):()', rest + 1)
  local nexts = {}
  for _ = 1, tonumber(count) do
    local next_seq = string.sub(kept, from, from + 15)
    local length, at = string.match(kept, '^(%d+):()', from + 16)
    local next = string.sub(kept, at, at + tonumber(length) - 1)
    from = at + #next
    if redis.call('ZSCORE', KEYS[ACTIVE], line_member(key, next_seq, next) .. ':' .. ARGV[5]) then
      nexts[#nexts + 1] = {next, next_seq, redis.call('HGET', KEYS[DATA], next) or ''}
    end
  end
  local record = string.sub(kept, from)
  if #nexts == 0 then return {1, record, false, flags} end
  return {3, record, {renewed, nexts}, flags}
end

-- The record's part that keeps `done_here` (see KEYS[RECORD]).
local function flagged()
  return 'f' .. #done_here .. ':' .. done_here
end

-- The members of this claim's run (`run`: its note) still at work and not
-- settled by this call, and the latest of their lease deadlines (nil:
-- none).
local function run_at_work(run)
  local at_work_now, latest = {}, nil
  -- Read ahead, the message stays at work: it is one of them.
  local settled = {[at_work] = not ahead}
  for _, member in ipairs(done_members) do settled[member] = true end
  for _, member in ipairs(returned_members) do settled[member] = true end
  local earlier, claim = run_members(run)
  for _, member in ipairs(claim == ARGV[5] and earlier or {}) do
    local full = member .. ':' .. claim
    local deadline = not settled[full] and tonumber(redis.call('ZSCORE', KEYS[ACTIVE], full))
    if deadline then
      at_work_now[#at_work_now + 1] = member
      if not latest or deadline > latest then latest = deadline end
    end
  end
  return at_work_now, latest
end

-- The run before this call as its note says: the note, its members still
-- at work and not settled by this call, and the latest of their lease
-- deadlines (see run_at_work). Read once per call: the hand-over and
-- note_run both ask.
local function run_before()
  if not run_seen then
    local run = redis.call('HGET', KEYS[LIMITS], RUN_FIELD)
    local members, latest = {}, nil
    if run then members, latest = run_at_work(run) end
    local members_set = {}
    for _, member in ipairs(members) do members_set[member] = true end
    run_seen = {run = run, members = members, members_set = members_set, latest = latest}
  end
  return run_seen
end

-- Notes the key's messages at work under this claim after a hand-over
-- claimed `members`: those, and those of the run before it still at work
-- that this call did not settle. Costs a read, and a write for a run.
local function note_run(members)
  local before = run_before()
  local at_work_now = {}
  for _, member in ipairs(before.members) do at_work_now[#at_work_now + 1] = member end
  for _, member in ipairs(members) do at_work_now[#at_work_now + 1] = member end
  if ahead and not before.members_set[own_member] then
    at_work_now[#at_work_now + 1] = own_member
  end
  if #at_work_now > 1 then
    local parts = {ARGV[5], ':'}
    for _, member in ipairs(at_work_now) do parts[#parts + 1] = #member .. ':' .. member end
    redis.call('HSET', KEYS[LIMITS], RUN_FIELD, table.concat(parts))
  elseif before.run then
    redis.call('HDEL', KEYS[LIMITS], RUN_FIELD)
  end
end

-- Before the key is let go: its run's messages still at work, back in
-- line. Returns whether each message of the run is accounted for: ended
-- by this call, or still at work until now. Else one left the run before
-- this call, most likely by recovery (its lease ran out), which made the
-- key ready while the others were at work. Notes in `limits_left`
-- whether the key's limits hash fields other than the run's note are
-- there (a rate limit), for its turn's end to forget them.
local function return_run()
  local fields = redis.call('HMGET', KEYS[LIMITS], key, key .. '\0rate', RUN_FIELD)
  limits_left = fields[1] or fields[2]
  local run = fields[3]
  if not run then return true end
  redis.call('HDEL', KEYS[LIMITS], RUN_FIELD)
  local members, claim = run_members(run)
  local accounted = true
  for _, member in ipairs(members) do
    local full = member .. ':' .. claim
    if ended_here[full] then
      -- Out of the active set already.
    elseif remove_from(ACTIVE, full) == 1 then
      add_to(LINES, 0, member)
      line_empty = false
    else
      accounted = false
    end
  end
  return accounted
end

-- Claims `nexts` ({id, seq} each, the key's first in line) under this
-- claim number, leased until `until_ms`; `renewed`: under the new token.
local function continue(nexts, until_ms, renewed)
  local lines, active, ids = {}, {}, {}
  local record = {'3', flagged(), renewed and 1 or 0, #nexts, ':'}
  for i, next in ipairs(nexts) do
    local member = line_member(key, next[2], next[1])
    lines[i], ids[i] = member, next[1]
    active[2 * i - 1], active[2 * i] = until_ms, member .. ':' .. ARGV[5]
    record[#record + 1] = next[2] .. #next[1] .. ':' .. next[1]
  end
  counted(LINES, -redis.call('ZREM', KEYS[LINES], unpack(lines)))
  counted(ACTIVE, redis.call('ZADD', KEYS[ACTIVE], unpack(active)))
  leased_until(until_ms)
  note_run(lines)
  if limit > 0 and not head_of(key) then
    remove_from(READY, key)
    ready_changed()
  end
  record[#record + 1] = acked
  redis.call('SET', KEYS[RECORD], table.concat(record), 'PX', ARGV[19])
  local records = redis.call('HMGET', KEYS[DATA], unpack(ids))
  local answer = {}
  for i, next in ipairs(nexts) do answer[i] = {next[1], next[2], records[i] or ''} end
  return {3, acked, {renewed and 1 or 0, answer}, done_here}
end

-- Lets go of the key's lock, held by `token`: to the first live waiter in
-- its line when it is marked waited for (as release.lua does), else freed;
-- a release waited for is published on the lock's channel.
local function unlock(lock, line)
  local value = lock_value
  if not value or not owns(value, token) then return end
  local waited = string.byte(value, -1) == 33
  local next = waited and pop_live(line, lock, ARGV[9]) -- see line.lua
  if not next then
    redis.call('DEL', lock)
    if waited then redis.call(ARGV[9], lock, '') end
    return
  end
  local handed = redis.call('ZCARD', line) > 0 and next .. '!' or next
  redis.call('SET', lock, handed, 'PX', ARGV[14])
  redis.call(ARGV[9], lock, next)
end

-- After some of the run left it (acknowledged, back in line) while the
-- message goes on: the key's lock lasts as long as the longest lease of
-- the run's messages still at work, no longer (a hand-over may have given
-- those that left a longer one): a worker that dies now leaves the key
-- locked no longer than its own lease. A lease that ran out already
-- leaves the lock a millisecond: a late renewal takes it again if it is
-- still free (see keyed_extend.lua), as any lapsed lease's does.
local function fit_lock()
  local value = lock_value
  if not value or not owns(value, token) then return end
  local latest = tonumber(redis.call('ZSCORE', KEYS[ACTIVE], at_work))
  local others = run_before().latest
  if others and (not latest or others > latest) then latest = others end
  if latest then redis.call('PEXPIRE', KEYS[LOCK], math.max(latest - now_ms(), 1)) end
end

-- The turn's end, `status` 1 or 2; recorded for an ack that asked for the
-- next message (see KEYS[18]).
local function ended(status)
  if hand_over then redis.call('SET', KEYS[RECORD], status .. flagged() .. acked, 'PX', ARGV[19]) end
  return {status, acked, false, done_here}
end

-- Sets the block at hand: `keys` and `args` (see above).
local function enter_block(keys, args)
  KEYS, ARGV = keys, args
  op, key, id, seq, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[6]
  limit = tonumber(ARGV[13])
  own_member = line_member(key, seq, id)
  at_work = own_member .. ':' .. ARGV[5]
  ahead = op == 'ahead'
  run_max = math.max(tonumber(ARGV[20]) or 1, 1)
  lock_value = nil
  done_ids, done_members, returned_from = listed(21)
  returned_ids, returned_members = listed(returned_from)
  acked, done_here = '', false
  RUN_FIELD, run_seen, line_empty, limits_left, hand_over = run_field(key), nil, false, false, false
  ended_here = {[at_work] = true}
end

-- What the block reads that a command may refuse, read before its first
-- write: a refusal (the lock made another kind of key; a rule that denies
-- ZMSCORE) fails the block of a turn still at work with nothing changed,
-- and the message stays at work until its lease runs out. (Read after
-- the writes, it left the message acknowledged and the key at work with
-- nothing at work, never claimed again.) A turn no longer at work
-- answers as ever: it never reads the lock. The block writes the lock at
-- most once, after every read of it.
-- Then the message itself leaves the active set first: if it was not
-- there, the claim is no longer held (or this is a resend). Returns the
-- listed handled messages' scores, and the message's lease deadline (read
-- ahead: it stays at work) or the block's reply when it ends here.
local function read_first()
  local scores = #done_members > 0 and redis.call('ZMSCORE', KEYS[ACTIVE], unpack(done_members)) or {}
  if limit == 0 then
    local read, value = pcall(redis.call, 'GET', KEYS[LOCK])
    if read then
      lock_value = value
    elseif redis.call('ZSCORE', KEYS[ACTIVE], at_work) then
      error(value)
    end
  end
  if ahead then
    -- Still at work, it stays; its record says this call ran already.
    if redis.call('EXISTS', KEYS[RECORD]) == 1 then return scores, nil, resent() end
    local own_deadline = tonumber(redis.call('ZSCORE', KEYS[ACTIVE], at_work))
    if not own_deadline then return scores, nil, {0, '', false, false} end
    return scores, own_deadline
  elseif op ~= 'return' and remove_from(ACTIVE, at_work) == 0 then
    return scores, nil, resent()
  end
  return scores
end

-- The run's earlier messages (`scores`: theirs in the active set),
-- acknowledged; its messages not started, back in line at their place:
-- the key stays at work, or, let go meanwhile (a caller's mistake), is
-- ready now. Those still at work leave it in one command, whatever their
-- number (one listed twice counts once); an ack deletes their records
-- with its own, listed in what it returns.
local function settle_listed(scores)
  local gone, flags, leaving = {}, {}, {}
  for i, member in ipairs(done_members) do
    flags[i] = 0
    if scores[i] and not ended_here[member] then
      flags[i] = 1
      gone[#gone + 1] = done_ids[i]
      leaving[#leaving + 1] = member
      ended_here[member] = true
    end
  end
  done_here = table.concat(flags)
  if #gone > 0 then
    counted(ACTIVE, -redis.call('ZREM', KEYS[ACTIVE], unpack(leaving)))
    if op ~= 'ack' then redis.call('HDEL', KEYS[DATA], unpack(gone)) end
    redis.call('HDEL', KEYS[ERRORS], unpack(gone))
  end
  local returned_at = #returned_ids > 0 and now_ms()
  for i, member in ipairs(returned_members) do
    if remove_from(ACTIVE, member) == 1 then
      rejoin(key, ARGV[returned_from + 2 * i], returned_ids[i], returned_at)
    end
  end
  return gone
end

-- Claims the key's next messages into the run under the same lock (see
-- continue), the lock lasting as long as the longest lease at work: the
-- new ones', `own_deadline` (the message at hand's, read ahead), the rest
-- of the run's (code that drives the queue itself may hand over or read
-- ahead under a shorter lease than one of them has).
local function run_on(nexts, own_deadline)
  local now = now_ms()
  local ttl, latest = tonumber(ARGV[10]), run_before().latest
  if own_deadline and own_deadline > (latest or 0) then latest = own_deadline end
  if latest and latest - now > ttl then ttl = latest - now end
  redis.call('PEXPIRE', KEYS[LOCK], ttl)
  return continue(nexts, now + tonumber(ARGV[10]), false)
end

-- Read ahead: a run that goes on as long as its key has messages in line
-- and the lock stays as the run took it (no fence issued, nobody waiting
-- in its line, no permits, no rate limit), a run's worth at a time, each
-- claimed while the last one known is at work: the worker starts it as
-- soon as that one's handler returns, with no call in between. `gone`:
-- the handled messages this block acknowledged.
local function read_ahead(own_deadline, gone)
  local room = ARGV[20] ~= '0' and limit == 0 and ARGV[15] ~= '1'
  if room and lock_value == token then
    local nexts = heads_of(key, run_max)
    if #nexts > 0 then return run_on(nexts, own_deadline) end
  end
  if limit == 0 and #gone > 0 then fit_lock() end
  -- What it acknowledged, for a resend after a lost reply (which finds
  -- them gone).
  if #gone > 0 then redis.call('SET', KEYS[RECORD], '1' .. flagged(), 'PX', ARGV[19]) end
  return {1, '', false, done_here}
end

-- A message that goes back (`now`: the server's ms): dead, back in line
-- where it was, or, retried or deferred, with its attempt counted, back
-- in line or aside until its delay ends. Returns from when its key may be
-- claimed again.
local function put_back(now)
  local from = now
  if op == 'bury' then
    redis.call('HSET', KEYS[KEYOF], id, aside(key, '', limit))
    add_to(DEAD, now, id)
    redis.call('HSET', KEYS[ERRORS], id, ARGV[8])
    counted(DEAD, -trim_dead(KEYS[DEAD], KEYS[DATA], KEYS[ERRORS], now, ARGV[17], ARGV[18], 100,
      KEYS[KEYOF]))
  elseif op == 'release' then
    rejoin(key, seq, id, now)
  elseif op ~= 'ack' then
    local enq, failures, deferrals, stalls, payload = parse_or_keep(redis.call('HGET', KEYS[DATA], id))
    if op == 'retry' then
      failures = failures + 1
      redis.call('HSET', KEYS[ERRORS], id, ARGV[8])
    else
      deferrals = deferrals + 1
    end
    redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
    local delay = tonumber(ARGV[7]) or 0
    if limit > 0 and delay > 0 then
      redis.call('HSET', KEYS[KEYOF], id, aside(key, seq, limit))
      add_to(SCHEDULE, now + delay, id)
    else
      rejoin(key, seq, id, now)
      if limit == 0 then from = now + delay end
    end
  end
  return from
end

-- An ack that asks for the key's next message, when the usual hand-over
-- could not pass the lock on as it is: under a new token (a fenced lock,
-- nobody waiting; a permit), if its rate limit admits it now. Returns the
-- reply, or nil and from when the key may be claimed again.
local function hand_to_next(now, now_us, from)
  local next, next_seq = nil, nil
  if not line_empty then next, next_seq = head_of(key) end
  local rated = next and ARGV[15] == '1'
  local wait = rated and rate_wait(rate_of(key), KEYS[RATE_LOG], ARGV[11], now_us) or 0
  if wait > 0 then return nil, now + wait end
  local lease_end = now + tonumber(ARGV[10])
  if not next then return nil, from end
  if limit == 0 then
    -- A fenced lock, nobody waiting: the next message's fence is its
    -- own, under a new token.
    local value = lock_value
    if value and owns(value, token) and string.byte(value, -1) ~= 33 then
      redis.call('SET', KEYS[LOCK], ARGV[11], 'PX', ARGV[10])
      return continue({{next, next_seq}}, lease_end, true)
    end
  elseif not waiters_beside_queue(KEYS[WAITERS]) and redis.call('ZREM', KEYS[LOCK], token) == 1 then
    redis.call('HDEL', KEYS[FENCES], token)
    redis.call('ZADD', KEYS[LOCK], lease_end, ARGV[11])
    redis.call('PEXPIRE', KEYS[LOCK], ARGV[10], 'GT')
    return continue({{next, next_seq}}, lease_end, true)
  end
  return nil, from
end

-- Lets go of the key (its lock or permit; a run's messages still at work
-- back in line first) and ends the turn; the key is ready from `from` if
-- its line has a head.
local function let_go(from)
  -- Whether the key was surely at work with its lock (ready at AT_WORK):
  -- while a run was at work, recovery may have made it ready for a message
  -- of the run whose lease ran out.
  local locked_alone = false
  if limit == 0 then
    locked_alone = return_run()
    unlock(KEYS[LOCK], KEYS[WAITERS])
  else
    free_permit(KEYS[LOCK], KEYS[WAITERS], KEYS[FENCES], token, limit, ARGV[9], true, tonumber(ARGV[14]))
    if not head_of(key) and redis.call('ZCARD', KEYS[LOCK]) == 0 then forget_limits(key) end
  end
  if after_turn(key, from, locked_alone, line_empty) then return ended(2) end
  if limit == 0 and limits_left then forget_limits(key) end
  return ended(1)
end

-- The turn's end after the message is out of the active set (`gone`: the
-- handled messages this block acknowledged): acknowledged and handed
-- over to the key's next messages, or let go.
local function end_turn(gone)
  if op == 'ack' then
    if ARGV[16] == '1' then acked = redis.call('HGET', KEYS[DATA], id) or '' end
    redis.call('HDEL', KEYS[DATA], id, unpack(gone))
    if ARGV[12] == '1' then redis.call('HDEL', KEYS[ERRORS], id) end
  end
  hand_over = op == 'ack' and ARGV[10] ~= ''
  if hand_over and limit == 0 and ARGV[15] ~= '1' then
    local nexts = heads_of(key, run_max)
    line_empty = #nexts == 0
    if #nexts > 0 and lock_value == token then return run_on(nexts, nil) end
  end
  local now, now_us = server_time()
  local from = put_back(now)
  if hand_over then
    local reply
    reply, from = hand_to_next(now, now_us, from)
    if reply then return reply end
  end
  return let_go(from)
end

-- Settles the block of `keys` and `args` (see above).
local function settle(keys, args)
  enter_block(keys, args)
  local scores, own_deadline, reply = read_first()
  if reply then return reply end
  local gone = settle_listed(scores)
  if op == 'return' then
    if limit == 0 and (#gone > 0 or #returned_ids > 0) then fit_lock() end
    return {1, '', false, done_here}
  end
  if ahead then return read_ahead(own_deadline, gone) end
  return end_turn(gone)
end

-- The call, given its keys and arguments: each block settled in turn.
local function main(keys, args)
  CALL_KEYS, CALL_ARGV, clock = keys, args, nil
  local replies, kb, ab = {}, 0, 0
  while ab < #CALL_ARGV do
    local n = tonumber(CALL_ARGV[ab + 1])
    local block_keys, block_args = {}, {}
    for i = 1, MORE + 5 do block_keys[i] = CALL_KEYS[kb + i] end
    for i = 1, n do block_args[i] = CALL_ARGV[ab + 1 + i] end
    enter_partition(kb)
    -- A block that fails (a command refused: a key of the wrong type, say)
    -- answers status 255 and its error, and the others go on; what it
    -- changed before the error stays, as a call of its own would leave it.
    local ok, reply = pcall(settle, block_keys, block_args)
    if not ok then
      reply = {255, type(reply) == 'table' and reply.err or tostring(reply), false, false}
    end
    replies[#replies + 1] = reply
    kb, ab = kb + MORE + 5, ab + 1 + n
  end
  return replies
end
