-- Extends the lease of a keyed message at work and its key's lock together
-- (see keyed.lua), if the caller still holds the claim. A renewal that
-- comes after the lease ran out (and before recovery ended the turn) takes
-- the key's lock again if nobody took it meanwhile, as any message's late
-- renewal keeps its claim; if someone did, the claim is lost.
-- KEYS[1..10]: the partition   KEYS[11]: the key's lock
-- ARGV[1]: the active member "<line member>:<claim>"   ARGV[2]: the lock's token
-- ARGV[3]: lease in ms
-- Returns 1 when extended, 0 when the claim or the lock is lost.
if not redis.call('ZSCORE', KEYS[ACTIVE], ARGV[1]) then return 0 end
local value = redis.call('GET', KEYS[11])
if value and not owns(value, ARGV[2]) then return 0 end
if value then
  redis.call('PEXPIRE', KEYS[11], ARGV[3])
else
  redis.call('SET', KEYS[11], ARGV[2], 'PX', ARGV[3])
end
redis.call('ZADD', KEYS[ACTIVE], 'XX', now_ms() + tonumber(ARGV[3]), ARGV[1])
return 1
