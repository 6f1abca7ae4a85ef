-- The partitions where a lease may have run out: those whose entry in the
-- queue's `leases` (one server only, see keyed.lua) is due by the server's
-- clock. Standalone (no prelude).
-- KEYS[1]: leases   ARGV[1]: how many at most
-- Returns their tags, earliest first.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
