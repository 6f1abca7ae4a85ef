-- Settles the index entries of the partitions a claim visited, raised
-- before it to ARGV[1] (see keyed.rs, `Keyed::claim`), in one call.
-- Standalone (no prelude): it touches the index alone.
-- KEYS[1]: the queue's index of partitions (zset member -> from when to look)
-- ARGV[1]: the score the claim raised its entries to
-- ARGV[2]: when to look again at a partition where nothing waits (ms)
-- ARGV[3..]: per partition, its member and what the claim saw there:
--   "<ms>": something is due then: the entry is lowered to it (`XX LT`: a
--     push that lowered it further since keeps its mark);
--   "idle": nothing waits, but messages are there (dead letters, say):
--     looked at again at ARGV[2];
--   "empty": no message at all: it leaves the index (nothing to claim,
--     recover, count or list there; a push puts it back).
-- "idle" and "empty" apply only while the entry is still the one the
-- claim raised it to: a push since then lowered it, and that mark stays.
-- Returns how many entries left the index.
-- The entries lowered go in two commands, whatever their number: those
-- due by now (one that changed rings the doorbell), and the others.
local raised, now = tonumber(ARGV[1]), tonumber(ARGV[3])
local forgotten, due_now, later = 0, {}, {}
for i = 4, #ARGV, 2 do
  local member, seen = ARGV[i], ARGV[i + 1]
  local at = tonumber(seen)
  if at then
    local lowered = at <= now and due_now or later
    lowered[#lowered + 1] = at
    lowered[#lowered + 1] = member
  elseif tonumber(redis.call('ZSCORE', KEYS[1], member)) == raised then
    if seen == 'empty' then
      forgotten = forgotten + redis.call('ZREM', KEYS[1], member)
    else
      redis.call('ZADD', KEYS[1], 'XX', ARGV[2], member)
    end
  end
end
if #later > 0 then redis.call('ZADD', KEYS[1], 'XX', 'LT', unpack(later)) end
if #due_now > 0 and redis.call('ZADD', KEYS[1], 'XX', 'LT', 'CH', unpack(due_now)) > 0 then
  redis.call('LPUSH', KEYS[2], 1)
  redis.call('LTRIM', KEYS[2], 0, 0)
end
return forgotten
