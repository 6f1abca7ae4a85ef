-- Adds keyed messages to a partition (see keyed.lua); an id that exists
-- already is left as it is (de-duplication, as push.lua).
-- KEYS[1..11]: the partition   ARGV: quintuples (key, limits, id, when,
-- payload): key non-empty without NUL; limits "" (the key's as they are),
-- or "<permits>", "<permits>/<rate>" or "/<rate>": permits n (so many of
-- the key's messages at once, each with one of the key's permits; without,
-- one at a time with the key's lock), and a rate
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
  set_limits(key, permits[i], rates[i])
  if redis.call('HSETNX', KEYS[DATA], id, now .. ':0:0:' .. ARGV[i + 4]) == 1 then
    place(key, id, due, now)
    out[#out + 1] = 1
    out[#out + 1] = due
  else
    out[#out + 1] = 0
    out[#out + 1] = tonumber(redis.call('ZSCORE', KEYS[SCHEDULE], id)) or -1
  end
end
return out
