-- The floor's acknowledgement: per message whose key's lock is still its
-- token's, takes it off its line and lets the key go; a key with more in
-- line is ready now, one without leaves the ready set.
-- KEYS: ready, data, counts, then, for the floor with its keys declared,
-- per message its key's lock and line (else built here)
-- ARGV: key, id, token per message
-- Returns how many were acknowledged.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local ids, gone, again = {}, {}, {}
for m = 1, #ARGV / 3 do
  local key, id, token = ARGV[3 * m - 2], ARGV[3 * m - 1], ARGV[3 * m]
  local lock = KEYS[2 + 2 * m] or 'floor:lock:' .. key
  local line = KEYS[3 + 2 * m] or 'floor:line:' .. key
  if redis.call('GET', lock) == token then
    redis.call('LPOP', line)
    redis.call('DEL', lock)
    ids[#ids + 1] = id
    if redis.call('EXISTS', line) == 1 then
      again[#again + 1], again[#again + 2] = now, key
    else
      gone[#gone + 1] = key
    end
  end
end
if #ids > 0 then
  redis.call('HDEL', KEYS[2], unpack(ids))
  redis.call('HINCRBY', KEYS[3], 'active', -#ids)
end
if #gone > 0 then redis.call('ZREM', KEYS[1], unpack(gone)) end
if #again > 0 then redis.call('ZADD', KEYS[1], unpack(again)) end
return #ids
