-- On a Redis Cluster, after a recovery sweep visited partitions: their
-- entries in the queue's `leases` (see keyed.lua) set to what each visit
-- left, the earliest lease deadline in the partition (none: no entry), as
-- one server's recovery script writes them itself. A claim lowers an
-- entry before it leases (`LT`, from its own node's view of the index,
-- src/queue/keyed/claim.rs), and may run while a visit is under way: an
-- entry no longer at the sweep's raise keeps what the claim wrote, lowered
-- further to the visit's deadline. Standalone (no prelude).
-- KEYS[1]: leases   ARGV[1]: the raise a due sweep gave the entries it
-- visits (see keyed_leases_due.lua), "" for a full sweep (which raised
-- none: its entries are only lowered)
-- ARGV[2..]: per partition, its tag and its earliest deadline (-1: none)
-- Returns how many entries it changed.
local raise = tonumber(ARGV[1])
local changed = 0
for i = 2, #ARGV, 2 do
  local tag, deadline = ARGV[i], tonumber(ARGV[i + 1])
  local score = raise and tonumber(redis.call('ZSCORE', KEYS[1], tag))
  if raise and score == raise then
    if deadline >= 0 then
      changed = changed + redis.call('ZADD', KEYS[1], 'CH', deadline, tag)
    else
      changed = changed + redis.call('ZREM', KEYS[1], tag)
    end
  elseif deadline >= 0 then
    changed = changed + redis.call('ZADD', KEYS[1], 'LT', 'CH', deadline, tag)
  end
end
return changed
