-- Admits a call under a key's rate limit, or reserves the next free slot
-- for a message that will come back then (see rate.lua, prepended).
-- KEYS: log <prefix>:rate:{<key>}, a zset: admission -> its time in µs
--   (reserved slots included, at their future time)
-- ARGV: limit, period in µs, burst, burst window in µs, member (a random
--   token for a call, the message id for a message), "1" to reserve the
--   next slot when it is not now ("0" not to)
-- Returns what `admit` does.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
return admit(KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), ARGV[5], ARGV[6] == '1', now)
