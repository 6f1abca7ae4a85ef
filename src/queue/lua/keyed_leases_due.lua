-- The partitions where a lease may have run out: those whose entry in the
-- queue's `leases` (see keyed.lua) is due by the server's clock.
-- Standalone (no prelude).
-- KEYS[1]: leases   ARGV[1]: how many at most
-- On a Redis Cluster (see src/queue/keyed/partitions.rs), where the sweep
-- settles the entries after its visits (leases_settle.lua):
-- KEYS[2]: visiting, the partitions being visited (zset: tag -> since when)
-- ARGV[2]: how long (ms) a sweep may take to visit them
-- ARGV[3]: a random fraction in [0, 1), the sweep's own
-- Their entries leave `leases` while they are visited, so that a claim
-- meanwhile writes its own afresh (`ZADD LT` adds one), and each is marked
-- in `visiting` with the server's time plus ARGV[3] (two sweeps in one
-- millisecond mark apart). A mark older than ARGV[2] is due again: its
-- sweep failed or died before it settled. (So is an entry an older
-- version's sweep raised out of reach, to 10^15 ms, year 33658.)
-- Returns their tags, earliest first; on a Redis Cluster the mark first
-- (as text that reads back to the same score).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local limit = tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, limit)
if not KEYS[2] then
  return due
end
local taken = {}
-- Adds the members of `key` scored from `min` to `max` not taken yet, up
-- to the limit.
local function take(key, min, max)
  if #due >= limit then
    return
  end
  for _, tag in ipairs(redis.call('ZRANGEBYSCORE', key, min, max, 'LIMIT', 0, limit - #due)) do
    if not taken[tag] then
      taken[tag] = true
      due[#due + 1] = tag
    end
  end
end
for _, tag in ipairs(due) do
  taken[tag] = true
end
take(KEYS[1], '1000000000000000', '+inf')
if #due > 0 then
  redis.call('ZREM', KEYS[1], unpack(due))
end
take(KEYS[2], '-inf', now - tonumber(ARGV[2]))
local mark = string.format('%.17g', now + tonumber(ARGV[3]))
local marks = {}
for i, tag in ipairs(due) do
  marks[2 * i - 1], marks[2 * i] = mark, tag
end
if #due > 0 then
  redis.call('ZADD', KEYS[2], unpack(marks))
end
table.insert(due, 1, mark)
return due
