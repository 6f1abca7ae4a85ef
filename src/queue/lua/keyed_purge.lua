-- Deletes a partition (see keyed.lua), keys' limits included, and takes its
-- messages out of the counts, which go too once they are all 0. Its claim
-- and line counters stay (as the queue's claim counter does), so that a
-- claim from before the purge never matches a message pushed after it;
-- and so does a cluster partition's change number (`v`, see
-- tally_version), so that its copy in the queue's slot takes the purge.
-- KEYS[1..MORE]: the partition
for _, set in ipairs(COUNTED) do counted(set[1], -redis.call('ZCARD', KEYS[set[1]])) end
redis.call('UNLINK', KEYS[DATA], KEYS[SCHEDULE], KEYS[ACTIVE], KEYS[DEAD], KEYS[ERRORS],
  KEYS[LINES], KEYS[READY], KEYS[KEYOF], KEYS[LIMITS])
redis.call('ZREM', KEYS[LEASES], tag_of(KEYS[ACTIVE]))
ready_changed()
tally()
for _, set in ipairs(COUNTED) do
  local n = redis.call('HGET', KEYS[COUNTS], set[2])
  if n and n ~= '0' then return true end
end
local fields = {}
for i, set in ipairs(COUNTED) do fields[i] = set[2] end
redis.call('HDEL', KEYS[COUNTS], unpack(fields))
return true
