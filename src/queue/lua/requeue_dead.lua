-- Re-drives dead letters: due now, attempt and deferral counts reset.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: dead   KEYS[4]: errors   KEYS[5]: bell
-- ARGV[1]: an id, or "" for the oldest ARGV[2] dead letters
-- ARGV[2]: how many at most when ARGV[1] is ""
-- Returns {re-driven, examined}; a dead entry without a record is dropped.
local ids
if ARGV[1] ~= '' then
  ids = {ARGV[1]}
else
  ids = redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[2]) - 1)
end
local now = now_ms()
local count = 0
for _, id in ipairs(ids) do
  if redis.call('ZREM', KEYS[3], id) == 1 then
    local record = redis.call('HGET', KEYS[1], id)
    redis.call('HDEL', KEYS[4], id)
    if record then
      local enq, _, _, payload = parse(record)
      if not enq then enq, payload = '0', record end
      redis.call('HSET', KEYS[1], id, enq .. ':0:0:' .. payload)
      schedule_at(KEYS[2], KEYS[5], id, now)
      count = count + 1
    end
  end
end
return {count, #ids}
