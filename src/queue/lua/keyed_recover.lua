-- Ends the turns whose lease ran out (their worker died or stalled) in a
-- partition (see keyed.lua): the message goes back first in its key's line
-- and its key is ready at once (the key's lock or permit ran out with the
-- lease), counting a stall; one that stalled ARGV[1] times is buried.
-- KEYS[1..11]: the partition   ARGV[1]: max stalls   ARGV[2]: how many at most
-- Returns {requeued, buried, examined}.
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[ACTIVE], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local max_stalls = tonumber(ARGV[1])
local requeued, buried = 0, 0
for _, entry in ipairs(expired) do
  redis.call('ZREM', KEYS[ACTIVE], entry)
  local member = string.match(entry, '^(.*):%d+$')
  local key, id = string.match(member or '', '^(.-)%z%d+%z(.*)$')
  local record = id and redis.call('HGET', KEYS[DATA], id)
  if record then
    local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
    stalls = stalls + 1
    redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
    if stalls >= max_stalls then
      local limit = tonumber(redis.call('HGET', KEYS[LIMITS], key)) or 0
      redis.call('HSET', KEYS[KEYOF], id, aside(key, '', limit))
      redis.call('ZADD', KEYS[DEAD], now, id)
      redis.call('HSET', KEYS[ERRORS], id, 'lease expired ' .. stalls .. ' times (limit '
        .. max_stalls .. '): its worker died or stalled every time it held the message')
      buried = buried + 1
    else
      redis.call('HSET', KEYS[ERRORS], id, 'lease expired: the worker died or stalled')
      rejoin(key, string.match(member, '%z(%d+)%z'), id, now)
      requeued = requeued + 1
    end
    after_turn(key, now)
  end
end
return {requeued, buried, #expired}
