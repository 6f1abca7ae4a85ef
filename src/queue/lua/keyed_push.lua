-- Adds keyed messages to a partition (see keyed.lua); an id that exists
-- already under the same key is left as it is (de-duplication, as
-- push.lua); under another key it is another message.
-- KEYS[1..13]: the partition   ARGV: quintuples (key, limits, id, when,
-- payload): key non-empty without NUL; limits "" (the key's as they are),
-- or "<permits>", "<permits>/<rate>" or "/<rate>": permits n (so many of
-- the key's messages at once, each with one of the key's permits; without,
-- one at a time with the key's lock), and a rate
-- "<limit>/<period µs>/<burst>/<burst window µs>" (as `Locker::admit`'s:
-- at most <limit> claims in any <period>, <burst> in any <burst window>);
-- `when` as push.lua's (no priority: a key's messages start in push order);
-- key and id UTF-8 (every reader takes them for strings).
-- Returns one flat list, two entries per message in order,
-- {added1, due1, added2, due2, ...}: added 1 and the due ms of a new
-- message (at or before now: it is in line at once), or 0 for an id there
-- already (left as it is) and its due ms while it waits to be due, else -1
-- (in line, at work, or dead).
-- Bad arguments are refused before anything is written, with an error reply
-- starting "lockgate push:" that names the message and the argument.
if #ARGV % 5 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be quintuples (key, limits, id, when, payload), got '
    .. #ARGV .. ' arguments')
end

-- Refuses message `n`'s arguments, naming its key and id when given.
local function refuse(n, key, id, why)
  local named = ''
  if key then named = ' (key "' .. key .. '"' .. (id and (', id "' .. id .. '"') or '') .. ')' end
  return redis.error_reply('ERR lockgate push: message ' .. n .. named .. ' has ' .. why)
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
  local n, key, limits, id, payload = (i - 1) / 5 + 1, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 4]
  if key == '' or string.find(key, '%z') or not is_utf8(key) then
    return refuse(n, nil, nil, 'a key that is empty, holds NUL or is not UTF-8')
  end
  if id == '' then return refuse(n, key, nil, 'an empty id') end
  if not is_utf8(id) then return refuse(n, key, nil, 'an id that is not UTF-8') end
  permits[i], rates[i] = string.match(limits, '^(%d*)/?(.*)$')
  local bad_permits = permits[i] ~= '' and not (string.find(permits[i], '^[1-9]%d?%d?%d?%d?%d?%d?$')
      and tonumber(permits[i]) <= 1048576)
  local bad_rate = rates[i] ~= '' and not valid_rate(rates[i])
  if bad_permits or bad_rate or (rates[i] == '' and string.find(limits, '/')) then
    return refuse(n, key, id, 'bad limits "' .. limits .. '": expected "" (as they are), '
      .. '"<permits 1-1048576>", "<permits>/<rate>" or "/<rate>", '
      .. 'a rate being "<limit>/<period us>/<burst>/<window us>"')
  end
  if string.find(payload, '^%d+:') then
    return refuse(n, key, id, 'a payload starting with digits and a colon: not JSON')
  end
  dues[i] = parse_when(now, ARGV[i + 3])
  if not dues[i] then
    return refuse(n, key, id, 'a bad `when` "' .. ARGV[i + 3]
      .. '": expected a delay in ms or "@<unix ms>" (no priority)')
  end
end
local out = {}
for i = 1, #ARGV, 5 do
  local key, id, due = ARGV[i], stored_id(ARGV[i], ARGV[i + 2]), dues[i]
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
