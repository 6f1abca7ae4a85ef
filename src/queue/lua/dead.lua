-- Lists dead letters, oldest first.
-- KEYS[1]: data   KEYS[2]: dead   KEYS[3]: errors
-- ARGV[1]: start index   ARGV[2]: stop index (inclusive; -1 for the end)
-- Returns per dead letter {id, buried ms, record or false, error or false}.
local dead = redis.call('ZRANGE', KEYS[2], ARGV[1], ARGV[2], 'WITHSCORES')
local out = {}
for i = 1, #dead, 2 do
  local id = dead[i]
  append(out, id, dead[i + 1], redis.call('HGET', KEYS[1], id), redis.call('HGET', KEYS[3], id))
end
return out
