-- Completes many claimed messages at once: deletes each whose claim the
-- caller still holds.
-- KEYS[1]: data   KEYS[2]: active   KEYS[3]: errors
-- ARGV: triplets of (active member "<id>:<claim>", id, "1" when the message
--       may have an error entry to delete)
-- Returns per message 1; 0 when its claim is no longer held but the message
-- still exists (its lease ran out); -1 when the message is gone (already
-- completed, say by an earlier copy of this call whose reply was lost).
local out = {}
for i = 1, #ARGV, 3 do
  if redis.call('ZREM', KEYS[2], ARGV[i]) == 1 then
    redis.call('HDEL', KEYS[1], ARGV[i + 1])
    if ARGV[i + 2] == '1' then redis.call('HDEL', KEYS[3], ARGV[i + 1]) end
    out[#out + 1] = 1
  elseif redis.call('HEXISTS', KEYS[1], ARGV[i + 1]) == 0 then
    out[#out + 1] = -1
  else
    out[#out + 1] = 0
  end
end
return out
