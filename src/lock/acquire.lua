-- Takes a lock when it is free and hands out the key's next fencing token.
-- KEYS[1]: lock key                 <prefix>:lock:{<key>}    value <token>:<fence>
-- KEYS[2]: fence record (tombstone) <prefix>:fence:{<key>}   value <fence>:<token>
--          (same hash slot; left by release.lua for a short grace period)
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- Returns {1, fence, ttl left in ms} when acquired (also when the lock is
-- already held by this very token: a resent acquire whose first copy ran;
-- then with that copy's fence and the TTL it has left), {0, pttl of the
-- current holder} when not.
--
-- The fence is the server clock in microseconds, or one past the fence of
-- the last release when that is still on record and not below the clock:
--   fence = max(now, last + 1).
-- No counter survives the lock: a held lock carries its fence in its value,
-- a released one leaves its fence in the tombstone for the grace period, an
-- expired one leaves nothing. Fences therefore increase as long as the
-- clock (after a failover: the new primary's clock) does not step back by
-- more than the time since the previous acquisition; a rolled-back counter
-- cannot hand out an old number again, because there is none.
-- 2^53 microseconds is year 2255: Lua numbers stay exact; %.0f prints them
-- without an exponent.
-- Usual cost: TIME, GET, SET NX GET (and DEL of a tombstone found).
local t = redis.call('TIME')
local fence = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tomb = redis.call('GET', KEYS[2])
local last = tomb and tonumber(string.match(tomb, '^%d+'))
if last and last >= fence then
  fence = last + 1
end
-- SET NX GET (Redis >= 7.0): sets and returns false when the key was free,
-- else changes nothing and returns the holder's value.
local held = redis.call('SET', KEYS[1], ARGV[1] .. ':' .. string.format('%.0f', fence),
  'NX', 'PX', ARGV[2], 'GET')
if not held then
  -- The lock now carries the fence: while it is held it is the only key.
  if tomb then
    redis.call('DEL', KEYS[2])
  end
  return {1, fence, tonumber(ARGV[2])}
end
-- A resend of our own acquire whose first copy ran: the lock is ours, with
-- the fence that first copy handed out, and only the TTL it has left (the
-- caller's deadline must not outlive the server's).
local n = #ARGV[1]
if string.sub(held, 1, n + 1) == ARGV[1] .. ':' then
  local own = tonumber(string.sub(held, n + 2))
  if own then
    return {1, own, redis.call('PTTL', KEYS[1])}
  end
end
return {0, redis.call('PTTL', KEYS[1])}
