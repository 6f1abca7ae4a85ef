-- Ends a keyed message's turn at work (see keyed.lua), if the caller still
-- holds its claim, and lets go of its key's lock, or, for an acknowledged
-- message whose key has more, keeps the lock and claims the key's next
-- message at once (the caller asked for it with a lease), unless another
-- key of the partition is waiting.
-- KEYS[1..10]: the partition   KEYS[11]: the key's lock
-- ARGV[1]: "ack", "retry" (a failed attempt), "defer" (no attempt used),
--          "release" (back as it was) or "bury"
-- ARGV[2]: the key   ARGV[3]: the id   ARGV[4]: its seq   ARGV[5]: its claim
-- ARGV[6]: the lock's token
-- ARGV[7]: the delay in ms before the key's head may be claimed again
--          (retry, defer), or the error (bury)
-- ARGV[8]: the error of a retry
-- ARGV[9]: "PUBLISH" or "SPUBLISH"
-- ARGV[10]: for an ack, the next message's lease in ms ("" to let go)
-- ARGV[11]: the lock's token for the next message
-- ARGV[12]: "1" when the message may have an error on record (an ack
--           deletes it)
-- Returns {1, next id, next seq, next record} when the next message was
-- claimed (under the same claim number), {2} when done and the key has a
-- next message for a claim, {1} when done, {0} when the claim is no longer
-- held.
local op, key, id, token = ARGV[1], ARGV[2], ARGV[3], ARGV[6]
local member = line_member(key, ARGV[4], id)
if redis.call('ZREM', KEYS[ACTIVE], member .. ':' .. ARGV[5]) == 0 then return {0} end
local now = now_ms()
local from = now
if op == 'ack' then
  redis.call('ZREM', KEYS[LINES], member)
  redis.call('HDEL', KEYS[DATA], id)
  if ARGV[12] == '1' then redis.call('HDEL', KEYS[ERRORS], id) end
elseif op == 'bury' then
  redis.call('ZREM', KEYS[LINES], member)
  redis.call('HSET', KEYS[KEYOF], id, key)
  redis.call('ZADD', KEYS[DEAD], now, id)
  redis.call('HSET', KEYS[ERRORS], id, ARGV[7])
elseif op ~= 'release' then
  local enq, failures, deferrals, stalls, payload = parse_or_keep(redis.call('HGET', KEYS[DATA], id))
  if op == 'retry' then
    failures = failures + 1
    redis.call('HSET', KEYS[ERRORS], id, ARGV[8])
  else
    deferrals = deferrals + 1
  end
  redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
  from = now + (tonumber(ARGV[7]) or 0)
end
if op == 'ack' and ARGV[10] ~= '' then
  local next, seq = head_of(key)
  local waiting = next and redis.call('ZRANGEBYSCORE', KEYS[READY], 0, now, 'LIMIT', 0, 1)[1]
  local value = next and not waiting and redis.call('GET', KEYS[11])
  if value and owns(value, token) then
    -- A new token: the next message's fence is its own. A mark that
    -- someone waits for the lock stays.
    local marked = string.byte(value, -1) == 33 and '!' or ''
    redis.call('SET', KEYS[11], ARGV[11] .. marked, 'PX', ARGV[10])
    redis.call('ZADD', KEYS[ACTIVE], now + tonumber(ARGV[10]),
      line_member(key, seq, next) .. ':' .. ARGV[5])
    return {1, next, seq, redis.call('HGET', KEYS[DATA], next) or ''}
  end
end
unlock(KEYS[11], token, ARGV[9])
if after_turn(key, from) then return {2} end
return {1}
