-- Parking messages on a busy key until its lock is released (DeferDelay::
-- until_released). Shared by the parking scripts, after the prelude and the
-- permit functions (src/lock/permits/permits.lua).
--
-- Keys of key <k> parked in queue <q> (all in hash slot {q}, so that one
-- script sees the lock and the queue):
--   <p>:{q}:lock:<k>    string the key's lock, "<token>[:<fence>][!]"
--   <p>:{q}:parked:<k>  zset   ids parked on the key, scored by the time
--                              they were pushed: they come back in push
--                              order (ties: by id)
-- and for a key with n permits (LockLayer::permits), instead of the lock:
--   <p>:{q}:permits:<k>         zset    its permits (src/lock/permits/)
--   <p>:{q}:permits-waiters:<k> zset    the line of waiters
--   <p>:{q}:permit-fences:<k>   hash    the holders' fences
--
-- A parked message stays on the schedule, as every waiting message does, so
-- it is never in no structure and never claimable twice; the parked set only
-- orders the key's messages. Its head is scheduled for when the lock
-- ends (its release makes it due at once; a holder that died lets it come
-- back at its lock's expiry); the others are scheduled PARK_CHECK ms ahead,
-- as a safety net, and re-parked in place if they come back early. With n
-- permits, the head is scheduled for when the first lease ends, each
-- release brings the head forward, and a head that takes a permit brings
-- the next one forward at once while permits are left.

-- The first parked id that is still a live message (not acknowledged,
-- removed or dead), dropping the others from the set's front; nil when
-- none is parked. Also returns whether a dead head was dropped (the new
-- head then needs to be scheduled). `live` names an id known to be live
-- (the caller's own message), which needs no check; a message waiting on
-- the schedule (or the prioritized set) is live too; else it is live if it exists and
-- is not a dead letter (it is claimed).
local function first_live(parked, data, dead, schedule, prioritized, live)
  local dropped = false
  for _ = 1, 100 do
    local head = redis.call('ZRANGE', parked, 0, 0)[1]
    if not head then return nil, dropped end
    if head == live or waiting(schedule, prioritized, head)
      or (redis.call('HEXISTS', data, head) == 1 and not redis.call('ZSCORE', dead, head)) then
      return head, dropped
    end
    redis.call('ZREM', parked, head)
    dropped = true
  end
  return nil, dropped
end

-- Brings a parked id forward to `due` if it is waiting on the schedule or
-- the prioritized set, in its band (not if it is claimed right now); rings
-- the bell when it moved.
local function bring_forward(schedule, prioritized, bell, id, due)
  if redis.call('ZADD', schedule, 'XX', 'LT', 'CH', due, id) == 1 then
    ring(bell)
    return
  end
  local score = redis.call('ZSCORE', prioritized, id)
  if score then
    local priority = unband(tonumber(score))
    if redis.call('ZADD', prioritized, 'XX', 'LT', 'CH', band_score(priority, due), id) == 1 then
      ring(bell)
    end
  end
end

-- Whether a lock value "<token>[:<fence>][!]" names `token`.
local function owns(value, token)
  local after = string.byte(value, #token + 1)
  return string.sub(value, 1, #token) == token and (after == nil or after == 58 or after == 33)
end
