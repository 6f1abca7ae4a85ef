-- Settles the index entries of partitions (or shards) a claim found
-- nothing ready in, each only if its entry is still the one the claim
-- raised it to: a push since then lowered it (to 0), and that mark must
-- stay. Standalone (no prelude): it touches the index alone.
-- KEYS[1]: the queue's index of partitions (zset member -> from when to look)
-- ARGV[1]: the score the claim raised its entries to
-- ARGV[2]: when to look again at a partition that still holds messages
-- ARGV[3..]: per partition, its member and "1" when it held no message at
--   all (then it leaves the index: nothing is there to claim, recover,
--   count or list, and a push puts it back), else "0" (then it is looked
--   at again at ARGV[2])
-- Returns how many entries left the index.
local raised = tonumber(ARGV[1])
local forgotten = 0
for i = 3, #ARGV, 2 do
  local member = ARGV[i]
  if tonumber(redis.call('ZSCORE', KEYS[1], member)) == raised then
    if ARGV[i + 1] == '1' then
      forgotten = forgotten + redis.call('ZREM', KEYS[1], member)
    else
      redis.call('ZADD', KEYS[1], 'XX', ARGV[2], member)
    end
  end
end
return forgotten
