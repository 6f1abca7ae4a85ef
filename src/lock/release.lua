-- Releases a lock, but only for the holder whose token it still stores, and
-- keeps its fence on record for a grace period (see acquire.lua): the lock
-- key becomes the tombstone "~<fence>:<token>", which acquire.lua treats as
-- free and which expires after the grace period.
-- KEYS[1]: lock key   held: "<token>:<fence>"   released: "~<fence>:<token>"
-- ARGV[1]: holder token
-- ARGV[2]: grace period: how long the tombstone lives, in milliseconds
-- Returns 1 when released (also when the tombstone names this token: a
-- resent release whose first copy ran), 0 when the lock was gone or is held
-- by another token.
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
local n = #ARGV[1]
if string.sub(value, 1, n + 1) == ARGV[1] .. ':' then
  redis.call('SET', KEYS[1], '~' .. string.sub(value, n + 2) .. ':' .. ARGV[1], 'PX', ARGV[2])
  return 1
end
if string.byte(value, 1) == 126 and string.sub(value, -n - 1) == ':' .. ARGV[1] then
  return 1
end
return 0
