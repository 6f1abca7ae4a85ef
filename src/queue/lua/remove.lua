-- Deletes a message that is scheduled or dead. An active message's lease
-- entry is left to its worker (whose ack then succeeds) or to recover().
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: dead   KEYS[4]: errors
-- ARGV[1]: id
-- Returns 1 when the message existed.
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
