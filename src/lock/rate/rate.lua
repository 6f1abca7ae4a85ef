-- A key's rate limit log (see mod.rs), as a function prepended to admit.lua
-- and to the keyed queue's claim and ack scripts, so that a keyed message's
-- claim counts in the same log as `Locker::admit`.
-- Admits one under `log`'s limit (`limit` in any window of `period` µs, at
-- most `burst` in any window of `window` µs) at server time `now` (µs), for
-- `member`; reserves the next slot for it when `reserve` and it is not now.
-- Returns {1, admission time in µs} when admitted now (also for a member
-- whose slot was reserved before: it keeps its reserved time); {0, µs until
-- the next free slot, 1 if it was reserved for the member else 0}.
--
-- Admissions are placed in time order, each at least `period` after the
-- one `limit` places before it (and `window` after the one `burst` places
-- before it): so no window of `period` ever holds more than `limit` (nor a
-- window of `window` more than `burst`). A reserved slot counts like an
-- admission; calls that come meanwhile queue behind it.
local function admit(log, limit, period, burst, window, member, reserve, now)
  local reserved = redis.call('ZSCORE', log, member)
  if reserved then -- a message back for its slot (or a resend)
    return {1, tonumber(reserved)}
  end
  -- Admissions a window ago no longer count.
  redis.call('ZREMRANGEBYSCORE', log, '-inf', now - period)
  local n = redis.call('ZCARD', log)
  -- The time of the admission at rank i (0 is the earliest, -1 the latest).
  local function at(i)
    return tonumber(redis.call('ZRANGE', log, i, i, 'WITHSCORES')[2])
  end
  local slot = now -- never earlier
  if n > 0 then slot = math.max(slot, at(-1)) end
  if n >= limit then slot = math.max(slot, at(n - limit) + period) end
  if burst < limit and n >= burst then slot = math.max(slot, at(n - burst) + window) end
  if slot > now and not reserve then
    return {0, slot - now, 0}
  end
  redis.call('ZADD', log, slot, member)
  redis.call('PEXPIRE', log, math.ceil((slot - now + period) / 1000) + 1)
  if slot <= now then
    return {1, now}
  end
  return {0, slot - now, 1}
end
