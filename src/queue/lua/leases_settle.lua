-- On a Redis Cluster, after a recovery sweep visited partitions: their
-- entries in the queue's `leases` (see keyed.lua) set to what each visit
-- left, the earliest lease deadline in the partition (none: no entry), as
-- one server's recovery script writes them itself. A due sweep took the
-- entries out while it visited (keyed_leases_due.lua); a claim writes
-- its own (`ZADD LT`, from its own node's view of the index,
-- src/queue/keyed/claim.rs) before it leases and after, and may run while
-- a visit is under way: the visit's deadline only lowers what a claim
-- wrote meanwhile. Standalone (no prelude).
-- KEYS[1]: leases   KEYS[2]: visiting
-- ARGV[1]: a due sweep's mark in `visiting` (see keyed_leases_due.lua),
-- which leaves it unless another sweep took the partition over; "" for a
-- full sweep (which marked none)
-- ARGV[2..]: per partition, its tag and its earliest deadline (-1: none)
-- Returns how many entries it changed.
local mark = tonumber(ARGV[1])
local changed = 0
for i = 2, #ARGV, 2 do
  local tag, deadline = ARGV[i], tonumber(ARGV[i + 1])
  if mark and tonumber(redis.call('ZSCORE', KEYS[2], tag)) == mark then
    redis.call('ZREM', KEYS[2], tag)
  end
  if deadline >= 0 then
    changed = changed + redis.call('ZADD', KEYS[1], 'LT', 'CH', deadline, tag)
  end
end
return changed
