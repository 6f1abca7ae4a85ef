-- A key's permits (see mod.rs), as functions: prepended to acquire.lua and
-- release.lua, and to the queue's parking scripts for permits (see
-- src/queue/lua/parking.lua), so both take and give back permits alike.
--
--   set     zset    holder token -> the end of its lease, in ms by the
--                   server's clock
--   mark    string  set while someone waits: the next release publishes on
--                   the channel named after the set
--   fences  hash    holder token -> its fence, "last" -> the last fence
--                   issued (see fence.lua)

-- Takes one of `limit` permits of `set` for `token`, leased for `ttl` ms
-- from `now`; marks the set as waited for when none is free and `want_mark`.
-- Returns {1, ms left of the lease} when a permit is (now) the token's: one
-- was free, or the token holds one already (a resent acquire whose first
-- copy ran); {0, ms until the first holder's lease ends} when none is free.
-- Usual cost: ZCARD, ZADD, PEXPIRE. A full set first drops the leases that
-- ran out (ZREMRANGEBYSCORE) and counts again: until then they are
-- counted, which admits no one too many.
local function take_permit(set, mark, token, ttl, limit, want_mark, now)
  local held = redis.call('ZCARD', set)
  if held >= limit then
    redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
    held = redis.call('ZCARD', set)
  end
  if held < limit then
    if redis.call('ZADD', set, 'NX', now + ttl, token) == 0 then
      return {1, tonumber(redis.call('ZSCORE', set, token)) - now}
    end
    -- The set lives as long as its longest lease: a set this acquire made
    -- has no expiry yet; else only a later end moves it (GT).
    if held == 0 then
      redis.call('PEXPIRE', set, ttl)
    else
      redis.call('PEXPIRE', set, ttl, 'GT')
    end
    return {1, ttl}
  end
  local mine = redis.call('ZSCORE', set, token)
  if mine then
    return {1, tonumber(mine) - now}
  end
  if want_mark then
    redis.call('SET', mark, '1', 'PX', ttl)
  end
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  return {0, math.max(tonumber(first[2]) - now, 0)}
end

-- Gives `token`'s permit back; publishes with `publish` ("PUBLISH" or
-- "SPUBLISH") on the set's channel when someone waits. `fenced`: a fence
-- was issued to the token. Returns 1 when released, 0 when the token held
-- no permit (its lease ran out and an acquire dropped it, or a resent
-- release's first copy ran). A lease that ran out but is still in the set
-- is released as usual: it was counted as held until now, so no one else
-- has held that permit meanwhile. Usual cost: ZREM, DEL.
local function free_permit(set, mark, fences, token, publish, fenced)
  if redis.call('ZREM', set, token) == 0 then
    return 0
  end
  if fenced then
    redis.call('HDEL', fences, token)
  end
  if redis.call('DEL', mark) == 1 then
    redis.call(publish, set, '')
  end
  return 1
end

-- Ms from `now` until one of `limit` permits of `set` is free: 0 when one
-- is free now.
local function permit_wait(set, limit, now)
  if redis.call('ZCARD', set) < limit then return 0 end
  redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
  if redis.call('ZCARD', set) < limit then return 0 end
  local first = redis.call('ZRANGE', set, 0, 0, 'WITHSCORES')
  return math.max(tonumber(first[2]) - now, 0)
end
