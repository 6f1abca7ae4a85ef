-- Issues the fencing token of a held lock, on first use, and only while the
-- caller's token still holds it: holders follow one another in time, so
-- fences issued this way increase in holder order.
-- KEYS: lock ("<token>[:<fence>][!]": the fence is written into it, TTL
--   kept, so asking again returns it), fence record <prefix>:fence:{<key>}
--   (the key's last fence, kept while the lock lives and a grace after)
-- ARGV: holder token, grace period in ms, "1" for a later message of a
--   keyed run (see keyed_done.lua), which holds the lock under the token
--   of the message before it: its fence is issued anew, greater than the
--   one before's, rather than returned
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
if after == 58 and ARGV[3] ~= '1' then -- issued already (a second ask, or a resend)
  return tonumber(string.match(value, '^:(%d+)', n + 1))
end
local t = redis.call('TIME')
local fence = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
local last = tonumber(redis.call('GET', KEYS[2]))
-- Issued anew: above the one in the lock too (the record may be gone).
local was = after == 58 and tonumber(string.match(value, '^:(%d+)', n + 1))
if was and (not last or was > last) then last = was end
if last and last >= tonumber(fence) then
  fence = string.format('%.0f', last + 1)
end
local marked = string.byte(value, -1) == 33 and '!' or ''
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence .. marked, 'KEEPTTL')
local pttl = redis.call('PTTL', KEYS[1])
redis.call('SET', KEYS[2], fence, 'PX', math.max(pttl, 0) + tonumber(ARGV[2]))
return tonumber(fence)
