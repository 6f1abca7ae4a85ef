-- Lists a page of dead letters after a cursor, in the order of the dead
-- set: burial time, then id (byte-wise, as Redis orders equal scores).
-- KEYS: data, dead, errors
-- ARGV: the cursor's burial time in ms ("" for the first page), its id,
--   how many letters (at most MAX_BATCH: the caller checks)
-- Returns per dead letter {id, buried ms, record or false, error or false}.
-- Work: O(log n) to find the cursor's place, O(log n + limit) to read the
-- page: never the letters before the cursor.

-- Whether `a` sorts before `b` byte-wise (Lua's `<` follows the server's
-- locale).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- The rank of the first letter after the cursor (`ms`, `id`).
local function start(dead, ms, id)
  -- Ranks lo .. hi - 1 hold the letters buried in that very ms (ZCOUNT is
  -- O(log n)), ordered by id.
  local lo = redis.call('ZCOUNT', dead, '-inf', '(' .. ms)
  local hi = lo + redis.call('ZCOUNT', dead, ms, ms)
  local rank = redis.call('ZRANK', dead, id)
  if rank and rank >= lo and rank < hi then return rank + 1 end -- still there
  -- Gone (re-driven, trimmed): the first id above it, by bisection over the
  -- ranks (each step O(log n); a burst of burials can share one ms).
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if before(id, redis.call('ZRANGE', dead, mid, mid)[1]) then hi = mid else lo = mid + 1 end
  end
  return lo
end

local from = 0
if ARGV[1] ~= '' then from = start(KEYS[2], ARGV[1], ARGV[2]) end
local dead = redis.call('ZRANGE', KEYS[2], from, from + tonumber(ARGV[3]) - 1, 'WITHSCORES')
local out = {}
for i = 1, #dead, 2 do
  local id = dead[i]
  append(out, id, dead[i + 1], redis.call('HGET', KEYS[1], id), redis.call('HGET', KEYS[3], id))
end
return out
