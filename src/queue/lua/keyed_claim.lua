-- Claims the heads of ready keys' lines together with the keys' locks (see
-- keyed.lua), after moving the messages that became due into their lines.
-- KEYS[1..10]: the partition   KEYS[11..]: the locks of the candidate keys
-- ARGV[1]: lease in ms (the lock's too)   ARGV[2]: how many at most
-- ARGV[3]: how many candidates to name for the next call
-- ARGV[4..]: per candidate, its key and a fresh lock token, in KEYS' order
-- A candidate is claimed when it is ready (its line has a head, not at
-- work, not waiting out a retry's delay) and its lock is free. A lock held
-- by other code (a `Locker`) is marked waited for, so that its release
-- publishes; the key waits until the lock's expiry at the latest.
-- Returns {claim, now, the next time a key or a delayed message is due (ms,
-- -1 for none), {candidate keys}, {key, id, seq, record, ...}, {key whose
-- lock other code holds, the lock's ms left, ...}}.
local now, now_us = server_time()
local lease, max = tonumber(ARGV[1]), tonumber(ARGV[2])
promote(now, 1000)
local claimed, blocked, tag, deadline = {}, {}, nil, now + lease
for i = 1, #KEYS - 10 do
  if #claimed >= 4 * max then break end
  local key, token, lock = ARGV[2 + 2 * i], ARGV[3 + 2 * i], KEYS[10 + i]
  local from = tonumber(redis.call('ZSCORE', KEYS[READY], key))
  if from and from >= 0 and from <= now then
    local id, seq = head_of(key)
    local value = id and redis.call('GET', lock)
    if not id then
      redis.call('ZREM', KEYS[READY], key)
    elseif value then
      if string.byte(value, -1) ~= 33 then redis.call('APPEND', lock, '!') end
      local pttl = math.max(redis.call('PTTL', lock), 0)
      redis.call('ZADD', KEYS[READY], now + pttl, key)
      blocked[#blocked + 1] = key
      blocked[#blocked + 1] = pttl
    else
      tag = tag or next_claim(now_us)
      redis.call('SET', lock, token, 'PX', lease)
      redis.call('ZADD', KEYS[READY], AT_WORK, key)
      redis.call('ZADD', KEYS[ACTIVE], deadline, line_member(key, seq, id) .. ':' .. tag)
      claimed[#claimed + 1] = key
      claimed[#claimed + 1] = id
      claimed[#claimed + 1] = seq
      claimed[#claimed + 1] = redis.call('HGET', KEYS[DATA], id) or ''
    end
  end
end
local candidates = redis.call('ZRANGEBYSCORE', KEYS[READY], 0, now, 'LIMIT', 0, tonumber(ARGV[3]))
local next_at = -1
local first = redis.call('ZRANGEBYSCORE', KEYS[READY], 0, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2]
if first then next_at = tonumber(first) end
local due = head_due(KEYS[SCHEDULE])
if due and (next_at < 0 or due < next_at) then next_at = due end
return {tag and tonumber(tag) or 0, now, next_at, candidates, claimed, blocked}
