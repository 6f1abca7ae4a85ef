-- Ends the turns whose lease ran out (their worker died or stalled) in a
-- partition, or in several at once on one server (see keyed.lua): the
-- message goes back first in its key's line, with the rest of its run (see
-- recover_run), and its key is ready at once (the key's lock or permit ran
-- out with the lease), counting a stall; one that stalled ARGV[1] times is
-- buried. On one server, sets each partition's entry in `leases` to its
-- earliest lease left (none: removed), so that the next sweep visits it
-- only when that lease may have run out (see keyed.lua).
-- KEYS: the partition's 14 keys; or 14 for each of several partitions, in
-- turn   ARGV[1]: max stalls   ARGV[2]: how many at most, over the call
-- ARGV[3], ARGV[4]: the dead letters' max count and max age in ms ("" for no
-- limit), applied after a burial   ARGV[5]: "1" to keep `leases` (one server;
-- on a cluster, where the queue's `leases` is in another slot, the caller
-- keeps it from the answers)
-- Returns per partition {examined, {{key, id, attempt, error}, ...}, its
-- earliest lease deadline left (-1: none)}: the error "" when it went
-- back in line, else the one it was buried with.
local now = now_ms()
local max_stalls, room = tonumber(ARGV[1]), tonumber(ARGV[2])

-- Ends the turn of `entry` (an active member "<line member>:<claim>"),
-- whose lease ran out: its message back in line, or buried. Appends what
-- it did to `out`; returns 1 when buried, else 0; nil when the entry was
-- not at work (ended with its run, see recover_run).
local function recover_entry(entry, out)
  if remove_from(ACTIVE, entry) == 0 then return nil end
  local member = string.match(entry, '^(.*):%d+$')
  local key, id = string.match(member or '', '^(.-)%z%d+%z(.*)$')
  local record = id and redis.call('HGET', K[DATA], id)
  if not record then return 0 end
  local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
  stalls = stalls + 1
  redis.call('HSET', K[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
  local error, buried = '', 0
  if stalls >= max_stalls then
    local limit = tonumber(redis.call('HGET', K[LIMITS], key)) or 0
    error = 'lease expired ' .. stalls .. ' times (limit ' .. max_stalls
      .. '): its worker died or stalled every time it held the message'
    redis.call('HSET', K[KEYOF], id, aside(key, '', limit))
    add_to(DEAD, now, id)
    redis.call('HSET', K[ERRORS], id, error)
    buried = 1
  else
    redis.call('HSET', K[ERRORS], id, 'lease expired: the worker died or stalled')
    rejoin(key, string.match(member, '%z(%d+)%z'), id, now)
  end
  after_turn(key, now, false)
  out[#out + 1] = {key, id, failures + 1, error}
  return buried
end

-- Ends the rest of the run of `entry`, whose lease ran out, if it was one
-- (see keyed_done.lua): a run's messages are leased at different times
-- (one read ahead later than the one at work), but its worker renews them
-- all, so one that ran out means the worker died or stalled. Put back one
-- at a time, the first would be claimed again once the lock lapsed,
-- followed by the messages after the run's, before the run's others came
-- back: out of line order. Returns how many were buried.
local function recover_run(entry, out)
  local member, claim = string.match(entry, '^(.*):(%d+)$')
  local key = member and string.match(member, '^(.-)%z')
  local run = key and redis.call('HGET', K[LIMITS], run_field(key))
  if not run then return 0 end
  local members, noted = run_members(run)
  if noted ~= claim then return 0 end
  redis.call('HDEL', K[LIMITS], run_field(key))
  local buried = 0
  for _, other in ipairs(members) do
    buried = buried + (recover_entry(other .. ':' .. claim, out) or 0)
  end
  return buried
end

-- The partitions' entries in `leases` this call knows exactly, by leases
-- key, then partition: the earliest lease deadline left, or false (none
-- left at work). Written at the end, a command or two per leases key.
local known = {}

-- The earliest lease deadline in the partition at hand's active set, or
-- nil.
local function earliest()
  return tonumber(redis.call('ZRANGE', K[ACTIVE], 0, 0, 'WITHSCORES')[2])
end

-- Ends the expired turns of the partition at hand, up to `room` of them
-- (and the rest of their runs), and notes its earliest lease left.
local function recover_partition()
  local first = earliest()
  local expired = {}
  if first and first <= now then
    expired = redis.call('ZRANGEBYSCORE', K[ACTIVE], '-inf', now, 'LIMIT', 0, room)
  end
  local out, buried = {}, 0
  for _, entry in ipairs(expired) do
    -- The rest of a run ends with it, and counts: the call ends about
    -- `room` turns, a run more at most; those left stay due.
    if #out >= room then break end
    local ended = recover_entry(entry, out)
    if ended then buried = buried + ended + recover_run(entry, out) end
  end
  if buried > 0 then
    counted(DEAD, -trim_dead(K[DEAD], K[DATA], K[ERRORS], now, ARGV[3], ARGV[4], 100 + buried,
      K[KEYOF]))
  end
  if #expired > 0 then first = earliest() end
  known[K[LEASES]] = known[K[LEASES]] or {}
  known[K[LEASES]][tag_of(K[ACTIVE])] = first or false
  room = room - math.max(#expired, #out)
  return {#expired, out, first or -1}
end

-- Writes the entries of `known`.
local function write_known()
  for leases, entries in pairs(known) do
    local set, gone = {}, {}
    for tag, deadline in pairs(entries) do
      if deadline then
        set[#set + 1] = deadline
        set[#set + 1] = tag
      else
        gone[#gone + 1] = tag
      end
    end
    if #set > 0 then redis.call('ZADD', leases, unpack(set)) end
    if #gone > 0 then redis.call('ZREM', leases, unpack(gone)) end
  end
end

local answers, changed = {}, false
for base = 0, #KEYS - MORE, MORE do
  -- (What the partition left changed is kept as the next is entered.)
  enter_partition(base)
  if room > 0 then
    answers[#answers + 1] = recover_partition()
    changed = changed or answers[#answers][1] > 0
  else
    -- Not visited: due as it was.
    answers[#answers + 1] = {0, {}, 0}
  end
end
if ARGV[5] == '1' then write_known() end
-- Nothing expired, nothing changed: a sweep's look at a quiet partition
-- costs one command (and the call one or two for `leases`).
if changed then tally() end
return answers
