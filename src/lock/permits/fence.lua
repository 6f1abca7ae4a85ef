-- Issues the fencing token of a held permit, on first use, only while its
-- lease has not run out (see src/lock/fence.lua for the lock's version and
-- what the fence guarantees).
-- KEYS: permits, fences <permits>:fences (a hash: holder token -> its
--   fence, "last" -> the key's last fence; kept while the longest lease
--   lives and a grace period after)
-- ARGV: holder token, grace period in ms
-- Returns the fence, or -1 when the token holds no permit.
-- fence = max(server clock in µs, last fence + 1): see src/lock/fence.lua.
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
if not lease or tonumber(lease) <= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
  return -1
end
local issued = redis.call('HGET', KEYS[2], ARGV[1])
if issued then -- a second ask, or a resend
  return tonumber(issued)
end
local fence = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
local last = tonumber(redis.call('HGET', KEYS[2], 'last'))
if last and last >= tonumber(fence) then
  fence = string.format('%.0f', last + 1)
end
redis.call('HSET', KEYS[2], ARGV[1], fence, 'last', fence)
local keep = math.max(redis.call('PTTL', KEYS[1]), 0) + tonumber(ARGV[2])
if redis.call('PTTL', KEYS[2]) < keep then
  redis.call('PEXPIRE', KEYS[2], keep)
end
return tonumber(fence)
