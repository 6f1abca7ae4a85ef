-- Looks at a partition's next messages (see keyed.lua), changing nothing:
-- the heads of its keys' lines (the next claim's candidates first: ready
-- soonest, then keys at work), its delayed messages, soonest due first, and
-- its messages at work, soonest lease end first.
-- KEYS[1..14]: the partition   ARGV[1]: how many of each at most
-- Returns {n waiting, {{id, ms, key, record or false}, ...}}, the n
-- waiting first: a head's ms is when its key may be claimed from (now for
-- a key at work), a delayed message's its due time, one at work's its lease end.
local limit = tonumber(ARGV[1])
local now = now_ms()
local out, waiting = {}, 0

local function add(id, at, key)
  out[#out + 1] = {id, string.format('%d', at), key, redis.call('HGET', KEYS[DATA], id)}
end

local ready = redis.call('ZRANGE', KEYS[READY], 0, limit - 1, 'WITHSCORES')
for i = 1, #ready, 2 do
  local key = ready[i]
  local id = head_of(key)
  if id then
    add(id, math.max(tonumber(ready[i + 1]), now), key)
    waiting = waiting + 1
  end
end
local delayed = redis.call('ZRANGE', KEYS[SCHEDULE], 0, limit - 1, 'WITHSCORES')
for i = 1, #delayed, 2 do
  local of = redis.call('HGET', KEYS[KEYOF], delayed[i]) or ''
  add(delayed[i], tonumber(delayed[i + 1]), string.match(of, '^(.-)%z') or of)
  waiting = waiting + 1
end
local active = redis.call('ZRANGE', KEYS[ACTIVE], 0, limit - 1, 'WITHSCORES')
for i = 1, #active, 2 do
  local key, id = string.match(active[i], '^(.-)%z%d+%z(.*):%d+$')
  if id then add(id, tonumber(active[i + 1]), key) end
end
return {waiting, out}
