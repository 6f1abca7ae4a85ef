-- Claims up to ARGV[1] due messages under a lease: those with a priority
-- first, highest first, then the schedule's; in due order within each.
-- KEYS: data, schedule, active, claims, bell, prioritized, events, the index
--   of keyed partitions (see keyed.lua), this call's record
-- ARGV: how many at most (bounded by the caller), lease ms, the events' cap
--   ("" for none), how many due keyed partitions to name, how long to keep
--   the record (ms)
-- Returns {claim, next due ms or -1 (partitions included), now, {due keyed
-- partitions}, then per message id, due ms, record}. A scheduled id whose
-- record is missing (removed by hand) is dropped. When due messages remain,
-- the bell rings again: a ring wakes one idle worker and this passes it on,
-- so a backlog reaches every idle worker, not just the first.
-- The record ("<claim>:<lease deadline>:<count>"), named by the caller for
-- this call alone, makes the call safe to resend: a caller whose reply was
-- lost (a timeout, a dropped connection) sends it again, and the resend
-- answers what the first call claimed and still holds (found by the
-- leases' deadline, see leases_of; each with its push time as its due
-- time), instead of leaving it leased to nobody until its lease runs out.
local now, now_us = server_time()
-- No lease is this member (leases end in :<claim>); its length makes a new
-- set of leases a skiplist (see the end).
local SKIPLIST = string.rep('~', 65)
local max = tonumber(ARGV[1])
-- ids[i] was due at dues[i]. Reads first, writes last: the events' entry
-- (the one write that can fail, say for a user without XADD) goes before
-- them, so a failing claim changes nothing.
local ids, dues = {}, {}
local from_prioritized, from_schedule = {}, {}
local prioritized = redis.call('EXISTS', KEYS[6]) == 1
if prioritized then
  local from = 0
  while #ids < max do
    -- The highest priority with a message at all, then its due ones.
    local first = redis.call('ZRANGEBYSCORE', KEYS[6], from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if not first[2] then break end
    local priority = unband(tonumber(first[2]))
    local low = band(priority)
    local due = redis.call('ZRANGEBYSCORE', KEYS[6], low, low + now, 'WITHSCORES',
      'LIMIT', 0, max - #ids)
    for i = 1, #due, 2 do
      from_prioritized[#from_prioritized + 1] = due[i]
      ids[#ids + 1] = due[i]
      -- As a string, as the schedule's scores come ('%d': no exponent).
      dues[#dues + 1] = string.format('%d', tonumber(due[i + 1]) - low)
    end
    if priority <= 1 then break end
    from = band(priority - 1)
  end
end
if #ids < max then
  local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES', 'LIMIT', 0, max - #ids)
  for i = 1, #due, 2 do
    from_schedule[#from_schedule + 1] = due[i]
    ids[#ids + 1] = due[i]
    dues[#dues + 1] = due[i + 1]
  end
end
-- The keyed partitions that may have work now; and when the first of the
-- others may.
local slots = redis.call('ZRANGEBYSCORE', KEYS[8], '-inf', now, 'LIMIT', 0, tonumber(ARGV[4]))
-- The next due time over the schedule, every priority and the partitions.
local function next_due()
  local head = head_due(KEYS[2])
  if prioritized then
    local other = prioritized_head(KEYS[6])
    if other and (not head or other < head) then head = other end
  end
  local later = redis.call('ZRANGEBYSCORE', KEYS[8], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2]
  if later and (not head or tonumber(later) < head) then head = tonumber(later) end
  return head
end
-- A resend: what the first call claimed, where its lease still holds.
local kept = redis.call('GET', KEYS[9])
if kept then
  local tag, deadline, count = string.match(kept, '^(%d+):(%d+):(%d+)$')
  local out = {tag, next_due() or -1, now, slots}
  for _, id in ipairs(leases_of(KEYS[3], tag, deadline, tonumber(count))) do
    local record = redis.call('HGET', KEYS[1], id)
    if record then append(out, id, (parse(record)) or now, record) end
  end
  return out
end
if #ids == 0 then
  return {0, next_due() or -1, now, slots}
end
local records = redis.call('HMGET', KEYS[1], unpack(ids))
if ARGV[3] ~= '' then
  local events = {}
  for i, id in ipairs(ids) do
    if records[i] then
      events[#events + 1] = id
      events[#events + 1] = attempt_of(records[i])
    end
  end
  emit(KEYS[7], ARGV[3], 'claimed', now, nil, events)
end
if #from_prioritized > 0 then redis.call('ZREM', KEYS[6], unpack(from_prioritized)) end
if #from_schedule > 0 then redis.call('ZREM', KEYS[2], unpack(from_schedule)) end
local tag = next_claim(KEYS[4], now_us)
local deadline = now + tonumber(ARGV[2])
local leases = {}
local next_at = next_due()
if next_at and next_at <= now then ring(KEYS[5]) end
local out = {tag, next_at or -1, now, slots}
for i, id in ipairs(ids) do
  if records[i] then
    leases[#leases + 1] = deadline
    leases[#leases + 1] = id .. ':' .. tag
    out[#out + 1] = id
    out[#out + 1] = dues[i]
    out[#out + 1] = records[i]
  end
end
if #leases > 0 then
  -- Every message adds to the set of leases and removes from it. A new
  -- sorted set of up to 128 members is a listpack, searched linearly on
  -- each write; one member longer than 64 bytes (the server's defaults for
  -- zset-max-listpack-entries and -value) makes it a skiplist instead,
  -- which it stays until it empties. At a few dozen leases, as each shard
  -- of a queue holds, the skiplist costs the server less per message.
  local new = redis.call('EXISTS', KEYS[3]) == 0
  if new then redis.call('ZADD', KEYS[3], 0, SKIPLIST) end
  redis.call('ZADD', KEYS[3], unpack(leases))
  if new then redis.call('ZREM', KEYS[3], SKIPLIST) end
  redis.call('SET', KEYS[9], string.format('%s:%d:%d', tag, deadline, #leases / 2), 'PX', ARGV[5])
end
return out
