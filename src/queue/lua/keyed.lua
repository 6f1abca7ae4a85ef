-- The keyed queue's helpers, shared by the keyed scripts after the prelude.
-- A message pushed with a key waits in its key's line and is claimed only
-- with the key's lock (`<p>:lock:{<key>}`, the very lock a `Locker` takes)
-- or one of its permits; a key's messages live in a partition
-- `<p>:{<t>}:<q>` (<t>: a slot's tag, see src/queue/keyed.rs): on one
-- server the queue's own slot's, every key's; on a Redis Cluster the hash
-- slot of the key's lock, so one script sees the lock and the line. Every
-- keyed script takes the partition's keys first, in this order:
-- KEYS[1] data: hash id -> record (the queue's record format); a keyed
--   message's id here is its stored id (see stored_id), as everywhere below
-- KEYS[2] schedule: zset id -> due ms (delayed messages and re-driven dead
--   letters, until they are due and join their key's line)
-- KEYS[3] active: zset "<line member>:<claim>" -> lease deadline
-- KEYS[4] dead: zset id -> time buried   KEYS[5] errors: hash id -> last error
-- KEYS[6] claims: the last claim number   KEYS[10] seq: the last seq handed
--   out (both the queue's on one server, `<p>:{<q>}:keyed:claims` and
--   `:keyed:seq`, as the counts below; a claim call over several
--   partitions takes one number for them all)
-- KEYS[7] lines: zset of every message in line, score 0, "<key>\0<seq>\0<id>"
--   (seq: 16 digits, see next_seq): a key's line is a lex range, its head
--   the range's first
-- KEYS[8] ready: zset key -> from when its head may be claimed (ms), or
--   AT_WORK while a key with a lock is at work
-- KEYS[9] keyof: hash id -> key, for a message out of line (delayed, dead);
--   of a key with limits "<key>\0<seq>\0<permits>\0<rate>": the place in
--   line it takes back when due (a retry's delay; "" for none) and the
--   key's limits, which it brings back (permits 0: the key's lock)
-- KEYS[11] limits: hash key -> its permits, for a key pushed with permits
--   (`Locker::acquire_permit`'s set, not its lock); "<key>\0rate" -> its
--   rate "<limit>/<period µs>/<burst>/<window µs>" (`Locker::admit`'s log)
-- KEYS[12] counts: hash "lines", "schedule", "active", "dead" -> how many
--   messages those sets hold, and "keys" -> how many keys the ready sets
--   hold, kept by every script that changes them (see tally): on one
--   server the queue's (`<p>:{<q>}:keyed:counts`, over all its
--   partitions), on a Redis Cluster the partition's own, with "v", the
--   number of its last change (see tally_version)
-- KEYS[13] oldest: zset partition (its ready set's name) -> its earliest
--   ready time above 0 (see tally), as counts: the queue's on one server
-- KEYS[14] leases: zset partition (its tag, the text between the braces
--   of its keys' names) -> at most its earliest lease deadline (ms), kept
--   by every script that leases a message (see leased_until) and set by
--   recovery to the partition's earliest one (none: removed), so that a
--   recovery sweep visits only the partitions where a lease may have run
--   out: the queue's on one server; on a cluster the partition's own,
--   lowered and never read (the callers keep the queue's there, see
--   src/queue/keyed/claim.rs and lua/leases_settle.lua)
-- A script's own keys follow, from KEYS[MORE + 1] on. The helpers below
-- name the partition's keys through K, the partition at hand: KEYS itself,
-- unless a call over several partitions moved to another (see
-- enter_partition).
-- The queue's own keys (its doorbell, its index of partitions) live in the
-- queue's slot: the caller rings and indexes after a script. A claimed
-- message leaves its line for the active set; a retry, a release or an
-- expired lease put it back at its place, first in line.
local DATA, SCHEDULE, ACTIVE, DEAD, ERRORS, CLAIMS = 1, 2, 3, 4, 5, 6
local LINES, READY, KEYOF, SEQ, LIMITS = 7, 8, 9, 10, 11
local COUNTS, OLDEST, LEASES, MORE = 12, 13, 14, 14
-- A push names a partition's keys but `leases` (it leases nothing): the
-- 13 keys producers in other languages send (docs/internals.md).
local PUSH_KEYS = 13
local AT_WORK = -1
local K = KEYS

-- What this call changed in its partition's counted sets, by set, until
-- `tally` writes it: the counts cost a field's increment per set a call
-- changes, never a scan of the partitions.
local COUNTED = {{LINES, 'lines'}, {SCHEDULE, 'schedule'}, {ACTIVE, 'active'}, {DEAD, 'dead'},
  {READY, 'keys'}}
local moved = {}

-- Notes that `n` messages joined counted set `set` (left it, below 0).
local function counted(set, n)
  moved[set] = (moved[set] or 0) + n
end

-- `ZADD` to a counted set, counted; returns how many joined.
local function add_to(set, score, member)
  local n = redis.call('ZADD', K[set], score, member)
  counted(set, n)
  return n
end

-- `ZREM` from a counted set, counted; returns how many left.
local function remove_from(set, member)
  local n = redis.call('ZREM', K[set], member)
  counted(set, -n)
  return n
end

-- What this call did to the partition's earliest ready time above 0 (a
-- key woken by a release, at 0, or at work, below, is no due message of
-- its own), which `oldest` keeps: `lowered_to` a time it may have fallen
-- to (a key became ready from then); `reread` when it may have risen too
-- (a ready key claimed or gone). The usual turn costs one command or
-- none here: a push readies a new key, an ack lets a key at work go.
local lowered_to, reread = nil, false
-- The partition's first ready key and its time, when the call read it
-- last (`answer`, the claim's), so that `tally` need not read it again.
local first_read = nil

-- A key of the partition became ready from `at`.
local function ready_from(at)
  if not lowered_to or at < lowered_to then lowered_to = at end
end

-- A ready key may have been claimed or gone: `tally` reads the earliest.
local function ready_changed()
  reread = true
end

-- Adds this call's moves to the counts.
local function tally_counts()
  for _, set in ipairs(COUNTED) do
    local n = moved[set[1]]
    if n and n ~= 0 then redis.call('HINCRBY', K[COUNTS], set[2], n) end
  end
  moved = {}
end

-- The writes to `oldest` this call owes, by oldest key, then by partition
-- (its ready set's name): {'set', ms}, {'lt', ms} (lowered to ms, or added
-- if absent) or {'gone'}; `tally` writes them in at most three commands
-- per oldest key, however many partitions the call went over.
local owed_oldest = {}

-- Owes `oldest` the partition at hand's `op` (see owed_oldest): a reread
-- ('set', 'gone') is the partition's as it is now; 'lt' lowers what is
-- owed already.
local function owe_oldest(op, ms)
  local owed = owed_oldest[K[OLDEST]] or {}
  owed_oldest[K[OLDEST]] = owed
  local was = owed[K[READY]]
  if op == 'lt' and was then
    if was[1] == 'gone' then
      op = 'set'
    else
      op, ms = was[1], math.min(was[2], ms)
    end
  end
  owed[K[READY]] = {op, ms}
end

-- Keeps the partition's earliest ready time in `oldest` (owed, see
-- owed_oldest).
local function tally_ready()
  if reread then
    local first = first_read
    if not first or first[2] == '0' then
      first = redis.call('ZRANGEBYSCORE', K[READY], '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    end
    if first[2] then
      owe_oldest('set', tonumber(first[2]))
    else
      owe_oldest('gone')
    end
  elseif lowered_to then
    owe_oldest('lt', lowered_to)
  end
  lowered_to, reread, first_read = nil, false, nil
end

-- Writes what this call owes `oldest`.
local function tally_oldest()
  for oldest, owed in pairs(owed_oldest) do
    local set, lt, gone = {}, {}, {}
    for ready, op in pairs(owed) do
      if op[1] == 'gone' then
        gone[#gone + 1] = ready
      else
        local to = op[1] == 'set' and set or lt
        to[#to + 1] = op[2]
        to[#to + 1] = ready
      end
    end
    if #set > 0 then redis.call('ZADD', oldest, unpack(set)) end
    -- LT adds a partition that had no entry, and lowers one that had.
    if #lt > 0 then redis.call('ZADD', oldest, 'LT', unpack(lt)) end
    if #gone > 0 then redis.call('ZREM', oldest, unpack(gone)) end
  end
  owed_oldest = {}
end

-- The last seq handed out by this call, by seq key (see next_seq), until
-- `tally` writes it: a call reads and writes each seq key once, however
-- many messages it puts in line.
local last_seqs = {}

-- Keeps the last seq this call handed out in each seq key.
local function tally_seqs()
  for name, seq in pairs(last_seqs) do
    redis.call('SET', name, string.format('%016d', seq))
  end
  last_seqs = {}
end

-- The tag of the partition whose active set is `active` (its member in
-- `leases`).
local function tag_of(active)
  return string.match(active, '{(.-)}')
end

-- The earliest lease deadline this call gave in each partition, by leases
-- key, then partition, until `tally` writes them: one command per call,
-- however many partitions it leased in.
local owed_leases = {}

-- A message of the partition at hand is leased until `deadline` (ms).
local function leased_until(deadline)
  local owed = owed_leases[K[LEASES]] or {}
  owed_leases[K[LEASES]] = owed
  local tag = tag_of(K[ACTIVE])
  if not owed[tag] or deadline < owed[tag] then owed[tag] = deadline end
end

-- Lowers the partitions' entries in `leases` to the deadlines this call
-- gave (`LT` adds a partition that had none).
local function tally_leases()
  for leases, owed in pairs(owed_leases) do
    local args = {}
    for tag, deadline in pairs(owed) do
      args[#args + 1] = deadline
      args[#args + 1] = tag
    end
    redis.call('ZADD', leases, 'LT', unpack(args))
  end
  owed_leases = {}
end

-- On a Redis Cluster, where a partition keeps counts of its own (KEYS[12]
-- in the partition's slot, where one server's are the queue's), numbers
-- this call's change of them or of its earliest ready time in their `v`:
-- the queue's handles copy a partition's counts into the queue's slot
-- after changing it, and the newest copy wins there
-- (src/queue/keyed/mirror.rs, lua/keyed_mirror.lua).
local function tally_version()
  if next(moved) == nil and not reread and not lowered_to then return end
  -- The partition's own counts: its keys' names but the last part.
  if string.sub(K[COUNTS], 1, -8) == string.sub(K[ACTIVE], 1, -8) then
    redis.call('HINCRBY', K[COUNTS], 'v', 1)
  end
end

-- At the end of a script that changes the partition (see `counted` in
-- src/queue/keyed.rs): adds its moves to the counts, keeps the
-- partition's earliest ready time in `oldest`, the earliest lease
-- deadlines in `leases`, and the last seq handed out.
local function tally()
  tally_version()
  tally_counts()
  tally_ready()
  tally_oldest()
  tally_leases()
  tally_seqs()
end

-- Moves the helpers to the partition whose `width` keys (MORE, or
-- PUSH_KEYS for a push; in the order above) follow KEYS[base] in a call
-- over several, after keeping the earliest ready time of the one left;
-- its moves are added to the counts once its successor keeps others (on
-- one server every partition keeps the queue's: added once, at the end).
local function enter_partition(base, width)
  local next = {}
  for i = 1, width or MORE do next[i] = KEYS[base + i] end
  tally_ready()
  if next[COUNTS] ~= K[COUNTS] then tally_counts() end
  K = next
end

-- A keyed message's id as its partition stores it (the field of `data`,
-- the member of `schedule`, `dead` and `keyof`, the last part of its line
-- member): "<key>\0<id>". An id is unique within its key: the same id
-- under another key is another message, whichever partition that key's
-- lock hashes to. Only the push scripts make one; every other script
-- takes it from its caller or its line as it is.
local function stored_id(key, id)
  return key .. '\0' .. id
end

local function line_member(key, seq, id)
  return key .. '\0' .. seq .. '\0' .. id
end

-- The seq a message joins its line with (16 digits, so that the text
-- orders as the number): the time `since` (ms) in thousandths, for a
-- message that takes the place its push time gives it (one deferred into
-- the line); else the time `now` in thousandths, and always above every
-- seq handed out before (the last one is kept, see last_seqs), so that a
-- push goes last in line, whatever the clock does. Equal seqs order by id.
local function next_seq(now, since)
  if since then return string.format('%016d', since * 1000) end
  local last = last_seqs[K[SEQ]] or tonumber(redis.call('GET', K[SEQ])) or 0
  local seq = math.max(now * 1000, last + 1)
  last_seqs[K[SEQ]] = seq
  return string.format('%016d', seq)
end


-- Puts a message in its key's line at `seq` (before the messages pushed
-- after it); the key becomes ready at `now` unless its head is at work or
-- it waits already.
local function rejoin(key, seq, id, now)
  add_to(LINES, 0, line_member(key, seq, id))
  local new = redis.call('ZADD', K[READY], 'NX', now, key)
  counted(READY, new)
  if new == 1 then ready_from(now) end
end

-- Puts a due message in its key's line, last (or at the place `since`
-- gives it, see next_seq).
local function enter_line(key, id, now, since)
  rejoin(key, next_seq(now, since), id, now)
end

-- The id first in a key's line and its seq, or nil.
local function head_of(key)
  local first = redis.call('ZRANGE', K[LINES], '[' .. key .. '\0', '(' .. key .. '\1',
    'BYLEX', 'LIMIT', 0, 1)[1]
  if not first then return nil end
  return string.sub(first, #key + 19), string.sub(first, #key + 2, #key + 17)
end

-- The first `n` messages of a key's line: {id, seq} each.
local function heads_of(key, n)
  local firsts = redis.call('ZRANGE', K[LINES], '[' .. key .. '\0', '(' .. key .. '\1',
    'BYLEX', 'LIMIT', 0, n)
  local heads = {}
  for i, first in ipairs(firsts) do
    heads[i] = {string.sub(first, #key + 19), string.sub(first, #key + 2, #key + 17)}
  end
  return heads
end

-- After a key's turn: ready from `from` when its line has a head, else gone
-- from the ready keys. Returns whether it has a head. `at_work`: the key
-- was surely at work with its lock (ready at AT_WORK, below every time),
-- so it lowers the earliest ready time or leaves it as it was; else (a key
-- with permits, ready while at work; a key whose run recovery made ready
-- for a message of it whose lease ran out) it may raise it. `empty`: the
-- caller found the key's line empty since its last change (nothing read).
local function after_turn(key, from, at_work, empty)
  if not at_work then ready_changed() end
  if not empty and head_of(key) then
    add_to(READY, from, key)
    ready_from(from)
    return true
  end
  remove_from(READY, key)
  return false
end

local function rate_of(key)
  return redis.call('HGET', K[LIMITS], key .. '\0rate') or nil
end

-- A key's permits (0: its lock) and its rate limit (nil: none), in one read.
local function limits_of(key)
  local limits = redis.call('HMGET', K[LIMITS], key, key .. '\0rate')
  return tonumber(limits[1]) or 0, limits[2] or nil
end

-- The field of `limits` that notes `key`'s run at work (see keyed_done.lua).
local function run_field(key)
  return key .. '\0run'
end

-- The run's line members listed in `run` (the note's value) and its claim.
local function run_members(run)
  local claim, from = string.match(run, '^(%d+):()')
  local members = {}
  while from and from <= #run do
    local length, at = string.match(run, '^(%d+):()', from)
    members[#members + 1] = string.sub(run, at, at + tonumber(length) - 1)
    from = at + tonumber(length)
  end
  return members, claim
end

-- Forgets a key's limits once nothing of it is left in line or at work (a
-- message of it out of line brings them back: see aside), and its run's
-- note, if a run's worker died (see keyed_done.lua).
local function forget_limits(key)
  redis.call('HDEL', K[LIMITS], key, key .. '\0rate', run_field(key))
end

-- The keyof entry of a message of `key` out of line, with its place `seq`
-- ("" for none) and the key's limits: permits `limit` and its rate.
local function aside(key, seq, limit)
  local rate = rate_of(key)
  if limit > 0 or rate or seq ~= '' then
    return key .. '\0' .. seq .. '\0' .. limit .. '\0' .. (rate or '')
  end
  return key
end

-- Sets what a push says of `key`'s limits: `permits` and `rate` ("" leaves
-- each as it is).
local function set_limits(key, permits, rate)
  if permits ~= '' then redis.call('HSET', K[LIMITS], key, permits) end
  if rate ~= '' then redis.call('HSET', K[LIMITS], key .. '\0rate', rate) end
end

-- Puts a new message `id` of `key` in line, or aside until `due`; `since`
-- (ms, or nil) places it by that time rather than last (see next_seq).
local function place(key, id, due, now, since)
  if due <= now then
    enter_line(key, id, now, since)
  else
    local seq = since and next_seq(now, since) or ''
    redis.call('HSET', K[KEYOF], id, aside(key, seq, tonumber(redis.call('HGET', K[LIMITS], key)) or 0))
    add_to(SCHEDULE, due, id)
  end
end

-- Admits a message under its key's `rate` limit (nil: none) in `log`, for
-- `member` at `now_us` (see rate.lua, prepended where this is called);
-- returns 0 when admitted, else the ms until its next slot.
local function rate_wait(rate, log, member, now_us)
  if not rate then return 0 end
  local limit, period, burst, window = string.match(rate, '^(%d+)/(%d+)/(%d+)/(%d+)$')
  if not window then return 0 end
  local r = admit(log, tonumber(limit), tonumber(period), tonumber(burst), tonumber(window),
    member, false, now_us)
  if r[1] == 1 then return 0 end
  return math.max(math.ceil(r[2] / 1000), 1)
end

-- The member of a key's permits' line that says the queue waits for one
-- of them: `free_permit` passes over it (it is no waiter) and so publishes
-- each release while it stands; a claim that takes a permit removes it.
local QUEUE_WAITS = 'queue'

-- Marks a permits' line waited for by the queue, for `ttl` ms at least.
local function wait_for_permit(line, ttl)
  redis.call('ZADD', line, 'NX', 0, QUEUE_WAITS)
  if redis.call('PTTL', line) < ttl then redis.call('PEXPIRE', line, ttl) end
end

-- Whether others than the queue wait in a permits' line.
local function waiters_beside_queue(line)
  local n = redis.call('ZCARD', line)
  return n > 1 or (n == 1 and not redis.call('ZSCORE', line, QUEUE_WAITS))
end

-- Moves up to `max` messages that are due from the schedule into their
-- keys' lines, in due order: at the end, or back at their place.
local function promote(now, max)
  local due = redis.call('ZRANGEBYSCORE', K[SCHEDULE], '-inf', now, 'LIMIT', 0, max)
  for _, id in ipairs(due) do
    remove_from(SCHEDULE, id)
    local of = redis.call('HGET', K[KEYOF], id)
    redis.call('HDEL', K[KEYOF], id)
    if of and redis.call('HEXISTS', K[DATA], id) == 1 then
      local key, seq, limit, rate = string.match(of, '^(.-)%z(%d*)%z(%d+)%z(.*)$')
      if limit and limit ~= '0' then redis.call('HSETNX', K[LIMITS], key, limit) end
      if rate and rate ~= '' then redis.call('HSETNX', K[LIMITS], key .. '\0rate', rate) end
      if seq and seq ~= '' then rejoin(key, seq, id, now) else enter_line(key or of, id, now) end
    end
  end
end

-- Whether a lock value "<token>[:<fence>][!]" names `token`.
local function owns(value, token)
  local after = string.byte(value, #token + 1)
  return string.sub(value, 1, #token) == token and (after == nil or after == 58 or after == 33)
end
