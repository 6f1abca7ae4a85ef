-- Counts, read at one instant of the server's clock.
-- KEYS[1]: schedule   KEYS[2]: active   KEYS[3]: dead
-- Returns {due, later, active, dead, due time of the oldest due message or -1,
-- now, due time of the next message not due yet or -1}.
local now = now_ms()
local due = redis.call('ZCOUNT', KEYS[1], '-inf', now)
local later = redis.call('ZCARD', KEYS[1]) - due
local oldest = -1
if due > 0 then oldest = head_due(KEYS[1]) end
local next_due = -1
if later > 0 then
  local first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if first[2] then next_due = tonumber(first[2]) end
end
return {due, later, redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]), oldest, now, next_due}
