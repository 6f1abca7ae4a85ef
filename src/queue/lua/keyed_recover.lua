-- Ends the turns whose lease ran out (their worker died or stalled) in a
-- partition (see keyed.lua): the message goes back first in its key's line
-- and its key is ready at once (the key's lock or permit ran out with the
-- lease), counting a stall; one that stalled ARGV[1] times is buried.
-- KEYS[1..13]: the partition   ARGV[1]: max stalls   ARGV[2]: how many at most
-- ARGV[3], ARGV[4]: the dead letters' max count and max age in ms ("" for no
-- limit), applied after a burial
-- Returns {examined, {{key, id, attempt, error}, ...}}: the error "" when
-- it went back in line, else the one it was buried with.
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[ACTIVE], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local max_stalls = tonumber(ARGV[1])
local out, buried = {}, 0
for _, entry in ipairs(expired) do
  remove_from(ACTIVE, entry)
  local member = string.match(entry, '^(.*):%d+$')
  local key, id = string.match(member or '', '^(.-)%z%d+%z(.*)$')
  local record = id and redis.call('HGET', KEYS[DATA], id)
  if record then
    local enq, failures, deferrals, stalls, payload = parse_or_keep(record)
    stalls = stalls + 1
    redis.call('HSET', KEYS[DATA], id, make_record(enq, failures, deferrals, stalls, payload))
    local error = ''
    if stalls >= max_stalls then
      local limit = tonumber(redis.call('HGET', KEYS[LIMITS], key)) or 0
      error = 'lease expired ' .. stalls .. ' times (limit ' .. max_stalls
        .. '): its worker died or stalled every time it held the message'
      redis.call('HSET', KEYS[KEYOF], id, aside(key, '', limit))
      add_to(DEAD, now, id)
      redis.call('HSET', KEYS[ERRORS], id, error)
      buried = buried + 1
    else
      redis.call('HSET', KEYS[ERRORS], id, 'lease expired: the worker died or stalled')
      rejoin(key, string.match(member, '%z(%d+)%z'), id, now)
    end
    after_turn(key, now, false)
    out[#out + 1] = {key, id, failures + 1, error}
  end
end
if buried > 0 then
  counted(DEAD, -trim_dead(KEYS[DEAD], KEYS[DATA], KEYS[ERRORS], now, ARGV[3], ARGV[4], 100 + buried,
    KEYS[KEYOF]))
end
-- Nothing expired, nothing changed: a sweep's look at a quiet partition
-- costs one command.
if #expired > 0 then tally() end
return {#expired, out}
