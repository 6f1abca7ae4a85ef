-- Claims the heads of ready keys' lines with the keys' locks or permits
-- (see keyed.lua), after moving the messages that became due into their
-- lines: in one partition, or in several at once on one server (a block
-- each, claimed in turn). A key with a lock and no rate limit gives up to
-- ARGV[3] of its first messages at once, a run under one lock and claim
-- number (see keyed_done.lua), noted as a hand-over's run is.
-- KEYS, per block: the partition's 14 keys; per candidate key, its lock,
-- its permits' set, the set's line of waiters and its rate limit log; then
-- the call's record, last
-- ARGV[1]: lease in ms (the lock's or permit's too)
-- ARGV[2]: how long to keep a record (ms)
-- ARGV[3]: how many messages of a key with a lock a turn may take (a run)
-- ARGV[4]: a number drawn at random for the call, which spreads the keys
-- its answers name (see answer)
-- ARGV[5..], per block: how many turns at most; how many candidates to name for
-- its next call; how many candidates it has; per candidate, its key and a
-- fresh token, in KEYS' order
-- A candidate is claimed when it is ready (a head in line, no delay to wait
-- out, no message of a key with a lock at work), its key has room (its lock
-- free, or fewer than its permits held, by the queue or other code alike)
-- and its rate limit admits it (counted in `Locker::admit`'s log). A key
-- that other code keeps full is marked waited for, so that a release
-- publishes, and waits for that or the first lease's end; a key over its
-- rate waits for its next slot. A key with permits gives one message per
-- call: one with room left is named again for the next.
-- Returns per block {claim, when a key or a delayed message is due next
-- (ms, -1 for none), {candidate keys}, {key, id, seq, permits (0: the
-- lock), 1 if the key has a rate limit else 0, record, ...} (a run's
-- messages one after another, in line order), {key that
-- other code keeps full, the lock or set to watch, ms until its first
-- lease ends, ...}, what the partition holds: 0 no message at all, 1 a
-- message at work, 2 messages, none at work, {{key whose claim a command
-- refused, the error}, ...}}.
-- The call's record ("<lease deadline>", then ";<claim>:<count>" per
-- block, "0:0" for one that took nothing), named by the caller for this
-- call alone, makes the call safe to resend (see claim.lua): a resend
-- answers the turns the first call took that still hold, and takes
-- nothing more. One record per call, however many blocks: read once,
-- written once.
-- The call's clock, terms and record, set by `main` (a function's state
-- outlives its calls, see keyed_call.lua).
local now, now_us, lease, RUN, RECORD, SPREAD
-- The block at hand: where its keys and arguments start (KEYS[kb + 1],
-- ARGV[ab + 1]), its most turns; what it claimed (messages), found
-- blocked, its claim number, its leases' deadline, its turns taken, the
-- keys whose claim a command refused.
local kb, ab, max
local claimed, blocked, tag, deadline, turns, refused

