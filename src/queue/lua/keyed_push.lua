-- Adds keyed messages to a partition (see keyed.lua); an id that exists
-- already is left as it is (de-duplication, as push.lua).
-- KEYS[1..11]: the partition   ARGV: quintuples (key, permits, id, when,
-- payload): key non-empty without NUL; permits "" (the key's as it is: a
-- lock unless a message in line said otherwise), "1" (a lock) or more (so
-- many of the key's messages at once); `when` as push.lua's (no priority:
-- a key's messages start in push order).
-- Returns per message {added (1|0), due ms (-1 when it is not waiting to be
-- due: in line, at work, or dead)}.
if #ARGV % 5 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be quintuples (key, permits, id, when, payload)')
end
local now = now_ms()
local dues = {}
for i = 1, #ARGV, 5 do
  local key, permits, id, payload = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 4]
  if key == '' or string.find(key, '%z') then
    return redis.error_reply('ERR lockgate push: a key must be non-empty and free of NUL')
  end
  if permits ~= '' and not (string.find(permits, '^[1-9]%d?%d?%d?%d?%d?%d?$')
      and tonumber(permits) <= 1048576) then
    return redis.error_reply('ERR lockgate push: permits must be a number from 1 to 1048576')
  end
  if id == '' then return redis.error_reply('ERR lockgate push: an empty id') end
  if string.find(payload, '^%d+:') then
    return redis.error_reply('ERR lockgate push: a payload starting with digits and a colon')
  end
  dues[i] = parse_when(now, ARGV[i + 3])
  if not dues[i] then
    return redis.error_reply('ERR lockgate push: a bad `when` "' .. ARGV[i + 3] .. '"')
  end
end
local out = {}
for i = 1, #ARGV, 5 do
  local key, permits, id, due = ARGV[i], ARGV[i + 1], ARGV[i + 2], dues[i]
  if permits == '1' then
    redis.call('HDEL', KEYS[LIMITS], key)
  elseif permits ~= '' then
    redis.call('HSET', KEYS[LIMITS], key, permits)
  end
  if redis.call('HSETNX', KEYS[DATA], id, now .. ':0:0:' .. ARGV[i + 4]) == 1 then
    if due <= now then
      enter_line(key, id, now)
    else
      redis.call('HSET', KEYS[KEYOF], id, aside(key, '', tonumber(permits) or 1))
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
