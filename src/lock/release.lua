-- Releases a lock, but only for the holder whose token it still stores; if
-- someone waits for it (the value ends in "!", see contend.lua), tells them
-- on the lock key's own channel, which has the lock key's hash slot (so
-- `SPUBLISH` reaches the waiters of a cluster node, `PUBLISH` those of a
-- single server).
-- KEYS[1]: lock key   value "<token>[:<fence>][!]"
-- ARGV[1]: holder token
-- ARGV[2]: the publish command: "PUBLISH" or "SPUBLISH"
-- Returns 1 when released, 0 when the lock was gone (expired, or released
-- already: a resent release whose first copy ran), -1 when another token
-- holds it.
-- Usual cost: GET, DEL (and a publish when waited for).
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then -- the usual case: no fence, nobody waiting
  redis.call('DEL', KEYS[1])
  return 1
end
if not value then
  return 0
end
local n = #ARGV[1]
local after = string.byte(value, n + 1)
if string.sub(value, 1, n) ~= ARGV[1] or not (after == nil or after == 58 or after == 33) then
  return -1
end
redis.call('DEL', KEYS[1])
if string.byte(value, -1) == 33 then
  redis.call(ARGV[2], KEYS[1], '')
end
return 1
