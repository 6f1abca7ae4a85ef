-- Takes a lock when it is free and hands out the key's next fencing token.
-- KEYS[1]: lock key           <prefix>:lock:{<key>}
-- KEYS[2]: fence counter key  <prefix>:fence:{<key>}   (same hash slot)
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- ARGV[3]: how long the fence counter outlives its last use, in milliseconds
-- Returns {1, fence} when acquired, {0, pttl of the current holder} when not.
--
-- The fence is max(previous fence + 1, server time in microseconds): strictly
-- increasing while the counter exists, and still increasing after it was
-- deleted or expired, because no key can be acquired more than once per
-- microsecond. 2^53 microseconds is year 2255, so Lua numbers stay exact.
--
-- The fence counter is read before the lock is set: if reading it fails (a
-- key of the wrong type), the script stops before writing anything.
local previous = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local t = redis.call('TIME')
  local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if previous >= fence then
    fence = previous + 1
  end
  redis.call('SET', KEYS[2], string.format('%.0f', fence), 'PX', ARGV[3])
  return {1, fence}
end
return {0, redis.call('PTTL', KEYS[1])}
