-- Extends the lease of a keyed message at work and its key's lock together,
-- if the caller still holds both (see keyed.lua).
-- KEYS[1..10]: the partition   KEYS[11]: the key's lock
-- ARGV[1]: the active member "<line member>:<claim>"   ARGV[2]: the lock's token
-- ARGV[3]: lease in ms
-- Returns 1 when extended, 0 when the claim or the lock is lost.
if not redis.call('ZSCORE', KEYS[ACTIVE], ARGV[1]) then return 0 end
local value = redis.call('GET', KEYS[11])
if not value or not owns(value, ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[ACTIVE], 'XX', now_ms() + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[11], ARGV[3])
return 1
