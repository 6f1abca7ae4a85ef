-- Retries (a failure), defers (lock contention) or releases (hands back at
-- shutdown, counting nothing) a claimed message.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: active   KEYS[4]: errors   KEYS[5]: bell
-- ARGV[1]: active member "<id>:<claim>"   ARGV[2]: id
-- ARGV[3]: delay in ms from the server's now, or "@<unix ms>"
-- ARGV[4]: "failure", "deferral" or "release": which counter to bump
-- ARGV[5]: error text to record ("" for none)
-- Returns the new due time in ms, or -1 when the claim is no longer held.
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return -1 end
local id = ARGV[2]
local record = redis.call('HGET', KEYS[1], id)
if not record then return -1 end
local enq, failures, deferrals, payload = parse(record)
if not enq then
  -- Cannot happen for records written by lockgate; keep the message anyway.
  enq, failures, deferrals, payload = '0', 0, 0, record
end
if ARGV[4] ~= 'release' then
  if ARGV[4] == 'failure' then failures = failures + 1 else deferrals = deferrals + 1 end
  redis.call('HSET', KEYS[1], id, enq .. ':' .. failures .. ':' .. deferrals .. ':' .. payload)
end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[4], id, ARGV[5]) end
local due
if string.byte(ARGV[3], 1) == 64 then
  due = tonumber(string.sub(ARGV[3], 2))
else
  due = now_ms() + tonumber(ARGV[3])
end
schedule_at(KEYS[2], KEYS[5], id, due)
return due
