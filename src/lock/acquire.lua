-- Takes a lock when it is free and hands out the key's next fencing token.
-- KEYS[1]: lock key   <prefix>:lock:{<key>}
--          held:     "<token>:<fence>", PX the lock's TTL
--          released: "~<fence>:<token>", PX the grace period (a tombstone:
--                    release.lua leaves it; the lock is free)
-- ARGV[1]: holder token (random; identifies this holder)
-- ARGV[2]: lock TTL in milliseconds
-- Returns {1, fence, ttl left in ms} when acquired (also when the lock is
-- already held by this very token: a resent acquire whose first copy ran;
-- then with that copy's fence and the TTL it has left), {0, pttl of the
-- current holder} when not.
--
-- The fence is the server clock in microseconds, or one past the fence of a
-- tombstone when that is not below the clock: fence = max(now, last + 1).
-- No counter outlives the lock: a held lock carries its fence in its value,
-- a released one keeps it in the tombstone for the grace period, an expired
-- one leaves nothing. Fences therefore increase as long as the clock (after
-- a failover: the new primary's clock) does not step back by more than the
-- time since the previous acquisition; a rolled-back counter cannot hand out
-- an old number again, because there is none. The clock gives whole
-- microseconds as a string; 2^53 µs is year 2255, so Lua numbers compare
-- them exactly, and %.0f prints them without an exponent.
-- Usual cost: GET, TIME, SET.
local held = redis.call('GET', KEYS[1])
if held and string.byte(held, 1) ~= 126 then -- not a tombstone ('~')
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
end
local t = redis.call('TIME')
local fence = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
if held then
  local last = tonumber(string.match(held, '^~(%d+)'))
  if last and last >= tonumber(fence) then
    fence = string.format('%.0f', last + 1)
  end
end
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. fence, 'PX', ARGV[2])
return {1, tonumber(fence), tonumber(ARGV[2])}
