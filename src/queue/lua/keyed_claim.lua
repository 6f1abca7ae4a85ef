-- Claims the heads of ready keys' lines with the keys' locks or permits
-- (see keyed.lua), after moving the messages that became due into their
-- lines: in one partition, or in several at once on one server (a block
-- each, claimed in turn).
-- KEYS, per block: the partition's 13 keys; per candidate key, its lock,
-- its permits' set, the set's line of waiters and its rate limit log; the
-- block's record
-- ARGV[1]: lease in ms (the lock's or permit's too)
-- ARGV[2]: how long to keep a record (ms)
-- ARGV[3..], per block: how many at most; how many candidates to name for
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
-- lock), 1 if the key has a rate limit else 0, record, ...}, {key that
-- other code keeps full, the lock or set to watch, ms until its first
-- lease ends, ...}, what the partition holds: 0 no message at all, 1 a
-- message at work, 2 messages, none at work}.
-- A block's record ("<claim>:<lease deadline>:<count>"), named by the
-- caller for this call alone, makes the call safe to resend (see
-- claim.lua): a resend answers the turns the first call took that still
-- hold, and takes nothing more.
local now, now_us = server_time()
local lease = tonumber(ARGV[1])
-- The block at hand: where its keys and arguments start (KEYS[kb + 1],
-- ARGV[ab + 1]), its most turns, its record; what it claimed, found
-- blocked, its claim number, its leases' deadline.
local kb, ab, max, RECORD = 0, 2, 0, nil
local claimed, blocked, tag, deadline = {}, {}, nil, now + lease

-- The answer after the turns `claimed` (and the keys `blocked`): the keys
-- to name next, when one is due next, what the partition holds.
-- Under a backlog it reads two things: the ready keys (the first of them
-- is the earliest) and the schedule's head; the rest only when those leave
-- it open.
local function answer(tag, claimed, blocked)
  local name = tonumber(ARGV[ab + 2])
  local ready = redis.call('ZRANGEBYSCORE', K[READY], 0, now, 'WITHSCORES', 'LIMIT', 0,
    math.max(name, 1))
  local candidates = {}
  for i = 1, math.min(#ready / 2, name) do candidates[i] = ready[2 * i - 1] end
  first_read = {ready[1], ready[2]}
  if not ready[2] then
    first_read = redis.call('ZRANGEBYSCORE', K[READY], '(' .. now, '+inf', 'WITHSCORES',
      'LIMIT', 0, 1)
  end
  local next_at = tonumber(first_read[2]) or -1
  local due = head_due(K[SCHEDULE])
  if due and (next_at < 0 or due < next_at) then next_at = due end
  -- What it holds: a turn it just took is at work; a ready key or a
  -- delayed message is a message.
  local holds = 2
  if #claimed == 0 and redis.call('ZCARD', K[ACTIVE]) == 0 then
    if not first_read[2] and not due and redis.call('EXISTS', K[DATA]) == 0 then holds = 0 end
  else
    holds = 1
  end
  return {tag and tonumber(tag) or 0, next_at, candidates, claimed, blocked, holds}
end

-- The claim numbers this call took, by claims key: blocks that name the
-- same one (every block, on one server) share the call's number, taken
-- once.
local numbers = {}

-- Moves the head `id` of `key`'s line to the active set, under this claim.
local function take(key, id, seq, permits, rate)
  if not tag then
    numbers[K[CLAIMS]] = numbers[K[CLAIMS]] or next_claim(K[CLAIMS], now_us)
    tag = numbers[K[CLAIMS]]
  end
  local member = line_member(key, seq, id)
  remove_from(LINES, member)
  add_to(ACTIVE, deadline, member .. ':' .. tag)
  claimed[#claimed + 1] = key
  claimed[#claimed + 1] = id
  claimed[#claimed + 1] = seq
  claimed[#claimed + 1] = permits
  claimed[#claimed + 1] = rate and 1 or 0
  claimed[#claimed + 1] = redis.call('HGET', K[DATA], id) or ''
end

-- A key with a lock: its head with the lock, if free.
local function claim_locked(key, id, seq, lock, token, log, rate)
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
  add_to(READY, AT_WORK, key)
  take(key, id, seq, 0, rate)
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
  take(key, id, seq, limit, rate)
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

-- Claims in the block at hand, whose `c` candidates follow its keys.
local function claim_block(c)
  -- Keys it claims or finds blocked change their ready time either way.
  ready_changed()
  max, RECORD = tonumber(ARGV[ab + 1]), KEYS[kb + MORE + 4 * c + 1]
  claimed, blocked, tag = {}, {}, nil
  local kept = redis.call('GET', RECORD)
  if kept then
    local was, was_deadline, count = string.match(kept, '^(%d+):(%d+):(%d+)$')
    local taken = {}
    for _, member in ipairs(leases_of(K[ACTIVE], was, was_deadline, tonumber(count))) do
      local key, seq, id = string.match(member, '^([^%z]*)%z(%d+)%z(.*)$')
      local limit, rate = limits_of(key)
      append(taken, key, id, seq, limit, rate and 1 or 0, redis.call('HGET', K[DATA], id) or '')
    end
    return answer(was, taken, {})
  end
  -- As many due messages join their lines as the claim may take: the
  -- work is bounded by the claim's own batch; the rest, still due, keep
  -- the partition due (`head_due` below) for the next claim.
  promote(now, max)
  for i = 1, c do
    if #claimed >= 6 * max then break end
    local key, token, at = ARGV[ab + 2 + 2 * i], ARGV[ab + 3 + 2 * i], kb + MORE - 3 + 4 * i
    local from = tonumber(redis.call('ZSCORE', K[READY], key))
    if from and from >= 0 and from <= now then
      local id, seq = head_of(key)
      local limit, rate = 0, nil
      if id then limit, rate = limits_of(key) end
      if not id then
        remove_from(READY, key)
      elseif limit > 0 then
        claim_permit(key, id, seq, KEYS[at + 1], KEYS[at + 2], token, limit, KEYS[at + 3], rate)
      else
        claim_locked(key, id, seq, KEYS[at], token, KEYS[at + 3], rate)
      end
    end
  end
  if #claimed > 0 then
    redis.call('SET', RECORD, string.format('%s:%d:%d', tag, deadline, #claimed / 6), 'PX', ARGV[2])
  end
  return answer(tag, claimed, blocked)
end

local answers = {}
while ab < #ARGV do
  local c = tonumber(ARGV[ab + 3])
  enter_partition(kb)
  answers[#answers + 1] = claim_block(c)
  kb, ab = kb + MORE + 4 * c + 1, ab + 3 + 2 * c
end
return answers