-- The answer after the turns `claimed` (and the keys `blocked`): the keys
-- to name next, when one is due next, what the partition holds. `due`:
-- the schedule's head as the block last read it (false: read it here).
-- Under a backlog it reads one thing: the first ready keys, whether ready
-- now or later (the first of them is the earliest); the rest only when
-- that leaves it open.
local function answer(tag, claimed, blocked, due)
  local name = tonumber(ARGV[ab + 2])
  local ready = redis.call('ZRANGEBYSCORE', K[READY], 0, '+inf', 'WITHSCORES', 'LIMIT', 0,
    math.max(name, 1))
  local candidates = {}
  for i = 1, math.min(#ready / 2, name) do
    if tonumber(ready[2 * i]) > now then break end
    candidates[i] = ready[2 * i - 1]
  end
  -- Under a backlog (every key it names ready now), claimers that name
  -- the same first keys take most of them from each other before their
  -- next calls: each names keys from a place of its own among the first
  -- 3 x `name` ready now, where there are that many.
  local skip = #candidates == name and SPREAD % (2 * name) or 0
  if skip > 0 then
    local further = redis.call('ZRANGEBYSCORE', K[READY], 0, now, 'LIMIT', skip, name)
    if #further == name then candidates = further end
  end
  first_read = {ready[1], ready[2]}
  local next_at = tonumber(first_read[2]) or -1
  if due == false then due = head_due(K[SCHEDULE]) end
  if due and (next_at < 0 or due < next_at) then next_at = due end
  -- What it holds: a turn it just took is at work; a ready key or a
  -- delayed message is a message.
  local holds = 2
  if #claimed == 0 and redis.call('ZCARD', K[ACTIVE]) == 0 then
    if not first_read[2] and not due and redis.call('EXISTS', K[DATA]) == 0 then holds = 0 end
  else
    holds = 1
  end
  return {tag and tonumber(tag) or 0, next_at, candidates, claimed, blocked, holds, refused}
end

-- The claim numbers this call took, by claims key: blocks that name the
-- same one (every block, on one server) share the call's number, taken
-- once.
local numbers

-- The turns the block at hand took whose writes wait for `flush`: their
-- line members, active entries, ids, run notes and keys now at work, and
-- the turns in order ({key, heads, permits, rate}). A block's turns move
-- in one command per kind, not one per key: nothing the block reads of
-- another key depends on them (a key's own head read after its turn
-- flushes first).
local pending

-- Moves `heads` ({id, seq} each, the first of `key`'s line) to the active
-- set, under this claim: one turn; a run of several is noted (see
-- keyed_done.lua), so that whatever lets go of the key puts those still
-- at work back in line. A key with its lock (`permits` 0) is at work
-- (ready at AT_WORK). Written by `flush`.
local function take(key, heads, permits, rate)
  if not tag then
    numbers[K[CLAIMS]] = numbers[K[CLAIMS]] or next_claim(K[CLAIMS], now_us)
    tag = numbers[K[CLAIMS]]
  end
  pending = pending or {members = {}, active = {}, ids = {}, notes = {}, ready = {}, turns = {}}
  local p, note = pending, #heads > 1 and {tag, ':'}
  for _, head in ipairs(heads) do
    local member = line_member(key, head[2], head[1])
    local n = #p.members + 1
    p.members[n], p.ids[n] = member, head[1]
    p.active[2 * n - 1], p.active[2 * n] = deadline, member .. ':' .. tag
    if note then note[#note + 1] = #member .. ':' .. member end
  end
  if note then append(p.notes, run_field(key), table.concat(note)) end
  if permits == 0 then append(p.ready, AT_WORK, key) end
  p.turns[#p.turns + 1] = {key, heads, permits, rate}
  turns = turns + 1
end

-- Writes the turns taken since the last flush, and answers them in
-- `claimed`, in the order taken.
local function flush()
  if not pending then return end
  local p = pending
  pending = nil
  counted(LINES, -redis.call('ZREM', K[LINES], unpack(p.members)))
  counted(ACTIVE, redis.call('ZADD', K[ACTIVE], unpack(p.active)))
  if #p.ready > 0 then counted(READY, redis.call('ZADD', K[READY], unpack(p.ready))) end
  leased_until(deadline)
  if #p.notes > 0 then redis.call('HSET', K[LIMITS], unpack(p.notes)) end
  local records, n = redis.call('HMGET', K[DATA], unpack(p.ids)), 0
  local c = #claimed
  for _, turn in ipairs(p.turns) do
    local key, permits, rated = turn[1], turn[3], turn[4] and 1 or 0
    for _, head in ipairs(turn[2]) do
      n = n + 1
      claimed[c + 1], claimed[c + 2], claimed[c + 3] = key, head[1], head[2]
      claimed[c + 4], claimed[c + 5], claimed[c + 6] = permits, rated, records[n] or ''
      c = c + 6
    end
  end
end

-- A key with a lock: its `heads` (a run: without a rate limit; else its
-- head alone) with the lock, if free (without a rate limit to ask first,
-- taken at once where free).
local function claim_locked(key, heads, lock, token, log, rate)
  if not rate and redis.call('SET', lock, token, 'NX', 'PX', lease) then
    take(key, heads, 0, rate)
    return
  end
  local value = redis.call('GET', lock)
  if value then
    if string.byte(value, -1) ~= 33 then redis.call('APPEND', lock, '!') end
    local pttl = math.max(redis.call('PTTL', lock), 0)
    add_to(READY, now + pttl, key)
    blocked[#blocked + 1] = {key, lock, pttl}
    return
  end
  local wait = rate_wait(rate, log, token, now_us)
  if wait > 0 then
    add_to(READY, now + wait, key)
    return
  end
  redis.call('SET', lock, token, 'PX', lease)
  take(key, rate and {heads[1]} or heads, 0, rate)
end

-- A key with `limit` permits: its head with a permit, if one is free; the
-- key stays ready while it has a line and room.
local function claim_permit(key, id, seq, set, line, token, limit, log, rate)
  local took = take_permit(set, set, token, lease, limit, '0', now)
  if took[1] ~= 1 then
    add_to(READY, now + took[2], key)
    wait_for_permit(line, took[2] + lease)
    blocked[#blocked + 1] = {key, set, took[2]}
    return
  end
  local wait = rate_wait(rate, log, token, now_us)
  if wait > 0 then
    redis.call('ZREM', set, token)
    add_to(READY, now + wait, key)
    return
  end
  redis.call('ZREM', line, QUEUE_WAITS)
  take(key, {{id, seq}}, limit, rate)
  flush()
  if not head_of(key) then
    remove_from(READY, key)
  else
    -- Full now: the queue's own turns make the key ready as they end;
    -- a permit other code holds wakes it when given back.
    local wait = permit_wait(set, limit, now)
    if wait > 0 then
      add_to(READY, now + wait, key)
      wait_for_permit(line, wait + lease)
      blocked[#blocked + 1] = {key, set, wait}
    end
  end
end

-- A resend's answer for the block at hand, from the first call's record
-- of it (`was`: "<claim>:<count>"; `was_deadline`): the turns it took
-- that still hold.
local function answer_again(was, was_deadline)
  local was_tag, count = string.match(was, '^(%d+):(%d+)$')
  local taken = {}
  for _, member in ipairs(leases_of(K[ACTIVE], was_tag, was_deadline, tonumber(count))) do
    local key, seq, id = string.match(member, '^([^%z]*)%z(%d+)%z(.*)$')
    local limit, rate = limits_of(key)
    append(taken, key, id, seq, limit, rate and 1 or 0, redis.call('HGET', K[DATA], id) or '')
  end
  return answer(was_tag, taken, {}, false)
end

-- A candidate ready now, whose keys start at KEYS[at]: its head (or a run)
-- with its lock or a permit.
local function claim_key(key, token, at, limit, rate)
  local heads = heads_of(key, RUN)
  if not heads[1] then
    remove_from(READY, key)
  elseif limit > 0 then
    local id, seq = heads[1][1], heads[1][2]
    claim_permit(key, id, seq, KEYS[at + 1], KEYS[at + 2], token, limit, KEYS[at + 3], rate)
  else
    claim_locked(key, heads, KEYS[at], token, KEYS[at + 3], rate)
  end
end

-- A candidate whose claim a command refused (its lock made another kind
-- of key, say): what it wrote before stands, as a block's of
-- keyed_done.lua does; the other keys go on, and this one is looked at
-- again after a lease, named with the error in the answer. (On one server
-- every key is in one partition: one such key must not stop them all.)
local function refuse(key, error)
  redis.call('ZADD', K[READY], 'XX', now + lease, key)
  refused[#refused + 1] = {key, type(error) == 'table' and error.err or tostring(error)}
end

-- Claims in the block at hand, whose `c` candidates follow its keys.
local function claim_block(c)
  -- Keys it claims or finds blocked change their ready time either way.
  ready_changed()
  max = tonumber(ARGV[ab + 1])
  claimed, blocked, tag, turns, refused = {}, {}, nil, 0, {}
  -- As many due messages join their lines as the claim may take: the
  -- work is bounded by the claim's own batch; the rest, still due, keep
  -- the partition due (`head_due` in the answer) for the next claim.
  local due = head_due(K[SCHEDULE])
  if due and due <= now then
    promote(now, max)
    due = false
  end
  -- The candidates' ready times and limits, each kind in one read (a
  -- turn taken changes only its own key's, and a key named twice is
  -- looked at once).
  local keys, fields = {}, {}
  for i = 1, c do
    keys[i] = ARGV[ab + 2 + 2 * i]
    fields[2 * i - 1], fields[2 * i] = keys[i], keys[i] .. '\0rate'
  end
  local froms = c > 0 and redis.call('ZMSCORE', K[READY], unpack(keys)) or {}
  local limits = c > 0 and redis.call('HMGET', K[LIMITS], unpack(fields)) or {}
  local seen = {}
  for i = 1, c do
    if turns >= max then break end
    local key, token, at = keys[i], ARGV[ab + 3 + 2 * i], kb + MORE - 3 + 4 * i
    local from = tonumber(froms[i])
    if not seen[key] and from and from >= 0 and from <= now then
      seen[key] = true
      local limit, rate = tonumber(limits[2 * i - 1]) or 0, limits[2 * i] or nil
      local ok, error = pcall(claim_key, key, token, at, limit, rate)
      if not ok then refuse(key, error) end
    end
  end
  flush()
  return answer(tag, claimed, blocked, due), string.format('%s:%d', tag or 0, #claimed / 6)
end

-- The call: each block claimed in turn; a resend's answered from the
-- record, nothing claimed.
local function main()
  now, now_us = server_time()
  lease, RUN = tonumber(ARGV[1]), math.max(tonumber(ARGV[3]) or 1, 1)
  RECORD, SPREAD = KEYS[#KEYS], tonumber(ARGV[4]) or 0
  kb, ab, max = 0, 4, 0
  claimed, blocked, tag, deadline, turns, refused = {}, {}, nil, now + lease, 0, {}
  numbers, pending = {}, nil
  local kept = redis.call('GET', RECORD)
  local was_deadline, was_blocks = nil, {}
  if kept then
    local from
    was_deadline, from = string.match(kept, '^(%d+)()')
    for was in string.gmatch(string.sub(kept, from), ';([^;]*)') do was_blocks[#was_blocks + 1] = was end
  end
  local answers, record, took = {}, {deadline}, false
  while ab < #ARGV do
    local c = tonumber(ARGV[ab + 3])
    enter_partition(kb)
    if kept then
      answers[#answers + 1] = answer_again(was_blocks[#answers + 1] or '0:0', was_deadline)
    else
      local block_answer, took_here = claim_block(c)
      answers[#answers + 1] = block_answer
      record[#record + 1] = took_here
      took = took or block_answer[4][1] ~= nil
    end
    kb, ab = kb + MORE + 4 * c, ab + 3 + 2 * c
  end
  if took then redis.call('SET', RECORD, table.concat(record, ';'), 'PX', ARGV[2]) end
  return answers
end
