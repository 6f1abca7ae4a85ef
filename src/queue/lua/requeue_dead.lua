-- Re-drives dead letters: due now, attempt, deferral and stall counts reset.
-- KEYS: data, schedule, dead, errors, bell, prioritized (a message keeps its
--   priority), events, and a keyed partition's keyof hash (id -> key) and
--   counts (see keyed.lua) or none
-- ARGV: an id, or "" for the oldest ARGV[2] letters buried at or before
--   ARGV[3]; how many at most; a time in ms (when the caller's re-drive
--   started) or "" for now; the events' cap ("" for no events)
-- Returns {re-driven, examined, the cutoff time used, {id, 1, ...} of the
-- letters re-driven, their keys (with KEYS[8])}; a dead entry without a
-- record is dropped. A caller that re-drives everything passes the cutoff of
-- its first call to the next ones: letters buried again meanwhile (a poison
-- message fails at once) score later and are left, so the loop ends.
local now = now_ms()
local cutoff = tonumber(ARGV[3]) or now
local ids
if ARGV[1] ~= '' then
  ids = {ARGV[1]}
else
  ids = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', cutoff, 'LIMIT', 0, tonumber(ARGV[2]))
end
local count, removed = 0, 0
local redriven, keys = {}, {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', KEYS[3], id) == 1 then
    removed = removed + 1
    local record = redis.call('HGET', KEYS[1], id)
    redis.call('HDEL', KEYS[4], id)
    if record then
      local enq, _, _, _, payload, priority = parse_or_keep(record)
      redis.call('HSET', KEYS[1], id, make_record(enq, 0, 0, 0, payload, priority))
      schedule_at(KEYS[2], KEYS[6], KEYS[5], id, now, priority)
      count = count + 1
      append(redriven, id, 1)
      if KEYS[8] then
        keys[#keys + 1] = string.match(redis.call('HGET', KEYS[8], id) or '', '^[^%z]*')
      end
    end
  end
end
if KEYS[9] and removed > 0 then
  redis.call('HINCRBY', KEYS[9], 'dead', -removed)
  if count > 0 then redis.call('HINCRBY', KEYS[9], 'schedule', count) end
  -- A cluster partition's own counts number their changes (see
  -- tally_version in keyed.lua).
  if string.sub(KEYS[9], 1, -8) == string.sub(KEYS[1], 1, -6) then
    redis.call('HINCRBY', KEYS[9], 'v', 1)
  end
end
emit(KEYS[7], ARGV[4], 'redriven', now, nil, redriven)
return {count, #ids, cutoff, redriven, keys}
