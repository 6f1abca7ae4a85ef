-- Tries once more to take a lock that a plain `SET NX PX` found set (held
-- by another holder, or by a first copy of the same request: a resend),
-- and reports how long its holder still has.
-- KEYS[1]: lock key   <prefix>:lock:{<key>}, value "<token>[:<fence>][!]"
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- ARGV[3]: "1" to mark the lock as waited for ("!" at the end of its
--          value): its release then publishes on the lock key's channel,
--          which wakes the waiters (see release.lua); "0" not to.
-- Returns {1, ttl left in ms} when the lock is (now) ours: it was free, or
-- it holds our own token (a resent acquire whose first copy ran); {0, pttl
-- of the current holder} when not.
-- Usual cost: SET, PTTL (and APPEND once per holder when marking).
local held = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if not held then
  return {1, tonumber(ARGV[2])}
end
local n = #ARGV[1]
local after = string.byte(held, n + 1)
if string.sub(held, 1, n) == ARGV[1] and (after == nil or after == 58 or after == 33) then
  return {1, redis.call('PTTL', KEYS[1])}
end
if ARGV[3] == '1' and string.byte(held, -1) ~= 33 then -- not marked yet ('!')
  redis.call('APPEND', KEYS[1], '!')
end
return {0, redis.call('PTTL', KEYS[1])}
