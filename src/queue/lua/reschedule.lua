-- Retries (a failure), defers (lock contention) or releases (hands back at
-- shutdown, counting nothing) a claimed message.
-- KEYS: data, schedule, active, errors, bell, prioritized (a message keeps
--   its priority), events, activity
-- ARGV: active member "<id>:<claim>", id, delay ms from the server's now or
--   "@<unix ms>", the counter to bump ("failure", "deferral" or "release"),
--   error text ("" for none), the events' cap ("" for no events)
-- Returns the new due time in ms, or -1 when the claim is no longer held.
-- Validated before any write (the caller is lockgate, but a bad argument must
-- never leave a message off every structure).
local now = now_ms()
local due = parse_when(now, ARGV[3])
if not due then
  return redis.error_reply('ERR lockgate reschedule: bad `when` "' .. ARGV[3] .. '"')
end
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return -1 end
local id = ARGV[2]
local record = redis.call('HGET', KEYS[1], id)
if not record then return -1 end
local enq, failures, deferrals, stalls, payload, priority = parse_or_keep(record)
local attempt = failures + 1
if ARGV[4] ~= 'release' then
  if ARGV[4] == 'failure' then failures = failures + 1 else deferrals = deferrals + 1 end
  redis.call('HSET', KEYS[1], id, make_record(enq, failures, deferrals, stalls, payload, priority))
end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[4], id, ARGV[5]) end
schedule_at(KEYS[2], KEYS[6], KEYS[5], id, due, priority)
-- Last: a failing events write leaves the message where it belongs.
if ARGV[6] ~= '' then
  local kinds = {failure = 'retried', deferral = 'deferred', release = 'released'}
  local error = nil
  if ARGV[4] == 'failure' then error = ARGV[5] end
  emit_counted(KEYS[7], KEYS[8], ARGV[6], kinds[ARGV[4]] or ARGV[4], now, error, {id, attempt})
end
return due
