-- Takes one of a key's permits (at most `limit` holders at a time), or
-- reports when the first of the current holders' leases ends: see
-- take_permit in permits.lua, which is prepended.
-- KEYS[1]: permits  <prefix>:permits:{<key>}
-- KEYS[2]: line     <prefix>:permits:{<key>}:waiters
-- ARGV[1]: holder token   ARGV[2]: lease TTL in ms
-- ARGV[3]: limit, the most holders at a time (1 or more)
-- ARGV[4]: "1" to wait in line when none is free, "2" only to leave the
--          line when one is taken, "0" neither (see take_permit)
-- Usual cost: TIME, then take_permit's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return take_permit(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  ARGV[4], now)
