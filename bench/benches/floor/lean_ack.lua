-- The lean layout's acknowledgement (see lean_claim.lua): per turn whose
-- lock is still its token's, takes its handled messages off the head of
-- its key's line and either hands the key over to its next messages under
-- the same lock (a run, leased anew) or lets the key go: ready now if its
-- line has more, else gone. The counts, the earliest ready time and a
-- resend record once per call.
-- KEYS: keys, data, counts, oldest, this call's record, then per turn its
-- key's lock and line
-- ARGV: the next run's lease in ms ("" to let go), most messages per
-- run, then per turn: its key, its token, how many messages it handled,
-- their ids
-- Returns per turn {key, 0 (its lock lost), 1 (let go), or 2 and then
-- id, record per message of its next run}.
local BUSY = 70000000000000
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local lease, run = ARGV[1], tonumber(ARGV[2])
-- A resend (the first call's reply was lost): what the first call did.
local kept = redis.call('GET', KEYS[5])
if kept then return {{'', 'resent', kept}} end
-- Whether a lock value "<token>[:<fence>][!]" is `token`'s.
local function owns(value, token)
  if not value then return false end
  local after = string.byte(value, #token + 1)
  return string.sub(value, 1, #token) == token and (after == nil or after == 58 or after == 33)
end
local done, nexts, ready, busy, gone, replies = {}, {}, {}, {}, {}, {}
local at, turn = 3, 0
while at <= #ARGV do
  turn = turn + 1
  local key, token, n = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
  local lock, line = KEYS[4 + 2 * turn], KEYS[5 + 2 * turn]
  at = at + 3 + n
  local value = redis.call('GET', lock)
  local ids = {}
  for i = 1, n do ids[i] = ARGV[at - n + i - 1] end
  -- Its messages still in line: a turn whose messages left (settled by
  -- an earlier call) hands over nothing.
  if not owns(value, token) or redis.call('ZREM', line, unpack(ids)) ~= n then
    replies[turn] = {key, '0'}
  else
    for _, id in ipairs(ids) do done[#done + 1] = id end
    -- Waited for by other code (`!`): let go, whatever is in line.
    local waited = string.byte(value, -1) == 33
    local heads = lease ~= '' and not waited and redis.call('ZRANGE', line, 0, run - 1) or {}
    if #heads > 0 then
      redis.call('PEXPIRE', lock, lease)
      busy[#busy + 1], busy[#busy + 2] = BUSY + now + tonumber(lease), key
      replies[turn] = {key, '2', heads}
      for _, id in ipairs(heads) do nexts[#nexts + 1] = id end
    else
      redis.call('DEL', lock)
      -- Waited for (other code in the lock's line): the release wakes it.
      if waited then redis.call('PUBLISH', lock, '') end
      if (lease == '' or waited) and redis.call('EXISTS', line) == 1 then
        ready[#ready + 1], ready[#ready + 2] = now, key
      else
        gone[#gone + 1] = key
      end
      replies[turn] = {key, '1'}
    end
  end
end
if #done > 0 then
  redis.call('HINCRBY', KEYS[3], 'lines', -redis.call('HDEL', KEYS[2], unpack(done)))
end
if #done ~= #nexts then redis.call('HINCRBY', KEYS[3], 'active', #nexts - #done) end
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('HINCRBY', KEYS[3], 'keys', -#gone)
end
if #ready > 0 then redis.call('ZADD', KEYS[1], unpack(ready)) end
if #busy > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(busy)) end
if #nexts > 0 then
  local records, n = redis.call('HMGET', KEYS[2], unpack(nexts)), 0
  for _, reply in ipairs(replies) do
    if reply[2] == '2' then
      local heads = reply[3]
      reply[3] = nil
      for _, id in ipairs(heads) do
        n = n + 1
        reply[#reply + 1], reply[#reply + 2] = id, records[n] or ''
      end
    end
  end
end
-- What this call did, for a resend after a lost reply.
redis.call('SET', KEYS[5], table.concat(done, ',') .. ';' .. table.concat(nexts, ','), 'PX', lease ~= '' and lease or 60000)
if #ready > 0 or #gone > 0 then
  local first = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. BUSY, 'WITHSCORES', 'LIMIT', 0, 1)
  if first[2] then
    redis.call('ZADD', KEYS[4], first[2], KEYS[1])
  else
    redis.call('ZREM', KEYS[4], KEYS[1])
  end
end
return replies
