-- Takes one of a key's permits (at most `limit` holders at a time), or
-- reports when the first of the current holders' leases ends.
-- KEYS[1]: permits  <prefix>:permits:{<key>}, a zset: holder token -> the
--                   end of its lease, in ms by the server's clock
-- KEYS[2]: mark     <prefix>:permits:{<key>}:waited, set while someone
--                   waits: the next release then publishes on the channel
--                   named KEYS[1] (see release.lua)
-- ARGV[1]: holder token   ARGV[2]: lease TTL in ms
-- ARGV[3]: limit, the most holders at a time (1 or more)
-- ARGV[4]: "1" to mark the permits as waited for when none is free
-- Returns {1, ms left of the lease} when a permit is (now) ours: one was
-- free, or the token holds one already (a resent acquire whose first copy
-- ran); {0, ms until the first holder's lease ends} when none is free.
-- Usual cost: TIME, ZCARD, ZADD, PEXPIRE (a set made by this acquire) or
-- PTTL; a full set first drops the leases that ran out (ZREMRANGEBYSCORE)
-- and counts again.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local held = redis.call('ZCARD', KEYS[1])
if held >= limit then
  -- Leases that ran out free their permits (their holders died or
  -- stalled). Only a full set needs to know: until then they are counted,
  -- which admits no one too many.
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  held = redis.call('ZCARD', KEYS[1])
end
if held < limit then
  if redis.call('ZADD', KEYS[1], 'NX', now + ttl, ARGV[1]) == 0 then
    return {1, tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1])) - now}
  end
  -- The set lives as long as its longest lease.
  if held == 0 or redis.call('PTTL', KEYS[1]) < ttl then
    redis.call('PEXPIRE', KEYS[1], ttl)
  end
  return {1, ttl}
end
local mine = redis.call('ZSCORE', KEYS[1], ARGV[1])
if mine then
  return {1, tonumber(mine) - now}
end
if ARGV[4] == '1' then
  redis.call('SET', KEYS[2], '1', 'PX', ttl)
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {0, math.max(tonumber(first[2]) - now, 0)}
