-- Counts, read at one instant of the server's clock.
-- KEYS[1]: schedule   KEYS[2]: active   KEYS[3]: dead
-- Returns {due, later, active, dead, due time of the oldest due message or -1, now}.
local now = now_ms()
local due = redis.call('ZCOUNT', KEYS[1], '-inf', now)
local later = redis.call('ZCARD', KEYS[1]) - due
local oldest = -1
if due > 0 then oldest = head_due(KEYS[1]) end
return {due, later, redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]), oldest, now}
