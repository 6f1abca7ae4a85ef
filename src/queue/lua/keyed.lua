-- The keyed queue: a message pushed with a key waits in its key's line and
-- is claimed only together with the key's lock, the very lock a `Locker`
-- takes (`<p>:lock:{<key>}`). Shared by the keyed scripts, after the prelude.
--
-- A key's messages live in a partition of the queue in the hash slot of the
-- key's lock, `<p>:{<t>}:<q>`, where <t> is the slot's tag (see
-- src/queue/keyed.rs): one script sees the lock and the line. Every keyed
-- script takes a partition's keys first, in this order:
--   KEYS[1]  data      hash  id -> record (the queue's record format)
--   KEYS[2]  schedule  zset  id -> due ms: delayed messages, and re-driven
--                            dead letters, until they are due and join
--                            their key's line
--   KEYS[3]  active    zset  "<id>:<claim>" -> lease deadline
--   KEYS[4]  dead      zset  id -> time buried
--   KEYS[5]  errors    hash  id -> last error
--   KEYS[6]  claims    string the last claim number
--   KEYS[7]  lines     zset  every due message, score 0, member
--                            "<key>\0<seq>\0<id>" (seq: 16 digits, the
--                            partition's counter): a key's line is a lex
--                            range, its head the range's first member
--   KEYS[8]  ready     zset  key -> from when its head may be claimed (ms):
--                            keys with a line and no message at work
--   KEYS[9]  held      hash  key -> "<id>:<claim>" at work on it
--   KEYS[10] keyof     hash  id -> "<key>\0<seq>" (seq "" while not in line)
--   KEYS[11] seq       string the partition's line counter
-- (The queue's own keys, its doorbell and its index of partitions, live in
-- the queue's slot: the caller rings and indexes after a script.)
-- A claimed message stays at its line's head until it is acknowledged or
-- buried: a retry, a release or an expired lease leave it first in line.
local DATA, SCHEDULE, ACTIVE, DEAD, ERRORS, CLAIMS = 1, 2, 3, 4, 5, 6
local LINES, READY, HELD, KEYOF, SEQ = 7, 8, 9, 10, 11

-- The key of an id's message, and its place in line ("" when not in one).
local function key_of(id)
  local value = redis.call('HGET', KEYS[KEYOF], id)
  if not value then return nil end
  return string.match(value, '^(.*)%z(%d*)$')
end

-- Puts a due message at the end of its key's line; the key becomes ready at
-- `now` unless a message of it is at work or it waits already.
local function enter_line(key, id, now)
  local seq = string.format('%016d', redis.call('INCR', KEYS[SEQ]))
  redis.call('HSET', KEYS[KEYOF], id, key .. '\0' .. seq)
  redis.call('ZADD', KEYS[LINES], 0, key .. '\0' .. seq .. '\0' .. id)
  if redis.call('HEXISTS', KEYS[HELD], key) == 0 then
    redis.call('ZADD', KEYS[READY], 'NX', now, key)
  end
end

-- Takes an id out of its key's line (and keeps its key on record while it
-- is a dead letter, which a re-drive puts back in line).
local function leave_line(id, keep)
  local key, seq = key_of(id)
  if not key then return nil end
  if seq ~= '' then redis.call('ZREM', KEYS[LINES], key .. '\0' .. seq .. '\0' .. id) end
  if keep then
    redis.call('HSET', KEYS[KEYOF], id, key .. '\0')
  else
    redis.call('HDEL', KEYS[KEYOF], id)
  end
  return key
end

-- The id first in a key's line, or nil.
local function head_of(key)
  local first = redis.call('ZRANGE', KEYS[LINES], '[' .. key .. '\0', '(' .. key .. '\1',
    'BYLEX', 'LIMIT', 0, 1)[1]
  if not first then return nil end
  return string.sub(first, #key + 19)
end

-- Moves up to `max` messages that are due from the schedule into their
-- keys' lines, in due order.
local function promote(now, max)
  local due = redis.call('ZRANGEBYSCORE', KEYS[SCHEDULE], '-inf', now, 'LIMIT', 0, max)
  for _, id in ipairs(due) do
    redis.call('ZREM', KEYS[SCHEDULE], id)
    local key = key_of(id)
    if key and redis.call('HEXISTS', KEYS[DATA], id) == 1 then enter_line(key, id, now) end
  end
end

-- The next claim number (see claim.lua: never handed out twice, also after
-- the server lost recent writes).
local function next_claim(now_us)
  local claim = math.max((tonumber(redis.call('GET', KEYS[CLAIMS])) or 0) + 1, now_us)
  local tag = string.format('%d', claim)
  redis.call('SET', KEYS[CLAIMS], tag)
  return tag
end

-- Whether a lock value "<token>[:<fence>][!]" names `token`.
local function owns(value, token)
  local after = string.byte(value, #token + 1)
  return string.sub(value, 1, #token) == token and (after == nil or after == 58 or after == 33)
end

-- Lets go of a key's lock held by `token`; a release that someone waited
-- for (the value ends in "!") is published on the lock's channel.
local function unlock(lock, token, publish)
  local value = redis.call('GET', lock)
  if not value or not owns(value, token) then return end
  redis.call('DEL', lock)
  if string.byte(value, -1) == 33 then redis.call(publish, lock, '') end
end
