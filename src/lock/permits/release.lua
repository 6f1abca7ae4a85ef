-- Gives a permit back and tells waiters: see free_permit in permits.lua,
-- which is prepended. The channel is named after the permits set, which has
-- its hash slot (SPUBLISH on a cluster, PUBLISH on a single server).
-- KEYS[1]: permits   KEYS[2]: mark   KEYS[3]: fences (see fence.lua)
-- ARGV[1]: holder token   ARGV[2]: "PUBLISH" or "SPUBLISH"
-- ARGV[3]: "1" when a fence was issued to this holder
-- Returns 1 when released, 0 when the token held no permit.
return free_permit(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3] == '1')
