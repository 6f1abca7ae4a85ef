-- Renews a lock's TTL, but only for the holder whose token it still stores.
-- KEYS[1]: lock key      value "<token>[:<fence>][!]"
-- ARGV[1]: holder token
-- ARGV[2]: new TTL in milliseconds
-- Returns 1 when extended (a resend does the same again), 0 when the lock
-- was gone or held by another token.
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then -- the usual case: no fence, nobody waiting
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not value then
  return 0
end
local n = #ARGV[1]
local after = string.byte(value, n + 1)
if string.sub(value, 1, n) == ARGV[1] and (after == nil or after == 58 or after == 33) then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
