-- Starts a call of a keyed function (see `function` in
-- src/queue/keyed.rs, which puts this after keyed.lua): a library's
-- helpers and keyed.lua's state (K and what `tally` owes) outlive its
-- calls, so each call starts afresh here, whatever the last one left (one
-- that failed half way never tallied). A script starts fresh anyway.
local function begin_call()
  K, moved, owed_oldest, last_seqs, owed_leases = KEYS, {}, {}, {}, {}
  lowered_to, reread, first_read = nil, false, nil
end
