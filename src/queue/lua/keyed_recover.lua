-- Ends the turns whose lease ran out (their worker died or stalled) in a
-- partition (see keyed.lua): the message stays first in its key's line and
-- its key is ready at once (the key's lock ran out with the lease), counting
-- a stall; one that stalled ARGV[1] times is buried.
-- KEYS[1..11]: the partition   ARGV[1]: max stalls   ARGV[2]: how many at most
-- Returns {requeued, buried, examined}.
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[ACTIVE], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local max_stalls = tonumber(ARGV[1])
local requeued, buried = 0, 0
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[ACTIVE], member)
  local id = member_id(member)
  local record = id and redis.call('HGET', KEYS[DATA], id)
  local key = record and key_of(id)
  if key then
    if redis.call('HGET', KEYS[HELD], key) == member then redis.call('HDEL', KEYS[HELD], key) end
    local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
    stalls = stalls + 1
    redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
    if stalls >= max_stalls then
      leave_line(id, true)
      redis.call('ZADD', KEYS[DEAD], now, id)
      redis.call('HSET', KEYS[ERRORS], id, 'lease expired ' .. stalls .. ' times (limit '
        .. max_stalls .. '): its worker died or stalled every time it held the message')
      buried = buried + 1
    else
      redis.call('HSET', KEYS[ERRORS], id, 'lease expired: the worker died or stalled')
      requeued = requeued + 1
    end
    if head_of(key) then redis.call('ZADD', KEYS[READY], now, key) end
  end
end
return {requeued, buried, #expired}
