-- Completes claimed messages: deletes each whose claim the caller still
-- holds.
-- KEYS: data, active, errors, completed, events, activity
-- ARGV: the events' cap ("" for none); "1" to keep them on the completed
--   stream (Queue::keep_completed), then its most entries and most age in ms
--   ("" for no limit); the events' kind ("done", or "deferred" for messages
--   that moved into their key's line, see keyed_take_in.lua); then per
--   message its active member "<id>:<claim>", id, "1" when it may have an
--   error entry to delete, and its failed attempts before this one
-- Returns per message 1; 0 when its claim is no longer held but the message
-- still exists (its lease ran out: scheduled again, claimed by another
-- worker, or dead); -1 when the message is gone (already completed, say by
-- an earlier copy of this call whose reply was lost, or removed). Nothing
-- changes for a message unless its answer is 1.
local out = {}
local observed = ARGV[1] ~= '' or ARGV[2] == '1'
local now = observed and now_ms()
local done, kept = {}, {}
for i = 6, #ARGV, 4 do
  if redis.call('ZREM', KEYS[2], ARGV[i]) == 1 then
    local id = ARGV[i + 1]
    if observed then
      if ARGV[2] == '1' then
        local record = redis.call('HGET', KEYS[1], id)
        if record then
          kept[#kept + 1] = id
          kept[#kept + 1] = record
        end
      end
      done[#done + 1] = id
      done[#done + 1] = tonumber(ARGV[i + 3]) + 1
    end
    redis.call('HDEL', KEYS[1], id)
    if ARGV[i + 2] == '1' then redis.call('HDEL', KEYS[3], id) end
    out[#out + 1] = 1
  elseif redis.call('HEXISTS', KEYS[1], ARGV[i + 1]) == 0 then
    out[#out + 1] = -1
  else
    out[#out + 1] = 0
  end
end
-- Last: a failing stream write leaves the messages completed.
for i = 1, #kept, 2 do
  keep_completed(KEYS[4], ARGV[3], ARGV[4], now, kept[i], kept[i + 1])
end
if observed then emit_counted(KEYS[5], KEYS[6], ARGV[1], ARGV[5], now, nil, done) end
return out
