-- Adds keyed messages to a partition (see keyed.lua); an id that exists
-- already is left as it is (de-duplication, as push.lua).
-- KEYS[1..10]: the partition   ARGV: quadruples (key, id, when, payload):
-- key non-empty without NUL; `when` as push.lua's (no priority: a key's
-- messages start in push order).
-- Returns per message {added (1|0), due ms (-1 when it is not waiting to be
-- due: in line, at work, or dead)}.
if #ARGV % 4 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be quadruples (key, id, when, payload)')
end
local now = now_ms()
local dues = {}
for i = 1, #ARGV, 4 do
  local key, id, payload = ARGV[i], ARGV[i + 1], ARGV[i + 3]
  if key == '' or string.find(key, '%z') then
    return redis.error_reply('ERR lockgate push: a key must be non-empty and free of NUL')
  end
  if id == '' then return redis.error_reply('ERR lockgate push: an empty id') end
  if string.find(payload, '^%d+:') then
    return redis.error_reply('ERR lockgate push: a payload starting with digits and a colon')
  end
  dues[i] = parse_when(now, ARGV[i + 2])
  if not dues[i] then
    return redis.error_reply('ERR lockgate push: a bad `when` "' .. ARGV[i + 2] .. '"')
  end
end
local out = {}
for i = 1, #ARGV, 4 do
  local key, id, due = ARGV[i], ARGV[i + 1], dues[i]
  if redis.call('HSETNX', KEYS[DATA], id, now .. ':0:0:' .. ARGV[i + 3]) == 1 then
    if due <= now then
      enter_line(key, id, now)
    else
      redis.call('HSET', KEYS[KEYOF], id, key)
      redis.call('ZADD', KEYS[SCHEDULE], due, id)
    end
    out[#out + 1] = 1
    out[#out + 1] = due
  else
    out[#out + 1] = 0
    out[#out + 1] = tonumber(redis.call('ZSCORE', KEYS[SCHEDULE], id)) or -1
  end
end
return out
