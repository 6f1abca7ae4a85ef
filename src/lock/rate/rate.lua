-- A key's rate limit log (see mod.rs), as a function prepended to admit.lua
-- and to the keyed queue's claim and ack scripts, so that a keyed message's
-- claim counts in the same log as `Locker::admit`.
--
-- Admissions a period ago no longer count. At most RATE_TRIM of them are
-- removed per call, the oldest first: after a pause a log may hold a whole
-- period's worth (up to MAX_RATE, a million), and a script blocks its
-- server while it runs. Those left are counted (ZCOUNT, O(log n)) and
-- stepped over by rank; each call removes up to RATE_TRIM more while it
-- adds one, so the log shrinks back. Work per call: O(log n + RATE_TRIM).
local RATE_TRIM = 100

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
  local stale = redis.call('ZCOUNT', log, '-inf', now - period)
  if stale > 0 then
    -- The stale admissions are the lowest scores: remove by rank.
    local trimmed = math.min(stale, RATE_TRIM)
    redis.call('ZREMRANGEBYRANK', log, 0, trimmed - 1)
    stale = stale - trimmed
  end
  local n = redis.call('ZCARD', log) - stale
  -- The time of the admission at rank i among those that count (0 is the
  -- earliest, -1 the latest): the stale ones left come first.
  local function at(i)
    if i >= 0 then i = i + stale end
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
