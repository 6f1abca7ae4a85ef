-- Takes one of a key's permits, or reports when the first holder's lease
-- ends: see take_permit in permits.lua, which is prepended.
-- KEYS: permits <prefix>:permits:{<key>}, line <permits>:waiters
-- ARGV: holder token, lease TTL in ms, limit (the most holders at a time),
--   line mode ("1" wait in line, "2" only leave it, "0" neither)
-- Usual cost: TIME, then take_permit's.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return take_permit(KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
  ARGV[4], now)
