-- Moves a claimed message to the dead letters with its error, then applies
-- the dead-letter retention (bounded work, see trim_dead).
-- KEYS: active, dead, errors, data, events, activity
-- ARGV: active member "<id>:<claim>", id, error text, "1" to count this
--   delivery as a failed attempt, then the dead letters' most count and most
--   age in ms, and the events' cap (each "" for none)
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
emit_counted(KEYS[5], KEYS[6], ARGV[7], 'dead', now, ARGV[3], {ARGV[2], attempt_of(record)})
return 1
