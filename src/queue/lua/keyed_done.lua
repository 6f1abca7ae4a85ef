-- Ends a keyed message's turn at work (see keyed.lua), if the caller still
-- holds its claim, and lets go of its key's lock, or, for an acknowledged
-- message whose key has more, keeps the lock and claims the key's next
-- message at once (the caller asked for it with a lease), unless another
-- key of the partition is waiting.
-- KEYS[1..11]: the partition   KEYS[12]: the key's lock
-- ARGV[1]: "ack", "retry" (a failed attempt), "defer" (no attempt used),
--          "release" (back as it was) or "bury"
-- ARGV[2]: the key   ARGV[3]: the id   ARGV[4]: its claim   ARGV[5]: the lock's token
-- ARGV[6]: the delay in ms before the key's head may be claimed again
--          (retry, defer), or the error (retry, bury)
-- ARGV[7]: the error of a retry
-- ARGV[8]: "PUBLISH" or "SPUBLISH"
-- ARGV[9]: for an ack, the next message's lease in ms ("" to let go)
-- ARGV[10]: the lock's token for the next message
-- Returns {1, claim, next id, next record} when the next message was
-- claimed, {2} when done and the key has a next message for a claim, {1}
-- when done, {0} when the claim is no longer held.
local op, key, id, token = ARGV[1], ARGV[2], ARGV[3], ARGV[5]
local member = id .. ':' .. ARGV[4]
if redis.call('ZREM', KEYS[ACTIVE], member) == 0 then return {0} end
local now, now_us = server_time()
if redis.call('HGET', KEYS[HELD], key) == member then redis.call('HDEL', KEYS[HELD], key) end
local from = now
if op == 'ack' then
  leave_line(id)
  redis.call('HDEL', KEYS[DATA], id)
  redis.call('HDEL', KEYS[ERRORS], id)
elseif op == 'bury' then
  leave_line(id, true)
  redis.call('ZADD', KEYS[DEAD], now, id)
  redis.call('HSET', KEYS[ERRORS], id, ARGV[6])
else
  local record = redis.call('HGET', KEYS[DATA], id)
  local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
  if op == 'retry' then
    failures = failures + 1
    redis.call('HSET', KEYS[ERRORS], id, ARGV[7])
  elseif op == 'defer' then
    deferrals = deferrals + 1
  end
  redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
  from = now + (tonumber(ARGV[6]) or 0)
end
local next = head_of(key)
-- Another key of the partition ready and waiting goes first: the key lets
-- go and queues behind it.
local waiting = redis.call('ZRANGEBYSCORE', KEYS[READY], '-inf', now, 'LIMIT', 0, 1)[1]
if next and op == 'ack' and ARGV[9] ~= '' and not waiting then
  local value = redis.call('GET', KEYS[12])
  if value and owns(value, token) then
    local tag = next_claim(now_us)
    -- A new token: the next message's fence is its own. A mark that
    -- someone waits for the lock stays.
    local marked = string.byte(value, -1) == 33 and '!' or ''
    redis.call('SET', KEYS[12], ARGV[10] .. marked, 'PX', ARGV[9])
    redis.call('HSET', KEYS[HELD], key, next .. ':' .. tag)
    redis.call('ZADD', KEYS[ACTIVE], now + tonumber(ARGV[9]), next .. ':' .. tag)
    return {1, tonumber(tag), next, redis.call('HGET', KEYS[DATA], next) or ''}
  end
end
unlock(KEYS[12], token, ARGV[8])
if next then
  redis.call('ZADD', KEYS[READY], from, key)
  return {2}
end
return {1}
