-- Ends a keyed message's turn at work (see keyed.lua) if the caller still
-- holds its claim, and lets go of its key's lock or permit; or, for an ack
-- whose caller asked for the next message (ARGV[10]), keeps it and claims
-- the key's next message at once, if the key's rate limit admits it now
-- and unless other code waits for the lock or a permit: then it lets go,
-- the lock going to the first waiter in its line as a `Locker`'s release
-- hands it (release.lua), so that a key's messages and other code take
-- turns. The caller bounds such runs (MAX_RUN, see keyed.rs).
-- KEYS[1..13]: the partition   KEYS[14] (LOCK): the key's lock, or its
-- permits' set   KEYS[15] (WAITERS): the lock's or the set's line of waiters
-- KEYS[16] (FENCES): the set's fences (for a lock: the lock)
-- KEYS[17] (RATE_LOG): the key's rate limit log
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
-- KEYS[18] (RECORD): this call's record, kept ARGV[19] ms by an ack asking for the
--   next message: "<status><acknowledged record>", or for status 3
--   "3<next seq (16 digits)><renewed 0/1><#next id>:<next id><acknowledged
--   record>". It makes the call safe to resend (see claim.lua): a resend,
--   finding its claim gone, answers what the first call did (the next
--   message it claimed, while that still holds), instead of a lost claim
--   and a next message leased to nobody until its lease runs out.
-- A retried or deferred message goes back first in line: a key with a lock
-- waits out the delay; a key with permits goes on with its next messages
-- meanwhile, the delayed one aside on the schedule until it is due.
-- Returns {status, the acknowledged record or "", for status 3 {the next
-- message's id, seq and record, 1 when held under the new token ARGV[11] or
-- 0 under ARGV[6]}, else false}. Status 0: the claim is no longer held
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
local LOCK, WAITERS, FENCES, RATE_LOG, RECORD = MORE + 1, MORE + 2, MORE + 3, MORE + 4, MORE + 5
local op, key, id, seq, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local limit = tonumber(ARGV[13])
local at_work = line_member(key, seq, id) .. ':' .. ARGV[5]

-- A resend: what the first call did, from its record; the next message
-- it claimed while that still holds (else the ack alone).
local function resent()
  local kept = ARGV[10] ~= '' and redis.call('GET', KEYS[RECORD])
  if not kept then return {0, '', false} end
  local status = tonumber(string.sub(kept, 1, 1))
  if status ~= 3 then return {status, string.sub(kept, 2), false} end
  local next_seq, renewed = string.sub(kept, 2, 17), tonumber(string.sub(kept, 18, 18))
  local length, from = string.match(kept, '^(%d+):()', 19)
  local next = string.sub(kept, from, from + tonumber(length) - 1)
  local record = string.sub(kept, from + #next)
  if not redis.call('ZSCORE', KEYS[ACTIVE], line_member(key, next_seq, next) .. ':' .. ARGV[5]) then
    return {1, record, false}
  end
  return {3, record, {next, next_seq, redis.call('HGET', KEYS[DATA], next) or '', renewed}}
end

if not redis.call('ZSCORE', KEYS[ACTIVE], at_work) then return resent() end
remove_from(ACTIVE, at_work)
local acked = ''
if op == 'ack' then
  if ARGV[16] == '1' then acked = redis.call('HGET', KEYS[DATA], id) or '' end
  redis.call('HDEL', KEYS[DATA], id)
  if ARGV[12] == '1' then redis.call('HDEL', KEYS[ERRORS], id) end
end

-- Claims `next` (seq `next_seq`) of the key under this claim number, leased
-- until `until_ms`; `renewed`: under the new token.
local function continue(next, next_seq, until_ms, renewed)
  local next_member = line_member(key, next_seq, next)
  remove_from(LINES, next_member)
  add_to(ACTIVE, until_ms, next_member .. ':' .. ARGV[5])
  if limit > 0 and not head_of(key) then
    redis.call('ZREM', KEYS[READY], key)
    ready_changed()
  end
  local flag = renewed and 1 or 0
  redis.call('SET', KEYS[RECORD], '3' .. next_seq .. flag .. #next .. ':' .. next .. acked, 'PX', ARGV[19])
  return {3, acked, {next, next_seq, redis.call('HGET', KEYS[DATA], next) or '', flag}}
end

-- Lets go of the key's lock, held by `token`: to the first live waiter in
-- its line when it is marked waited for (as release.lua does), else freed;
-- a release waited for is published on the lock's channel.
local function unlock(lock, line)
  local value = redis.call('GET', lock)
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

local hand_over = op == 'ack' and ARGV[10] ~= ''
if hand_over and limit == 0 and ARGV[15] ~= '1' then
  local next, next_seq = head_of(key)
  if next and redis.call('GET', KEYS[LOCK]) == token then
    redis.call('PEXPIRE', KEYS[LOCK], ARGV[10])
    return continue(next, next_seq, now_ms() + tonumber(ARGV[10]), false)
  end
end

local now, now_us = server_time()
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

if hand_over then
  local next, next_seq = head_of(key)
  local rated = next and ARGV[15] == '1'
  local wait = rated and rate_wait(rate_of(key), KEYS[RATE_LOG], ARGV[11], now_us) or 0
  if wait > 0 then from = now + wait end
  local lease_end = now + tonumber(ARGV[10])
  if next and wait == 0 then
    if limit == 0 then
      -- A fenced lock, nobody waiting: the next message's fence is its
      -- own, under a new token.
      local value = redis.call('GET', KEYS[LOCK])
      if value and owns(value, token) and string.byte(value, -1) ~= 33 then
        redis.call('SET', KEYS[LOCK], ARGV[11], 'PX', ARGV[10])
        return continue(next, next_seq, lease_end, true)
      end
    elseif not waiters_beside_queue(KEYS[WAITERS]) and redis.call('ZREM', KEYS[LOCK], token) == 1 then
      redis.call('HDEL', KEYS[FENCES], token)
      redis.call('ZADD', KEYS[LOCK], lease_end, ARGV[11])
      redis.call('PEXPIRE', KEYS[LOCK], ARGV[10], 'GT')
      return continue(next, next_seq, lease_end, true)
    end
  end
end
if limit == 0 then
  unlock(KEYS[LOCK], KEYS[WAITERS])
else
  free_permit(KEYS[LOCK], KEYS[WAITERS], KEYS[FENCES], token, limit, ARGV[9], true, tonumber(ARGV[14]))
  if not head_of(key) and redis.call('ZCARD', KEYS[LOCK]) == 0 then forget_limits(key) end
end
-- The turn's end, `status` 1 or 2; recorded for an ack that asked for the
-- next message (see KEYS[18]).
local function ended(status)
  if hand_over then redis.call('SET', KEYS[RECORD], status .. acked, 'PX', ARGV[19]) end
  return {status, acked, false}
end
if after_turn(key, from, limit == 0) then return ended(2) end
if limit == 0 then forget_limits(key) end
return ended(1)
