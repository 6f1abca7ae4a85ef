-- Parks a claimed message on its busy key (see parking.lua): it waits
-- behind the messages parked there that were pushed before it, and comes
-- back when the key's lock is released, or when it expires.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: active   KEYS[4]: parked set
-- KEYS[5]: lock, or permits set   KEYS[6]: dead   KEYS[7]: bell   KEYS[8]: prioritized
-- KEYS[9]: events
-- ARGV[1]: active member "<id>:<claim>"   ARGV[2]: id
-- ARGV[3]: PARK_CHECK: how far ahead the messages behind the head are
--          scheduled, in ms
-- ARGV[4]: the most deferrals a message may have had before it parks ("" for
--          no limit)
-- ARGV[5]: how many permits the key has ("" for a lock)
-- ARGV[6]: the events' cap ("" for no events)
-- Returns the due time in ms; -1 when the claim is no longer held; -2 (and
-- changes nothing) when the message would park a first time with as many
-- deferrals as the limit allows already.
local check = tonumber(ARGV[3])
if not check then
  return redis.error_reply('ERR lockgate park: bad check interval "' .. ARGV[3] .. '"')
end
local id = ARGV[2]
local record = redis.call('HGET', KEYS[1], id)
if not record then return -1 end
local first = not redis.call('ZSCORE', KEYS[4], id)
local enq, failures, deferrals, stalls, payload, priority = parse_or_keep(record)
local max = tonumber(ARGV[4])
if first and max and deferrals >= max then
  -- Nothing changed; the claim may or may not be held still.
  if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return -2 end
  return -1
end
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return -1 end
local now = now_ms()
if first then
  -- Parked for the first time: one deferral. (A parked message that came
  -- back before its turn is put back in its place, counting nothing.)
  redis.call('HSET', KEYS[1], id, make_record(enq, failures, deferrals + 1, stalls, payload, priority))
  redis.call('ZADD', KEYS[4], tonumber(enq), id)
end
-- When the lock ends, or a permit frees (at once if it just did).
local lock_ends
local limit = tonumber(ARGV[5])
if limit then
  lock_ends = now + permit_wait(KEYS[5], limit, now)
else
  local pttl = redis.call('PTTL', KEYS[5])
  lock_ends = now + math.max(pttl, 0)
  if pttl == -1 then -- set without expiry by someone else: look again later
    lock_ends = now + check
  end
end
local due = now + check
local head, dropped = first_live(KEYS[4], KEYS[1], KEYS[6], KEYS[2], KEYS[8], id)
if head == id then
  due = lock_ends
elseif head and dropped then
  bring_forward(KEYS[2], KEYS[8], KEYS[7], head, lock_ends)
end
schedule_at(KEYS[2], KEYS[8], KEYS[7], id, due, priority)
emit(KEYS[9], ARGV[6], 'parked', now, nil, {id, failures + 1})
-- The set goes away by itself once nothing parks on the key any more.
redis.call('PEXPIRE', KEYS[4], math.max(2 * check, lock_ends - now + check))
return due
