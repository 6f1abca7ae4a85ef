-- Deletes a keyed message that waits (in its key's line, or delayed) or is
-- dead, in a partition (see keyed.lua); one at work is left to its worker,
-- as remove.lua leaves an active message. KEYS[1..14]: the partition
-- ARGV[1]: the id   ARGV[2]: its place in line, "<key>\0<seq>\0<id>", as the
-- caller found it ("" for none)
-- Returns the message's key when it was removed, else false.
local id, member = ARGV[1], ARGV[2]
local key
if member ~= '' and remove_from(LINES, member) == 1 then
  key = string.match(member, '^(.-)%z')
  -- A key with no line left is no candidate; one at work stays so.
  local from = tonumber(redis.call('ZSCORE', KEYS[READY], key))
  if from and from >= 0 and not head_of(key) then
    remove_from(READY, key)
    ready_changed()
  end
elseif remove_from(SCHEDULE, id) + remove_from(DEAD, id) > 0 then
  local of = redis.call('HGET', KEYS[KEYOF], id) or ''
  key = string.match(of, '^(.-)%z') or of
  redis.call('HDEL', KEYS[KEYOF], id)
else
  return false
end
redis.call('HDEL', KEYS[DATA], id)
redis.call('HDEL', KEYS[ERRORS], id)
return key
