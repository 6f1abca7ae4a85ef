-- Ends the turns whose lease ran out (their worker died or stalled) in a
-- partition, or in several at once on one server (see keyed.lua): the
-- message goes back first in its key's line and its key is ready at once
-- (the key's lock or permit ran out with the lease), counting a stall; one
-- that stalled ARGV[1] times is buried.
-- KEYS: the partition's 13 keys; or 13 for each of several partitions, in
-- turn   ARGV[1]: max stalls   ARGV[2]: how many at most, over the call
-- ARGV[3], ARGV[4]: the dead letters' max count and max age in ms ("" for no
-- limit), applied after a burial
-- Returns per partition {examined, {{key, id, attempt, error}, ...}}: the
-- error "" when it went back in line, else the one it was buried with.
local now = now_ms()
local max_stalls, room = tonumber(ARGV[1]), tonumber(ARGV[2])

-- Ends the expired turns of the partition at hand, up to `room` of them.
local function recover_partition()
  local expired = redis.call('ZRANGEBYSCORE', K[ACTIVE], '-inf', now, 'LIMIT', 0, room)
  local out, buried = {}, 0
  for _, entry in ipairs(expired) do
    remove_from(ACTIVE, entry)
    local member = string.match(entry, '^(.*):%d+$')
    local key, id = string.match(member or '', '^(.-)%z%d+%z(.*)$')
    local record = id and redis.call('HGET', K[DATA], id)
    if record then
      local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
      stalls = stalls + 1
      redis.call('HSET', K[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
      local error = ''
      if stalls >= max_stalls then
        local limit = tonumber(redis.call('HGET', K[LIMITS], key)) or 0
        error = 'lease expired ' .. stalls .. ' times (limit ' .. max_stalls
          .. '): its worker died or stalled every time it held the message'
        redis.call('HSET', K[KEYOF], id, aside(key, '', limit))
        add_to(DEAD, now, id)
        redis.call('HSET', K[ERRORS], id, error)
        buried = buried + 1
      else
        redis.call('HSET', K[ERRORS], id, 'lease expired: the worker died or stalled')
        rejoin(key, string.match(member, '%z(%d+)%z'), id, now)
      end
      after_turn(key, now, false)
      out[#out + 1] = {key, id, failures + 1, error}
    end
  end
  if buried > 0 then
    counted(DEAD, -trim_dead(K[DEAD], K[DATA], K[ERRORS], now, ARGV[3], ARGV[4], 100 + buried,
      K[KEYOF]))
  end
  room = room - #expired
  return {#expired, out}
end

local answers, changed = {}, false
for base = 0, #KEYS - MORE, MORE do
  -- (What the partition left changed is kept as the next is entered.)
  enter_partition(base)
  if room > 0 then
    answers[#answers + 1] = recover_partition()
    changed = changed or answers[#answers][1] > 0
  else
    answers[#answers + 1] = {0, {}}
  end
end
-- Nothing expired, nothing changed: a sweep's look at a quiet partition
-- costs one command.
if changed then tally() end
return answers
