-- Deletes a lock, but only for the holder whose token it still stores.
-- KEYS[1]: lock key
-- ARGV[1]: holder token
-- Returns 1 when released, 0 when the lock was gone or held by another token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
