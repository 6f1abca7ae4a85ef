-- Which of the given keys exist (one server only: the keys are in many
-- hash slots, which a cluster refuses in one script). Standalone (no
-- prelude). At most the caller's batch of keys (HEAL_BATCH, keyed.rs).
-- KEYS: keys to look for (a partition's data hash each)
-- Returns the 1-based places in KEYS of those that exist.
local found = {}
for i = 1, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then found[#found + 1] = i end
end
return found
