-- Renews a lock's TTL, but only for the holder whose token it still stores.
-- KEYS[1]: lock key
-- ARGV[1]: holder token
-- ARGV[2]: new TTL in milliseconds
-- Returns 1 when extended, 0 when the lock was gone or held by another token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
