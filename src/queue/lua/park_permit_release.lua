-- Gives a key's permit back (only the token's): to the first waiter in
-- line, if one stands there, else by bringing the first message parked on
-- the key back, due now: park_release.lua for a key with n permits (see
-- parking.lua and src/lock/permits/permits.lua).
-- KEYS[1]: permits set   KEYS[2]: parked set   KEYS[3]: data   KEYS[4]: dead
-- KEYS[5]: schedule   KEYS[6]: bell   KEYS[7]: prioritized   KEYS[8]: line of waiters
-- KEYS[9]: fences
-- ARGV[1]: holder token   ARGV[2]: "PUBLISH" or "SPUBLISH"
-- ARGV[3]: "1" when a fence was issued to this holder
-- ARGV[4]: the limit the permit was taken under   ARGV[5]: hand-off time, ms
-- ARGV[6]: id of the message that held the permit ("" for none): it had its
--          turn, so it leaves the parked set (a parked message handed a
--          permit by the line of waiters never went through the acquire
--          script that takes it out; left there, it would hide the next
--          parked message from every release until its own record is gone)
-- Returns 1 when released, 0 when the token held no permit.
local freed = free_permit(KEYS[1], KEYS[8], KEYS[9], ARGV[1], ARGV[4], ARGV[2],
  ARGV[3] == '1', tonumber(ARGV[5]))
if freed == 0 then
  return 0
end
if ARGV[6] and ARGV[6] ~= '' then redis.call('ZREM', KEYS[2], ARGV[6]) end
if freed == 1 then -- free, not handed to a waiter in line
  local head = first_live(KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[7])
  if head then
    bring_forward(KEYS[5], KEYS[7], KEYS[6], head, now_ms())
  end
end
return 1
