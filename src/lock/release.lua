-- Deletes a lock, but only for the holder whose token it still stores, and
-- keeps its fence on record for a grace period (see acquire.lua).
-- KEYS[1]: lock key                 value <token>:<fence>
-- KEYS[2]: fence record (tombstone) value <fence>:<token>   (same hash slot)
-- ARGV[1]: holder token
-- ARGV[2]: grace period: how long the tombstone lives, in milliseconds
-- Returns 1 when released (also when the lock is gone and the tombstone
-- names this token: a resent release whose first copy ran), 0 when the lock
-- was gone or is held by another token.
local prefix = ARGV[1] .. ':'
local n = #prefix
local value = redis.call('GET', KEYS[1])
if value then
  if string.sub(value, 1, n) ~= prefix then
    return 0
  end
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], string.sub(value, n + 1) .. ':' .. ARGV[1], 'PX', ARGV[2])
  return 1
end
local tomb = redis.call('GET', KEYS[2])
if tomb and string.sub(tomb, -n) == ':' .. ARGV[1] then
  return 1
end
return 0
