-- Lists dead letters, oldest first.
-- KEYS: data, dead, errors; ARGV: start, stop index (inclusive; -1: the end)
-- Returns per dead letter {id, buried ms, record or false, error or false}.
local dead = redis.call('ZRANGE', KEYS[2], ARGV[1], ARGV[2], 'WITHSCORES')
local out = {}
for i = 1, #dead, 2 do
  local id = dead[i]
  append(out, id, dead[i + 1], redis.call('HGET', KEYS[1], id), redis.call('HGET', KEYS[3], id))
end
return out
