-- Deletes a message that is scheduled or dead. A message being processed is
-- left alone (its worker settles it): deleting it under the worker would let
-- that worker's claim act on a new message pushed later with the same id.
-- KEYS: data, schedule, dead, errors, prioritized, events
-- ARGV: id, the events' cap ("" for no events)
-- Returns 1 when removed, 0 when absent or being processed.
if redis.call('ZREM', KEYS[2], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1])
    + redis.call('ZREM', KEYS[5], ARGV[1]) == 0 then
  return 0
end
local record = ARGV[2] ~= '' and redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then
  emit(KEYS[6], ARGV[2], 'removed', now_ms(), nil, {ARGV[1], attempt_of(record or nil)})
end
return 1
