-- Renews a lock's TTL, but only for the holder whose token it still stores.
-- KEYS: lock ("<token>[:<fence>][!]"); ARGV: holder token, new TTL in ms
-- Returns 1 when extended (a resend does the same again), 0 when the lock
-- was gone or held by another token.
local value = redis.call('GET', KEYS[1])
local n = #ARGV[1]
local after = value and string.byte(value, n + 1)
if value and string.sub(value, 1, n) == ARGV[1] and (after == nil or after == 58 or after == 33) then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
