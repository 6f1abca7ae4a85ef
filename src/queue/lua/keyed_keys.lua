-- Reads a partition's keys for a view (see keyed.lua), changing nothing:
-- each key with messages in line or at work, how many of each, and when the
-- first in its line was pushed (its seq: the push time in thousandths of a
-- ms, so no record is read). KEYS[1..14]: the partition
-- ARGV[1]: the most keys to read from each of the active and ready sets
-- (the caller's top: the work is bounded by it, not by the keys)
-- Returns {now ms, {{key, in line, at work, its head's push ms (-1: none)},
-- ...}}.
local now = now_ms()
local most = tonumber(ARGV[1])
local seen, out = {}, {}

-- `key`'s entry in `out`.
local function entry(key)
  if not seen[key] then
    seen[key] = {key, 0, 0, -1}
    out[#out + 1] = seen[key]
  end
  return seen[key]
end

for _, member in ipairs(redis.call('ZRANGE', KEYS[ACTIVE], 0, most - 1)) do
  local key = string.match(member, '^(.-)%z')
  if key then
    local e = entry(key)
    e[3] = e[3] + 1
  end
end
for _, key in ipairs(redis.call('ZRANGE', KEYS[READY], 0, most - 1)) do
  local e = entry(key)
  e[2] = redis.call('ZLEXCOUNT', KEYS[LINES], '[' .. key .. '\0', '(' .. key .. '\1')
  local id, seq = head_of(key)
  e[4] = id and math.floor(tonumber(seq) / 1000) or -1
end
return {now, out}
