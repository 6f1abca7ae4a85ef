-- Issues the fencing token of a held lock, on first use, and only while the
-- caller's token still holds it: holders follow one another in time, so
-- fences issued this way increase in holder order.
-- KEYS: lock ("<token>[:<fence>][!]": the fence is written into it, TTL
--   kept, so asking again returns it), fence record <prefix>:fence:{<key>}
--   (the key's last fence, kept while the lock lives and a grace after)
-- ARGV: holder token, grace period in ms
-- Returns the fence, or -1 when the caller does not hold the lock.
-- fence = max(server clock in µs, last fence on record + 1): no counter
-- outlives the record, so a restart from an older snapshot or a promoted
-- replica that lost the latest fences cannot hand one out again unless its
-- clock reads earlier than those fences were made from. 2^53 µs is year
-- 2255: Lua numbers hold them exactly, and %.0f prints no exponent.
-- Usual cost: GET, TIME, GET, SET, PTTL, SET.
local value = redis.call('GET', KEYS[1])
if not holds(value, ARGV[1]) then -- see holds.lua, prepended
  return -1
end
local n = #ARGV[1]
local after = string.byte(value, n + 1)
if after == 58 then -- issued already (a second ask, or a resend)
  return tonumber(string.match(value, '^:(%d+)', n + 1))
end
local t = redis.call('TIME')
local fence = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
local last = tonumber(redis.call('GET', KEYS[2]))
if last and last >= tonumber(fence) then
  fence = string.format('%.0f', last + 1)
end
local marked = after == 33 and '!' or ''
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence .. marked, 'KEEPTTL')
local pttl = redis.call('PTTL', KEYS[1])
redis.call('SET', KEYS[2], fence, 'PX', math.max(pttl, 0) + tonumber(ARGV[2]))
return tonumber(fence)
