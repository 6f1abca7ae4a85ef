-- Takes a lock when it is free and hands out the key's next fencing token.
-- KEYS[1]: lock key           <prefix>:lock:{<key>}
-- KEYS[2]: fence counter key  <prefix>:fence:{<key>}   (same hash slot)
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- ARGV[3]: lifetime of a freshly seeded fence counter, in milliseconds
-- Returns {1, fence} when acquired, {0, pttl of the current holder} when not.
--
-- Fences strictly increase per key. While the counter exists, INCR does it
-- (and keeps the counter's TTL). A missing counter (first use, expired, or
-- deleted) is seeded from the server clock in microseconds, which is past
-- any earlier value: an earlier counter was seeded at least its lifetime
-- (an hour or more) ago and cannot have been incremented a billion times
-- since. 2^53 microseconds is year 2255, so Lua numbers stay exact.
-- Usual cost: two commands (SET NX, INCR).
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {0, redis.call('PTTL', KEYS[1])}
end
local fence = redis.pcall('INCR', KEYS[2])
if type(fence) == 'table' and fence.err then
  -- A foreign value under our fence key: undo the lock rather than leave
  -- it held by a caller that sees an error.
  redis.call('DEL', KEYS[1])
  return redis.error_reply('fence counter ' .. KEYS[2] .. ': ' .. fence.err)
end
if fence == 1 then
  local t = redis.call('TIME')
  fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
end
return {1, fence}
