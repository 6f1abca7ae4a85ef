-- The floor's claim: the heads of up to ARGV[2] ready keys, each with its
-- key's lock. The lock is the lease: a message at work stays at the head
-- of its key's line until acknowledged, and a key whose lock ran out is
-- ready again (its ready score is when to look next).
-- KEYS: ready (zset key -> when to look), data (hash id -> payload), counts
-- ARGV: lease ms, most keys, token prefix (each key's token is prefix .. n)
-- Returns key, id, token, payload per message claimed.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local keys = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[2])
local claimed, looks = {}, {}
local deadline = now + tonumber(ARGV[1])
for i, key in ipairs(keys) do
  local token = ARGV[3] .. i
  if redis.call('SET', 'floor:lock:' .. key, token, 'NX', 'PX', ARGV[1]) then
    local id = redis.call('LINDEX', 'floor:line:' .. key, 0)
    if id then
      local n = #claimed
      claimed[n + 1], claimed[n + 2], claimed[n + 3] = key, id, token
      claimed[n + 4] = redis.call('HGET', KEYS[2], id)
    end
  end
  -- Held (here or elsewhere): looked at again when its lease ends.
  looks[2 * i - 1], looks[2 * i] = deadline, key
end
if #looks > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(looks)) end
if #claimed > 0 then redis.call('HINCRBY', KEYS[3], 'active', #claimed / 4) end
return claimed
