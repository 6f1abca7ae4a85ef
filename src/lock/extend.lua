-- Renews a lock's TTL, but only for the holder whose token it still stores.
-- KEYS: lock ("<token>[:<fence>][!]"); ARGV: holder token, new TTL in ms
-- Returns 1 when extended (a resend does the same again), 0 when the lock
-- was gone or held by another token.
if holds(redis.call('GET', KEYS[1]), ARGV[1]) then -- see holds.lua, prepended
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
