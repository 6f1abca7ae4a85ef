-- Adds keyed messages to a partition, or to several in one call (see
-- keyed.lua); an id that exists already under the same key is left as it
-- is (de-duplication, as push.lua); under another key it is another
-- message.
-- KEYS[1..13]: the partition's keys but `leases` (PUSH_KEYS); or 13 keys
-- for each of n partitions, in turn (all on one server: a cluster refuses
-- keys of several slots)
-- ARGV: with n partitions, first n counts, how many of the quintuples
-- that follow go to each partition, in KEYS' order (with one partition,
-- no count: every quintuple goes to it); then quintuples (key, limits,
-- id, when, payload), each in the partition of its key's lock (the
-- caller's to choose): key non-empty without NUL; limits "" (the key's
-- as they are), or "<permits>", "<permits>/<rate>" or "/<rate>": permits n (so many of
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
-- The library calls `main` as a function (see `function` in
-- src/queue/keyed.rs); scripts/push_keyed.lua, for producers in other
-- languages, is the same source as a script that returns `main()`.
local function main()
  local partitions = #KEYS / PUSH_KEYS
  if partitions < 1 or #KEYS % PUSH_KEYS ~= 0 then
    return redis.error_reply('ERR lockgate push: keys must be ' .. PUSH_KEYS
      .. ' per partition, got ' .. #KEYS)
  end
  -- Where each partition's quintuples end (ARGV positions), and the first.
  local ends, first = {}, 1
  if partitions > 1 then
    first = partitions + 1
    for p = 1, partitions do
      local n = ARGV[p]
      if not (n and string.find(n, '^%d%d?%d?%d?%d?%d?$')) then
        return redis.error_reply('ERR lockgate push: argument ' .. p
          .. ' must be how many messages partition ' .. p .. ' takes (0-999999)')
      end
      ends[p] = (ends[p - 1] or partitions) + 5 * tonumber(n)
    end
  else
    ends[1] = #ARGV
  end
  if ends[partitions] ~= #ARGV or (#ARGV - first + 1) % 5 ~= 0 then
    return redis.error_reply('ERR lockgate push: arguments must be quintuples (key, limits, id, when, payload)'
      .. (partitions > 1 and ', as many as the counts say' or '') .. ', got ' .. (#ARGV - first + 1)
      .. ' arguments' .. (partitions > 1 and (' after ' .. (first - 1) .. ' counts') or ''))
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
  for i = first, #ARGV, 5 do
    local n, key, limits, id, payload = (i - first) / 5 + 1, ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 4]
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
  local out, p = {}, 1
  for i = first, #ARGV, 5 do
    while i > ends[p] do
      p = p + 1
      enter_partition((p - 1) * PUSH_KEYS, PUSH_KEYS)
    end
    local key, id, due = ARGV[i], stored_id(ARGV[i], ARGV[i + 2]), dues[i]
    set_limits(key, permits[i], rates[i])
    if redis.call('HSETNX', K[DATA], id, now .. ':0:0:' .. ARGV[i + 4]) == 1 then
      place(key, id, due, now)
      out[#out + 1] = 1
      out[#out + 1] = due
    else
      out[#out + 1] = 0
      out[#out + 1] = tonumber(redis.call('ZSCORE', K[SCHEDULE], id)) or -1
    end
  end
  return out
end
