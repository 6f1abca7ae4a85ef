-- Completes a claimed message: deletes it, if the caller still holds the claim.
-- KEYS[1]: data   KEYS[2]: active   KEYS[3]: errors   KEYS[4]: completed
-- KEYS[5]: events
-- ARGV[1]: active member "<id>:<claim>"   ARGV[2]: id
-- ARGV[3]: "1" when the message may have an error entry to delete
-- ARGV[4]: the events' cap ("" for no events)
-- ARGV[5]: "1" to keep it on the completed stream (Queue::keep_completed),
--          ARGV[6] and ARGV[7] the stream's limits: the most entries, and
--          the most ms to keep one ("" for no limit)
-- ARGV[8]: its failed attempts before this one (for the event's attempt)
-- ARGV[9]: the event's kind: "done", or "deferred" for a message that moved
--          into its key's line (see keyed_take_in.lua)
-- Returns 1; 0 when the claim is no longer held but the message still exists
-- (its lease ran out: it is scheduled again, claimed by another worker, or a
-- dead letter); -1 when the message is gone (already completed: say by an
-- earlier copy of this very call whose reply was lost, or removed). Nothing
-- changes unless it returns 1.
if redis.call('ZREM', KEYS[2], ARGV[1]) == 0 then
  if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 0 then return -1 end
  return 0
end
local record = ARGV[5] == '1' and redis.call('HGET', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[1], ARGV[2])
if ARGV[3] == '1' then redis.call('HDEL', KEYS[3], ARGV[2]) end
-- Last: a failing stream write leaves the message completed.
if ARGV[4] ~= '' or ARGV[5] == '1' then
  local now = now_ms()
  if record then keep_completed(KEYS[4], ARGV[6], ARGV[7], now, ARGV[2], record) end
  emit(KEYS[5], ARGV[4], ARGV[9], now, nil, {ARGV[2], tonumber(ARGV[8]) + 1})
end
return 1
