-- Gives a permit back, handing it to the first waiter in line: see
-- free_permit in permits.lua, which is prepended. The channel is named after
-- the permits set, in its hash slot.
-- KEYS: permits, line, fences (see fence.lua)
-- ARGV: holder token, the limit it was taken under, "PUBLISH" or "SPUBLISH",
--   "1" when a fence was issued to this holder, the hand-off time in ms
-- Returns 1 when released (2: and handed on), 0 when the token held no
-- permit.
return free_permit(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1',
  tonumber(ARGV[5]))
