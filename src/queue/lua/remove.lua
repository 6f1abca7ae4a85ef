-- Deletes a message that is scheduled or dead. A message being processed is
-- left alone (its worker settles it): deleting it under the worker would let
-- that worker's claim act on a new message pushed later with the same id.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: dead   KEYS[4]: errors
-- ARGV[1]: id
-- Returns 1 when removed, 0 when absent or being processed.
if redis.call('ZREM', KEYS[2], ARGV[1]) + redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then
  return 0
end
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
