-- Tries once more to take a lock that a plain `SET NX PX` found set (held
-- by another holder, by a first copy of the same request (a resend), or
-- handed to this very waiter by a release: see release.lua), and reports
-- how long its holder still has.
-- KEYS[1]: lock key   <prefix>:lock:{<key>}, value "<token>[:<fence>][!]"
-- KEYS[2]: waiters    <prefix>:lock:{<key>}:waiters, a zset: the tokens of
--                     the waiters that listen for the release, scored by
--                     when they first waited (server µs): a release hands
--                     the lock to the first of them
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- ARGV[3]: "1" to wait in line for the lock: mark it ("!" at the end of its
--          value), so that its release hands it on (see release.lua), and
--          join the waiters (keeping the place of an earlier try); "2" not to
--          join, but to leave the line when the lock is taken (a waiter that
--          joined before and cannot hear releases now); "0" neither.
-- Returns {1, ttl left in ms} when the lock is (now) ours: it was free, it
-- was handed to us, or it holds our own token (a resent acquire whose first
-- copy ran); {0, pttl of the current holder} when not.
-- Usual cost: SET, then ZREM (taken) or PTTL (busy); when waiting in line,
-- ZADD and PEXPIRE too (and APPEND once per holder).
local held = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2], 'GET')
if not held then
  if ARGV[3] ~= '0' then redis.call('ZREM', KEYS[2], ARGV[1]) end
  return {1, tonumber(ARGV[2])}
end
local n = #ARGV[1]
local after = string.byte(held, n + 1)
if string.sub(held, 1, n) == ARGV[1] and (after == nil or after == 58 or after == 33) then
  -- Ours: handed to us for a moment (see release.lua), or a resend. It
  -- lives a whole TTL from now.
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
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
