-- Admits a call under a key's rate limit: at most `limit` admissions in any
-- window of `period`, and at most `burst` in any window of `burst_window`
-- (period × burst / limit), by the server's clock; or reserves the next
-- free slot for a message that will come back then.
-- KEYS[1]: log  <prefix>:rate:{<key>}, a zset: admission -> its time in µs
--               (reserved slots included, at their future time)
-- ARGV[1]: limit   ARGV[2]: period in µs
-- ARGV[3]: burst   ARGV[4]: burst window in µs
-- ARGV[5]: member: a random token for a call, the message id for a message
-- ARGV[6]: "1" to reserve the next slot when it is not now; "0" not to
-- Returns {1, admission time in µs} when admitted now (also for a message
-- whose slot was reserved before: it keeps its reserved time); {0, µs until
-- the next free slot, 1 if it was reserved for the member else 0}.
--
-- Admissions are placed in time order, each at least `period` after the
-- one `limit` places before it (and `burst_window` after the one `burst`
-- places before it): so no window of `period` ever holds more than `limit`
-- (nor a window of `burst_window` more than `burst`). A reserved slot
-- counts like an admission; calls that come meanwhile queue behind it.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local limit, period = tonumber(ARGV[1]), tonumber(ARGV[2])
local burst, window = tonumber(ARGV[3]), tonumber(ARGV[4])
local member = ARGV[5]
local reserved = redis.call('ZSCORE', KEYS[1], member)
if reserved then -- a message back for its slot (or a resend)
  return {1, tonumber(reserved)}
end
-- Admissions a window ago no longer count.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - period)
local n = redis.call('ZCARD', KEYS[1])
local slot = now
if n > 0 then
  local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
  slot = math.max(slot, tonumber(last[2]))
end
if n >= limit then
  local e = redis.call('ZRANGE', KEYS[1], n - limit, n - limit, 'WITHSCORES')
  slot = math.max(slot, tonumber(e[2]) + period)
end
if burst < limit and n >= burst then
  local e = redis.call('ZRANGE', KEYS[1], n - burst, n - burst, 'WITHSCORES')
  slot = math.max(slot, tonumber(e[2]) + window)
end
local keep = math.ceil((slot - now + period) / 1000) + 1
if slot <= now then
  redis.call('ZADD', KEYS[1], now, member)
  redis.call('PEXPIRE', KEYS[1], keep)
  return {1, now}
end
if ARGV[6] == '1' then
  redis.call('ZADD', KEYS[1], slot, member)
  redis.call('PEXPIRE', KEYS[1], keep)
  return {0, slot - now, 1}
end
return {0, slot - now, 0}
