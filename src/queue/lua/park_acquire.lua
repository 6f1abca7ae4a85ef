-- Takes a key's lock for a message of the queue, unless messages parked on
-- the key come first (see parking.lua).
-- KEYS[1]: lock   KEYS[2]: parked set   KEYS[3]: data   KEYS[4]: dead
-- KEYS[5]: schedule   KEYS[6]: bell   KEYS[7]: prioritized
-- ARGV[1]: holder token   ARGV[2]: lock TTL in ms
-- ARGV[3]: "1" to mark the lock as waited for (its release publishes)
-- ARGV[4]: id of the message asking ("" for a request that is none)
-- Returns {1, ttl left in ms} when acquired (also when the lock already holds
-- this token: a resend); {0, pttl of the holder (0 when the lock is free),
-- 1 when a parked message goes first, else 0} when not.
local held = redis.call('GET', KEYS[1])
if held and owns(held, ARGV[1]) then
  return {1, redis.call('PTTL', KEYS[1])}
end
local head, dropped = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7], ARGV[4])
if held or (head and head ~= ARGV[4]) then
  local pttl = 0
  if held then
    pttl = redis.call('PTTL', KEYS[1])
    if ARGV[3] == '1' and string.byte(held, -1) ~= 33 then
      redis.call('APPEND', KEYS[1], '!')
    end
  end
  if dropped and head then
    -- A new head after dropped ones: due when the lock ends.
    bring_forward(KEYS[5], KEYS[7], KEYS[6], head, now_ms() + math.max(pttl, 0))
  end
  local ahead = 0
  if head and head ~= ARGV[4] then ahead = 1 end
  return {0, pttl, ahead}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if head then -- it is this message: it leaves the parked set
  redis.call('ZREM', KEYS[2], head)
  local next = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7])
  if next then
    bring_forward(KEYS[5], KEYS[7], KEYS[6], next, now_ms() + tonumber(ARGV[2]))
  end
end
return {1, tonumber(ARGV[2])}
