-- Extends the lease of a keyed message at work and its key's lock or permit
-- together (see keyed.lua), if the caller still holds the claim. A renewal
-- after the lease ran out (before recovery ended the turn) takes the lock
-- (a permit) again if it is free, as any late renewal keeps its claim.
-- The lock gets the new lease, or the longest lease of the other messages
-- of its run still at work if longer (see keyed_done.lua): the key's lock
-- outlives each of its messages at work, whichever a renewal names.
-- KEYS[1..13]: the partition   KEYS[14]: the key's lock, or its permits' set
-- ARGV[1]: the active member "<line member>:<claim>"   ARGV[2]: the token
-- ARGV[3]: lease in ms   ARGV[4]: the key's permits ("0": its lock)
-- Returns 1 when extended, 0 when the claim or the lock is lost.

-- How long the longest lease of the other messages at work of the run of
-- `active` (an active member) still lasts: 0 for none (no run noted under
-- its claim, or no other still at work).
local function run_left(active, now)
  local member, claim = string.match(active, '^(.*):(%d+)$')
  local key = string.match(member, '^(.-)%z')
  local run = redis.call('HGET', KEYS[LIMITS], run_field(key))
  if not run then return 0 end
  local members, noted = run_members(run)
  local latest = now
  for _, other in ipairs(noted == claim and members or {}) do
    local deadline = other ~= member
      and tonumber(redis.call('ZSCORE', KEYS[ACTIVE], other .. ':' .. claim))
    if deadline and deadline > latest then latest = deadline end
  end
  return latest - now
end

if not redis.call('ZSCORE', KEYS[ACTIVE], ARGV[1]) then return 0 end
local token, ttl, limit = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
if limit > 0 then
  if redis.call('ZSCORE', KEYS[MORE + 1], token) then
    redis.call('ZADD', KEYS[MORE + 1], 'XX', now + ttl, token)
    redis.call('PEXPIRE', KEYS[MORE + 1], ttl, 'GT')
  elseif take_permit(KEYS[MORE + 1], KEYS[MORE + 1], token, ttl, limit, '0', now)[1] ~= 1 then
    return 0
  end
else
  local value = redis.call('GET', KEYS[MORE + 1])
  if value and not owns(value, token) then return 0 end
  local keep = math.max(ttl, run_left(ARGV[1], now))
  if value then
    redis.call('PEXPIRE', KEYS[MORE + 1], keep)
  else
    redis.call('SET', KEYS[MORE + 1], token, 'PX', keep)
  end
end
redis.call('ZADD', KEYS[ACTIVE], 'XX', now + ttl, ARGV[1])
return 1
