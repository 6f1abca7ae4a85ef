-- A key's permits (see mod.rs), as functions prepended to acquire.lua,
-- release.lua and the keyed queue's scripts, so both take and give back
-- permits alike. Keys:
--   set     zset  holder token -> the end of its lease (server ms)
--   line    zset  waiters that listen for a release, "<token>/<limit>" ->
--                 when they first waited (server µs)
--   fences  hash  holder token -> its fence, "last" -> the last fence issued

-- The line member of a waiter: its token and the limit it asks under.
local function in_line_as(token, limit)
  return token .. '/' .. limit
end

-- Leases that ran out stay in the set until a full set needs their room.
-- At most PERMITS_TRIM of them are removed per call, the oldest first (a
-- set of a huge permit count can hold that many, and a script blocks its
-- server while it runs); those left are counted (ZCOUNT, O(log n)) and
-- stepped over by rank. Work per call: O(log n + PERMITS_TRIM).
local PERMITS_TRIM = 100

-- Removes up to PERMITS_TRIM of `set`'s leases that ran out by `now`;
-- returns how many that ran out are left in it (its lowest ranks).
local function drop_expired(set, now)
  local expired = redis.call('ZCOUNT', set, '-inf', now)
  local dropped = math.min(expired, PERMITS_TRIM)
  if dropped > 0 then redis.call('ZREMRANGEBYRANK', set, 0, dropped - 1) end
  return expired - dropped
end

-- Takes one of `limit` permits of `set` for `token`, leased for `ttl` ms
-- from `now`. `mode`: "1" to join the key's line when none is free (keeping
-- an earlier place), "2" only to leave it when a permit is taken (a waiter
-- that cannot hear releases now), "0" neither.
-- Returns {1, ms left of the lease} when a permit is (now) the token's: one
-- was free, it was handed to the token, or the token holds one already (a
-- resend); {0, ms until the first holder's lease ends} when none is free.
-- Usual cost: ZCARD, ZADD, PEXPIRE. A full set first drops the leases that
-- ran out (see drop_expired) and counts again: until then they count, which
-- admits no one too many.
local function take_permit(set, line, token, ttl, limit, mode, now)
  local size = redis.call('ZCARD', set)
  local held, expired = size, 0
  if held >= limit then
    expired = drop_expired(set, now)
    held = redis.call('ZCARD', set) - expired
  end
  local took = held < limit and redis.call('ZADD', set, 'NX', now + ttl, token) == 1
  if not took then
    -- Ours: handed to us for a moment, or a resend. A whole lease from now.
    -- (In a full set, a lease of ours that ran out is not: it is one of the
    -- expired ones a full set would have dropped.)
    local score = redis.call('ZSCORE', set, token)
    if score and (held < limit or tonumber(score) > now) then
      redis.call('ZADD', set, 'XX', now + ttl, token)
      took = true
    end
  end
  if took then
    -- The set lives as long as its longest lease: a set this acquire made
    -- has no expiry yet (NX); else only a later end moves it (GT).
    redis.call('PEXPIRE', set, ttl, size == 0 and 'NX' or 'GT')
    if mode ~= '0' then redis.call('ZREM', line, in_line_as(token, limit)) end
    return {1, ttl}
  end
  -- The first lease to end among those that have not ended yet.
  local first = tonumber(redis.call('ZRANGE', set, expired, expired, 'WITHSCORES')[2])
  if mode == '1' then
    local t = redis.call('TIME')
    redis.call('ZADD', line, 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]),
      in_line_as(token, limit))
    -- The line outlives the first lease by a TTL: waiters that died leave
    -- it with it. (Each waiter that joins or tries again pushes it on.)
    redis.call('PEXPIRE', line, math.max(first - now, 0) + ttl)
  end
  return {0, math.max(first - now, 0)}
end

-- Gives `token`'s permit back. It is handed to the first of the line's
-- first LINE_LOOK waiters whose own limit the remaining holders leave room
-- for; the waiters of dead processes among them leave the line (see
-- line.lua, prepended): leased to it for `handoff` ms (its next try, or its
-- watchdog, makes that a whole lease), its token published with `publish`
-- on the set's channel. When none can take it, an empty publish wakes every
-- waiter. `fenced`: a fence was issued to the token. A token that holds no
-- permit leaves the line it stood in under `limit` (a waiter that gave up).
-- Returns 1 when released, 2 when released and handed on, 0 when the token
-- held no permit (an acquire dropped its lease that ran out, or a resent
-- release's first copy ran). A lease that ran out but is still in the set
-- is released as usual: it counted as held until now, so no one else has
-- held that permit meanwhile.
-- Usual cost: ZREM, ZRANGE (a hand-off: ZREM, ZCARD, PUBSUB NUMSUB per
-- process of the waiters looked at, a ZREM per dead one, TIME, ZADD, PTTL
-- and a publish too).
local function free_permit(set, line, fences, token, limit, publish, fenced, handoff)
  if redis.call('ZREM', set, token) == 0 then
    redis.call('ZREM', line, in_line_as(token, limit))
    return 0
  end
  if fenced then
    redis.call('HDEL', fences, token)
  end
  local waiting = redis.call('ZRANGE', line, 0, LINE_LOOK - 1)
  if #waiting == 0 then
    return 1
  end
  redis.call('ZREM', line, in_line_as(token, limit)) -- never to ourselves
  local held = redis.call('ZCARD', set)
  local alive = {}
  for _, member in ipairs(waiting) do
    local waiter, allowed = string.match(member, '^(.*)/(%d+)$')
    -- (A member that is no waiter's, the queue's mark, is passed over.)
    if waiter and not lives(alive, set, member, publish) then
      redis.call('ZREM', line, member) -- its process died
    elseif waiter and waiter ~= token and held < tonumber(allowed) then
      redis.call('ZREM', line, member)
      local t = redis.call('TIME')
      local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      -- NX: a waiter that holds a permit already (it took one without
      -- the line) is not handed a second; the next one is.
      if redis.call('ZADD', set, 'NX', now + handoff, waiter) == 1 then
        if redis.call('PTTL', set) < handoff then
          redis.call('PEXPIRE', set, handoff)
        end
        redis.call(publish, set, waiter)
        return 2
      end
    end
  end
  redis.call(publish, set, '')
  return 1
end

-- Ms from `now` until one of `limit` permits of `set` is free: 0 when one
-- is free now.
local function permit_wait(set, limit, now)
  if redis.call('ZCARD', set) < limit then return 0 end
  local expired = drop_expired(set, now)
  if redis.call('ZCARD', set) - expired < limit then return 0 end
  local first = redis.call('ZRANGE', set, expired, expired, 'WITHSCORES')
  return math.max(tonumber(first[2]) - now, 0)
end
