-- Releases a key's lock (only for the token it holds) and brings the first
-- message parked on the key back, due now (see parking.lua); publishes on
-- the lock key's channel when the lock was waited for (see
-- src/lock/release.lua).
-- KEYS[1]: lock   KEYS[2]: parked set   KEYS[3]: data   KEYS[4]: dead
-- KEYS[5]: schedule   KEYS[6]: bell   KEYS[7]: prioritized
-- ARGV[1]: holder token   ARGV[2]: "PUBLISH" or "SPUBLISH"
-- Returns 1 when released, 0 when the lock was gone, -1 when another token
-- holds it.
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
if not owns(value, ARGV[1]) then
  return -1
end
redis.call('DEL', KEYS[1])
if string.byte(value, -1) == 33 then
  redis.call(ARGV[2], KEYS[1], '')
end
local head = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7])
if head then
  bring_forward(KEYS[5], KEYS[7], KEYS[6], head, now_ms())
end
return 1
