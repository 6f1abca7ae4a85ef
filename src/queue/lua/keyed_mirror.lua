-- On a Redis Cluster, copies partitions' counts (each read at one instant,
-- its counts and change number with `HMGET`, its earliest ready time with
-- `ZRANGE`: see src/queue/keyed/mirror.rs) into the queue's slot, where
-- one server's scripts keep them: `stats` then reads the queue's counts
-- and oldest in one round trip, as on one server, not every partition's
-- (issue 35, item 8). A partition's scripts number each change of its
-- counts (`v`, see tally_version in keyed.lua); a copy replaces the one
-- kept only when newer, so that handles copying the same partitions at
-- once, in any order, leave the newest. The totals move by what each copy
-- changed. A few commands per call, however many copies.
-- Standalone (no prelude).
-- KEYS[1]: copies, hash slot ->
--   "<v>:<lines>:<schedule>:<active>:<dead>:<keys>:<earliest ready ms or -1>"
-- KEYS[2]: the queue's counts (the fields keyed.lua names)
-- KEYS[3]: the queue's oldest (a partition's ready set name -> its
--   earliest ready time above 0)
-- KEYS[4]: the partitions with dead letters, slot -> how many (where
--   `dead_letters` looks on a cluster)
-- ARGV[1]: "1" to take every copy that differs from the one kept, its
--   number newer or not (a sweep over every partition puts the copies
--   right: a failover may have lost a partition's last changes, and with
--   them numbers the copy kept has seen; a version before the numbers
--   changed partitions without them)
-- ARGV[2..], per partition: its slot, its ready set's name, then the read
--   copy: v, lines, schedule, active, dead, keys, earliest ready ms (-1: none)
-- Returns the slots whose kept copy it took back to an older number (the
-- caller copies them again as usual: a newer copy may have landed between
-- its reading and this).
local FIELDS = {'lines', 'schedule', 'active', 'dead', 'keys'}
local force = ARGV[1] == '1'
local slots = {}
for i = 2, #ARGV, 9 do slots[#slots + 1] = ARGV[i] end
if #slots == 0 then return {} end
local kept = redis.call('HMGET', KEYS[1], unpack(slots))
local totals = {0, 0, 0, 0, 0}
local older, copies, earliest, gone, dead, alive = {}, {}, {}, {}, {}, {}
for n, slot in ipairs(slots) do
  local i = 2 + 9 * (n - 1)
  local was = kept[n] or nil
  local old = {-1, 0, 0, 0, 0, 0, -1}
  if was then
    local at = 0
    for number in string.gmatch(was, '%-?%d+') do
      at = at + 1
      old[at] = tonumber(number)
    end
  end
  local copy = {}
  for f = 1, 7 do copy[f] = tonumber(ARGV[i + 1 + f]) end
  local text = table.concat(copy, ':')
  if copy[1] > old[1] or (force and text ~= was) then
    for f = 1, 5 do totals[f] = totals[f] + copy[f + 1] - old[f + 1] end
    copies[#copies + 1] = slot
    copies[#copies + 1] = text
    if copy[7] > 0 and copy[7] ~= old[7] then
      earliest[#earliest + 1] = copy[7]
      earliest[#earliest + 1] = ARGV[i + 1]
    elseif copy[7] <= 0 and (old[7] > 0 or not was) then
      gone[#gone + 1] = ARGV[i + 1]
    end
    if copy[5] > 0 and copy[5] ~= old[5] then
      dead[#dead + 1] = copy[5]
      dead[#dead + 1] = slot
    elseif copy[5] <= 0 and (old[5] > 0 or not was) then
      alive[#alive + 1] = slot
    end
    if copy[1] < old[1] then older[#older + 1] = slot end
  end
end
if #copies > 0 then redis.call('HSET', KEYS[1], unpack(copies)) end
if #earliest > 0 then redis.call('ZADD', KEYS[3], unpack(earliest)) end
if #gone > 0 then redis.call('ZREM', KEYS[3], unpack(gone)) end
if #dead > 0 then redis.call('ZADD', KEYS[4], unpack(dead)) end
if #alive > 0 then redis.call('ZREM', KEYS[4], unpack(alive)) end
for f = 1, 5 do
  if totals[f] ~= 0 then redis.call('HINCRBY', KEYS[2], FIELDS[f], totals[f]) end
end
return older
