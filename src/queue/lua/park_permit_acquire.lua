-- Takes one of a key's permits for a message of the queue, unless messages
-- parked on the key come first: park_acquire.lua for a key with n permits
-- (see parking.lua; the permit functions are in src/lock/permits/permits.lua).
-- KEYS[1]: permits set   KEYS[2]: parked set   KEYS[3]: data   KEYS[4]: dead
-- KEYS[5]: schedule   KEYS[6]: bell   KEYS[7]: prioritized   KEYS[8]: line of waiters
-- ARGV[1]: holder token   ARGV[2]: lease TTL in ms   ARGV[3]: "1" to wait
-- in line when no permit is free, "2" only to leave the line when one is
-- taken, "0" neither   ARGV[4]: id of the message asking ("" for a
-- request that is none)   ARGV[5]: limit, the most holders at a time
-- Returns {1, ms left of the lease} when a permit is (now) ours; {0, ms
-- until a permit frees (0 when one is free), 1 when a parked message goes
-- first, else 0} when not.
local now = now_ms()
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[5])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  -- Ours (handed to us, or a resend whose first copy took it): a whole
  -- lease from now.
  redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ttl, 'GT')
  if ARGV[3] ~= '0' then redis.call('ZREM', KEYS[8], in_line_as(ARGV[1], ARGV[5])) end
  return {1, ttl}
end
local head, dropped = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7], ARGV[4])
if head and head ~= ARGV[4] then
  -- It parks behind them: no place in the line of waiters.
  local wait = permit_wait(KEYS[1], limit, now)
  if dropped then
    -- A new head after dropped ones: due when a permit frees.
    bring_forward(KEYS[5], KEYS[7], KEYS[6], head, now + wait)
  end
  return {0, wait, 1}
end
local taken = take_permit(KEYS[1], KEYS[8], ARGV[1], ttl, limit, ARGV[3], now)
if taken[1] == 0 then
  taken[3] = 0
  return taken
end
if head then -- it is this message: it leaves the parked set
  redis.call('ZREM', KEYS[2], head)
  local next = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7])
  if next then
    -- Due at once while permits are free, else when the first lease ends
    -- (the release that frees one brings it forward).
    bring_forward(KEYS[5], KEYS[7], KEYS[6], next, now + permit_wait(KEYS[1], limit, now))
  end
end
return taken
