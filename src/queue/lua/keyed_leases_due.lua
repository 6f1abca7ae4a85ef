-- The partitions where a lease may have run out: those whose entry in the
-- queue's `leases` (see keyed.lua) is due by the server's clock.
-- Standalone (no prelude).
-- KEYS[1]: leases   ARGV[1]: how many at most   ARGV[2] (on a Redis
-- Cluster, see src/queue/keyed/partitions.rs): a time far ahead (ms) that
-- their entries are raised to while the sweep visits them, so that the
-- caller's settlement afterwards (leases_settle.lua) can tell an entry a
-- claim lowered meanwhile
-- Returns their tags, earliest first.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
if ARGV[2] and #due > 0 then
  local raised = {}
  for i, tag in ipairs(due) do
    raised[2 * i - 1], raised[2 * i] = ARGV[2], tag
  end
  redis.call('ZADD', KEYS[1], 'XX', unpack(raised))
end
return due
