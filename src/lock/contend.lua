-- Tries once more to take a lock that a plain `SET NX PX` found set (held
-- by another holder, by a first copy of this request, or handed to this
-- waiter by a release: see release.lua); reports how long its holder has.
-- KEYS: lock <prefix>:lock:{<key>}, value "<token>[:<fence>][!]"; waiters
--   <lock>:waiters, a zset of the tokens of waiters that listen for the
--   release, scored by when they first waited (server µs).
-- ARGV: holder token (random), lock TTL in ms, line: "1" to wait in line
--   (mark the lock with a final "!" so that its release hands it on, and
--   join the waiters, keeping an earlier place), "2" only to leave the line
--   when the lock is taken (a waiter that cannot hear releases now), "0"
--   neither.
-- Returns {1, ttl left in ms} when the lock is (now) ours: it was free,
-- handed to us, or holds our token (a resend); else {0, holder's pttl}.
-- Usual cost: SET, then ZREM (taken) or PTTL (busy); in line, ZADD and
-- PEXPIRE too (and APPEND once per holder).
local held = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if not held or holds(held, ARGV[1]) then -- see holds.lua, prepended
  -- Free, or ours: handed to us for a moment (see release.lua), or a
  -- resend. It lives a whole TTL from now.
  if held then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
  if ARGV[3] ~= '0' then redis.call('ZREM', KEYS[2], ARGV[1]) end
  return {1, tonumber(ARGV[2])}
end
local pttl = redis.call('PTTL', KEYS[1])
if ARGV[3] == '1' then
  if string.byte(held, -1) ~= 33 then -- not marked yet ('!')
    redis.call('APPEND', KEYS[1], '!')
  end
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[2], 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]), ARGV[1])
  -- The line outlives the holder by a TTL: waiters that died leave it with
  -- it. (Each waiter that joins or tries again pushes it on.)
  redis.call('PEXPIRE', KEYS[2], math.max(pttl, 0) + tonumber(ARGV[2]))
end
return {0, pttl}
