-- Releases a lock, but only for the holder whose token it still stores. If
-- someone waits in line (the value ends in "!", see contend.lua), it is
-- handed to the first waiter whose process is alive (line.lua, prepended):
-- set to its token for the hand-off time, which the waiter's next try turns
-- into a whole TTL, and the token is published on the lock key's channel
-- (in the key's hash slot: SPUBLISH reaches a cluster node's waiters). So
-- waiters take the lock in the order they came, across processes; one that
-- dies after the hand-off reached it, or hangs with its connection open,
-- holds the lock up for the hand-off time at most. With the line empty, the
-- publish is empty: every waiter listening tries again. A token that does
-- not hold the lock leaves the line (a waiter that gave up: if the lock was
-- handed to it meanwhile, it holds it, and hands it on).
-- KEYS: lock ("<token>[:<fence>][!]"), waiters (see contend.lua)
-- ARGV: holder token, "PUBLISH" or "SPUBLISH", hand-off time in ms (the
--   same for every caller: a waiter counts on it)
-- Returns 1 when released, 0 when the lock was gone (expired, or a resent
-- release whose first copy ran), -1 when another token holds it.
-- Usual cost: GET, DEL (a hand-off: ZPOPMIN, PUBSUB NUMSUB, SET, ZCARD and a
-- publish).
local value = redis.call('GET', KEYS[1])
if value == ARGV[1] then -- the usual case: no fence, nobody waits
  redis.call('DEL', KEYS[1])
  return 1
end
if not holds(value, ARGV[1]) then -- see holds.lua, prepended
  redis.call('ZREM', KEYS[2], ARGV[1])
  return value and -1 or 0
end
if string.byte(value, -1) ~= 33 then -- nobody waits
  redis.call('DEL', KEYS[1])
  return 1
end
redis.call('ZREM', KEYS[2], ARGV[1]) -- never hand it to ourselves
local next = pop_live(KEYS[2], KEYS[1], ARGV[2]) -- see line.lua
if not next then
  redis.call('DEL', KEYS[1])
  redis.call(ARGV[2], KEYS[1], '')
  return 1
end
-- Marked again while others still wait: its release hands it on too.
local handed = next
if redis.call('ZCARD', KEYS[2]) > 0 then
  handed = next .. '!'
end
redis.call('SET', KEYS[1], handed, 'PX', ARGV[3])
redis.call(ARGV[2], KEYS[1], next)
return 1
