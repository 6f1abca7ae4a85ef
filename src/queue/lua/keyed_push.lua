-- Adds keyed messages to a partition (see keyed.lua); an id that exists
-- already is left as it is (de-duplication, as push.lua).
-- KEYS[1..11]: the partition   ARGV: quintuples (key, limits, id, when,
-- payload): key non-empty without NUL; limits "" (the key's as they are),
-- or "<permits>", "<permits>/<rate>" or "/<rate>": permits "1" (a lock,
-- the default) or more (so many of the key's messages at once), and a rate
-- "<limit>/<period µs>/<burst>/<burst window µs>" (as `Locker::admit`'s:
-- at most <limit> claims in any <period>, <burst> in any <burst window>);
-- `when` as push.lua's (no priority: a key's messages start in push order).
-- Returns per message {added (1|0), due ms (-1 when it is not waiting to be
-- due: in line, at work, or dead)}.
if #ARGV % 5 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be quintuples (key, limits, id, when, payload)')
end

-- Whether `rate` is "<limit>/<period>/<burst>/<window>", all positive, the
-- burst at most the limit.
local function valid_rate(rate)
  local l, p, b, w = string.match(rate, '^([1-9]%d*)/([1-9]%d*)/([1-9]%d*)/([1-9]%d*)$')
  return w and #l <= 7 and #p <= 15 and #w <= 15 and tonumber(b) <= tonumber(l)
end

local now = now_ms()
local dues, permits, rates = {}, {}, {}
for i = 1, #ARGV, 5 do
  local key, id, payload = ARGV[i], ARGV[i + 2], ARGV[i + 4]
  if key == '' or string.find(key, '%z') then
    return redis.error_reply('ERR lockgate push: a key must be non-empty and free of NUL')
  end
  permits[i], rates[i] = string.match(ARGV[i + 1], '^(%d*)/?(.*)$')
  if not permits[i] or (permits[i] ~= '' and not (string.find(permits[i], '^[1-9]%d?%d?%d?%d?%d?%d?$')
      and tonumber(permits[i]) <= 1048576)) then
    return redis.error_reply('ERR lockgate push: permits must be a number from 1 to 1048576')
  end
  if rates[i] ~= '' and not valid_rate(rates[i]) then
    return redis.error_reply('ERR lockgate push: a bad rate "' .. rates[i] .. '"')
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
  local key, id, due = ARGV[i], ARGV[i + 2], dues[i]
  if permits[i] == '1' then
    redis.call('HDEL', KEYS[LIMITS], key)
  elseif permits[i] ~= '' then
    redis.call('HSET', KEYS[LIMITS], key, permits[i])
  end
  if rates[i] ~= '' then redis.call('HSET', KEYS[LIMITS], key .. '\0rate', rates[i]) end
  if redis.call('HSETNX', KEYS[DATA], id, now .. ':0:0:' .. ARGV[i + 4]) == 1 then
    if due <= now then
      enter_line(key, id, now)
    else
      redis.call('HSET', KEYS[KEYOF], id, aside(key, '', tonumber(redis.call('HGET', KEYS[LIMITS], key)) or 1))
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
