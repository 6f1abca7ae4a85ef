-- Renews a lock's TTL, but only for the holder whose token it still stores.
-- KEYS[1]: lock key      value "<token>:<fence>" (or a tombstone "~...", which
--                        no token matches)
-- ARGV[1]: holder token
-- ARGV[2]: new TTL in milliseconds
-- Returns 1 when extended (a resend does the same again), 0 when the lock
-- was gone or held by another token.
local value = redis.call('GET', KEYS[1])
if value and string.sub(value, 1, #ARGV[1] + 1) == ARGV[1] .. ':' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
