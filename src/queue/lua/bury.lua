-- Moves a claimed message to the dead letters with its error, then applies
-- the dead-letter retention (bounded work, see trim_dead).
-- KEYS[1]: active   KEYS[2]: dead   KEYS[3]: errors   KEYS[4]: data   KEYS[5]: events
-- ARGV[1]: active member "<id>:<claim>"   ARGV[2]: id   ARGV[3]: error text
-- ARGV[4]: "1" to count this delivery as a failed attempt
-- ARGV[5]: keep at most this many dead letters ("" for no limit)
-- ARGV[6]: keep dead letters at most this many ms ("" for no limit)
-- ARGV[7]: the events' cap ("" for no events)
-- Returns 1, or 0 when the claim is no longer held, or when its record is
-- gone (the queue was purged); then only the stale lease entry is dropped.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
local record = redis.call('HGET', KEYS[4], ARGV[2])
if not record then return 0 end
if ARGV[4] == '1' then
  local enq, failures, deferrals, stalls, payload, priority = parse(record)
  if enq then
    redis.call('HSET', KEYS[4], ARGV[2],
      make_record(enq, failures + 1, deferrals, stalls, payload, priority))
  end
end
local now = now_ms()
redis.call('ZADD', KEYS[2], now, ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
trim_dead(KEYS[2], KEYS[4], KEYS[3], now, ARGV[5], ARGV[6], 100)
-- Last: a failing events write leaves the letter where it belongs.
emit(KEYS[5], ARGV[7], 'dead', now, ARGV[3], {ARGV[2], attempt_of(record)})
return 1
