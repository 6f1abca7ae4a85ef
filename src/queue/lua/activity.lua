-- Activity counts (Queue::activity), prepended to the scripts that record
-- messages done or failed and to stats.lua, which reads them: per second of
-- the server's clock, the messages done and those that failed (retried or
-- dead), kept while the queue records events.
--
-- KEY <p>:{q}:activity  hash  a ring of ACTIVITY_SLOTS fields, field
--   `<second mod ACTIVITY_SLOTS>` = "<second> <done> <failed>" (second: unix
--   seconds). A field holding another second than the one asked for is that
--   slot's earlier turn: it reads as zero, and is overwritten when counted
--   in again. The hash expires an hour after the last count.
-- Work: a count costs HGET, HSET and PEXPIRE; a read of a window costs one
-- HMGET of a field per second of it (at most ACTIVITY_SLOTS), never the
-- events themselves (an events entry can hold 1,000 ids).
local ACTIVITY_SLOTS = 3600

-- Adds `done` and `failed` messages to the counts of the second of `now`
-- (ms).
local function tally(counts, now, done, failed)
  local second = math.floor(now / 1000)
  local field = second % ACTIVITY_SLOTS
  local at, d, f = string.match(redis.call('HGET', counts, field) or '', '^(%d+) (%d+) (%d+)$')
  if tonumber(at) ~= second then d, f = 0, 0 end
  redis.call('HSET', counts, field, string.format('%d %d %d', second, d + done, f + failed))
  redis.call('PEXPIRE', counts, ACTIVITY_SLOTS * 1000)
end

-- Counts `n` messages of an events entry of `kind` (done; retried and dead:
-- failed) when the queue records events (`cap`, as emit takes it).
local function count_activity(counts, cap, kind, now, n)
  if cap == nil or cap == '' or n == 0 then return end
  if kind == 'done' then
    tally(counts, now, n, 0)
  elseif kind == 'retried' or kind == 'dead' then
    tally(counts, now, 0, n)
  end
end

-- emit (see the prelude), counted: `pairs` holds an id and an attempt per
-- message.
local function emit_counted(stream, counts, cap, kind, now, error, pairs)
  emit(stream, cap, kind, now, error, pairs)
  count_activity(counts, cap, kind, now, #pairs / 2)
end

-- The done and failed counts per bucket of the window (`since` .. `now` ms,
-- buckets of `width` ms, `count` of them, oldest first): each second's
-- counts go to the bucket its end falls in (the second of `now` to the
-- last bucket). Seconds older than ACTIVITY_SLOTS read as zero.
local function activity_buckets(counts, since, now, width, count)
  local done, failed = {}, {}
  for i = 1, count do done[i], failed[i] = 0, 0 end
  local last = math.floor(now / 1000)
  local first = math.max(math.floor(since / 1000), last - ACTIVITY_SLOTS + 1)
  local fields = {}
  for second = first, last do fields[#fields + 1] = second % ACTIVITY_SLOTS end
  local values = redis.call('HMGET', counts, unpack(fields))
  for i = 1, #fields do
    local second = first + i - 1
    local at, d, f = string.match(values[i] or '', '^(%d+) (%d+) (%d+)$')
    if tonumber(at) == second then
      local ends = math.min(second * 1000 + 999, now)
      local b = math.min(math.max(math.floor((ends - since) / width) + 1, 1), count)
      done[b], failed[b] = done[b] + tonumber(d), failed[b] + tonumber(f)
    end
  end
  return done, failed
end
