-- Extends the leases of keyed messages at work and their keys' locks or
-- permits together (see keyed.lua), each if its caller still holds the
-- claim: the messages of one server's partitions in one call (of one
-- slot's, on a cluster), a block each. A renewal after the lease ran out
-- (before recovery ended the turn) takes the lock (a permit) again if it
-- is free, as any late renewal keeps its claim. The lock gets the new
-- lease, or the longest lease of the other messages of its run still at
-- work if longer (see keyed_done.lua): the key's lock outlives each of its
-- messages at work, whichever a renewal names.
-- KEYS, per message: its partition's keys (MORE), then its key's lock or
-- its permits' set
-- ARGV[1]: lease in ms; per message, from ARGV[2]: the active member
-- "<line member>:<claim>", the token, the key's permits ("0": its lock)
-- Returns per message 1 when extended, 0 when the claim or the lock is
-- lost.
local now = now_ms()
local ttl = tonumber(ARGV[1])

-- How long the longest lease of the other messages at work of the run of
-- `active` (an active member) in the partition from KEYS[base + 1] still
-- lasts: 0 for none (no run noted under its claim, or no other at work).
local function run_left(base, active)
  local member, claim = string.match(active, '^(.*):(%d+)$')
  local key = string.match(member, '^(.-)%z')
  local run = redis.call('HGET', KEYS[base + LIMITS], run_field(key))
  if not run then return 0 end
  local members, noted = run_members(run)
  local latest = now
  for _, other in ipairs(noted == claim and members or {}) do
    local deadline = other ~= member
      and tonumber(redis.call('ZSCORE', KEYS[base + ACTIVE], other .. ':' .. claim))
    if deadline and deadline > latest then latest = deadline end
  end
  return latest - now
end

-- Extends one message's lease (`active`, under `token`) and its hold: the
-- block from KEYS[base + 1].
local function extend(base, active, token, limit)
  local was = tonumber(redis.call('ZSCORE', KEYS[base + ACTIVE], active))
  if not was then return 0 end
  local hold = KEYS[base + MORE + 1]
  if limit > 0 then
    if redis.call('ZSCORE', hold, token) then
      redis.call('ZADD', hold, 'XX', now + ttl, token)
      redis.call('PEXPIRE', hold, ttl, 'GT')
    elseif take_permit(hold, hold, token, ttl, limit, '0', now)[1] ~= 1 then
      return 0
    end
  else
    local value = redis.call('GET', hold)
    if value and not owns(value, token) then return 0 end
    local keep = math.max(ttl, run_left(base, active))
    if value then
      redis.call('PEXPIRE', hold, keep)
    else
      redis.call('SET', hold, token, 'PX', keep)
    end
  end
  redis.call('ZADD', KEYS[base + ACTIVE], 'XX', now + ttl, active)
  -- A shorter lease than the one it replaces may run out before the
  -- partition's entry in `leases` says.
  if now + ttl < was then
    redis.call('ZADD', KEYS[base + LEASES], 'LT', now + ttl, tag_of(KEYS[base + ACTIVE]))
  end
  return 1
end

local extended = {}
for block = 0, #KEYS / (MORE + 1) - 1 do
  local base, arg = block * (MORE + 1), 2 + block * 3
  extended[block + 1] = extend(base, ARGV[arg], ARGV[arg + 1], tonumber(ARGV[arg + 2]))
end
return extended
