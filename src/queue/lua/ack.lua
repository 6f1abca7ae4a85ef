-- Completes a claimed message: deletes it, if the caller still holds the claim.
-- KEYS[1]: data   KEYS[2]: active   KEYS[3]: errors
-- ARGV[1]: active member "<id>:<claim>"   ARGV[2]: id
-- ARGV[3]: "1" when the message may have an error entry to delete
-- Returns 1, or 0 when the claim is no longer held (nothing changes).
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], ARGV[2])
if ARGV[3] == '1' then redis.call('HDEL', KEYS[3], ARGV[2]) end
return 1
