-- Renews a permit's lease, only while it has not run out (see acquire.lua).
-- KEYS: permits; ARGV: holder token, new TTL in ms
-- Returns 1 when renewed, 0 when the token holds no permit any more.
-- Usual cost: ZSCORE, TIME, ZADD, PEXPIRE.
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not lease or tonumber(lease) <= now then
  return 0 -- gone, or ran out: any acquire may drop it and give its permit away
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[1])
-- The set lives as long as its longest lease (GT: only a later end).
redis.call('PEXPIRE', KEYS[1], ttl, 'GT')
return 1
