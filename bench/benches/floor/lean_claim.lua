-- The lean layout's claim (see mod.rs, `work_lean`): the declared floor
-- (claim_declared.lua) with the keyed queue's duties a lone key's turn
-- pays: runs of a key's first messages under one lock, recovery of a dead
-- worker's keys, a resend record per call, the counts and the earliest
-- ready time per call.
-- A key's state is its score in `keys`: ready from a time (ms, below
-- BUSY), or at work until its lease deadline (BUSY + ms): a key whose
-- lease ran out is due again, and the claim that finds its lock free
-- takes its head again, a stall (no sweep: the claims recover).
-- A key's line is a sorted set of its own (id -> push order); a message
-- at work stays at its head until settled.
-- Also per call, as the keyed claim: the candidates' limits read in one
-- command (a key with permits or a rate would take the keyed queue's
-- slower path; none has any here), and the head of the delayed messages.
-- KEYS: keys, data, counts, oldest, this call's record, limits, schedule,
-- then per candidate its lock and its line
-- ARGV: lease ms, most turns, most messages per turn (a run), token
-- prefix (a turn's token is prefix .. n), how many keys to name for the
-- next call, a number drawn at random, then the candidates' keys
-- Returns {the keys named for the next call, {key, token, stalled (0/1),
-- then per message of its run: id, record; "" ends the run, per turn}}.
local BUSY = 70000000000000
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease, most, run = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local deadline = now + lease
local candidates = {}
for i = 7, #ARGV do candidates[#candidates + 1] = ARGV[i] end
-- A resend (the first call's reply was lost) answers the turns the first
-- call took that still hold, from its record, and takes nothing more.
local kept = redis.call('GET', KEYS[5])
if kept then
  local again = {}
  for i, token in string.gmatch(kept, '(%d+)=([^;]*);') do
    local value = redis.call('GET', KEYS[6 + 2 * tonumber(i)])
    if value == token then
      local heads = redis.call('ZRANGE', KEYS[7 + 2 * tonumber(i)], 0, run - 1)
      local records = #heads > 0 and redis.call('HMGET', KEYS[2], unpack(heads)) or {}
      local n = #again
      again[n + 1], again[n + 2], again[n + 3] = candidates[tonumber(i)], token, 0
      for h, id in ipairs(heads) do
        again[#again + 1], again[#again + 2] = id, records[h] or ''
      end
      again[#again + 1] = ''
    end
  end
  return {{}, again}
end
-- The call's claim number: a turn's token is its own, never reused.
local claim = redis.call('HINCRBY', KEYS[3], 'claims', 1)
local froms = #candidates > 0 and redis.call('ZMSCORE', KEYS[1], unpack(candidates)) or {}
-- A key's limits in one field (its permits and its rate), read for every
-- candidate in one command.
local limits = #candidates > 0 and redis.call('HMGET', KEYS[6], unpack(candidates)) or {}
-- The delayed messages' head, read as the keyed claim reads it to move
-- the due ones into their lines (none is delayed here: the read's cost
-- is what this side measures).
redis.call('ZRANGE', KEYS[7], 0, 0, 'WITHSCORES')
local turns, busy, gone, ids, stalls = {}, {}, {}, {}, {}
local seen = {}
for i, key in ipairs(candidates) do
  if #turns >= most then break end
  local from = tonumber(froms[i])
  local limited = limits[i]
  local due = from and not seen[key] and not limited and (from <= now or (from >= BUSY and from - BUSY <= now))
  if due then
    seen[key] = true
    local token = ARGV[4] .. claim .. ':' .. i
    if redis.call('SET', KEYS[6 + 2 * i], token, 'NX', 'PX', lease) then
      -- After a stall, one message at a time until one is acknowledged:
      -- the one that killed its worker is the head.
      local heads = redis.call('ZRANGE', KEYS[7 + 2 * i], 0, from >= BUSY and 0 or run - 1)
      if #heads == 0 then
        redis.call('DEL', KEYS[6 + 2 * i])
        gone[#gone + 1] = key
      else
        turns[#turns + 1] = {key, token, from >= BUSY and 1 or 0, heads, i}
        busy[#busy + 1], busy[#busy + 2] = BUSY + deadline, key
        for _, id in ipairs(heads) do ids[#ids + 1] = id end
        if from >= BUSY then stalls[#stalls + 1] = heads[1] end
      end
    else
      -- Held by other code: looked at again when its hold ends, in the
      -- band of keys at work (a lapsed one's stall is still to count).
      local pttl = redis.call('PTTL', KEYS[6 + 2 * i])
      if pttl < 0 then pttl = lease end
      busy[#busy + 1], busy[#busy + 2] = (from >= BUSY and BUSY or 0) + now + pttl, key
    end
  end
end
local claimed = {}
if #ids > 0 then
  local records = redis.call('HMGET', KEYS[2], unpack(ids))
  local n = 0
  for _, turn in ipairs(turns) do
    claimed[#claimed + 1], claimed[#claimed + 2], claimed[#claimed + 3] = turn[1], turn[2], turn[3]
    for _, id in ipairs(turn[4]) do
      n = n + 1
      claimed[#claimed + 1], claimed[#claimed + 2] = id, records[n] or ''
    end
    claimed[#claimed + 1] = ''
  end
  -- A stalled head's record counts it (the record's own format would
  -- raise its stall count; here a field of its own).
  for _, id in ipairs(stalls) do redis.call('HINCRBY', KEYS[3], 'stalls', 1) end
  redis.call('HINCRBY', KEYS[3], 'active', #ids)
  local record = {}
  for _, turn in ipairs(turns) do record[#record + 1] = turn[5] .. '=' .. turn[2] .. ';' end
  redis.call('SET', KEYS[5], table.concat(record), 'PX', lease)
end
if #busy > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(busy)) end
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('HINCRBY', KEYS[3], 'keys', -#gone)
end
-- Named for the next call from a place of the caller's own, as the
-- declared floor's; and keys whose lease ran out, which recovery takes.
local names = tonumber(ARGV[5])
local skip = tonumber(ARGV[6]) % (2 * names)
local first = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. BUSY, 'WITHSCORES', 'LIMIT', 0, 1)
local next = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', skip, names)
if skip > 0 and #next < names then
  next = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, names)
end
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], BUSY, BUSY + now, 'LIMIT', 0, 4)
for _, key in ipairs(lapsed) do next[#next + 1] = key end
-- The earliest ready time, kept for readers.
if first[2] then
  redis.call('ZADD', KEYS[4], first[2], KEYS[1])
else
  redis.call('ZREM', KEYS[4], KEYS[1])
end
return {next, claimed}
