-- Gives a permit back (see acquire.lua); when someone waits for the key's
-- permits, tells them on the channel named after the permits set, which has
-- its hash slot (SPUBLISH on a cluster, PUBLISH on a single server).
-- KEYS[1]: permits   KEYS[2]: mark   KEYS[3]: fences (see fence.lua)
-- ARGV[1]: holder token   ARGV[2]: "PUBLISH" or "SPUBLISH"
-- ARGV[3]: "1" when a fence was issued to this holder
-- Returns 1 when released, 0 when the token held no permit (its lease ran
-- out and another acquire dropped it, or a resent release's first copy ran).
-- A lease that ran out but is still in the set is released as usual: it was
-- counted as held until now (an acquire drops the leases that ran out before
-- it counts a full set), so no one else has held that permit meanwhile.
-- Usual cost: ZREM, DEL.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return 0
end
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[3], ARGV[1])
end
if redis.call('DEL', KEYS[2]) == 1 then
  redis.call(ARGV[2], KEYS[1], '')
end
return 1
