-- Shared by every queue script; prepended to each at load time, so each
-- script stays a single atomic unit. (scripts/push.lua, the file producers
-- in other languages load, is this prelude followed by push.lua.)
--
-- Keys of queue <q> under prefix <p> (all in hash slot {q}):
--   <p>:{q}:data      hash   id -> record
--                            "<enqueued_ms>:<failures>:<deferrals>:<stalls>:<payload>",
--                            prefixed "p<priority>:" for a message with one
--   <p>:{q}:schedule  zset   id -> due time (ms); due-now messages are simply due
--   <p>:{q}:prioritized zset id -> (10 - priority) * 1e13 + due time (ms), for
--                            messages with a priority 1 to 9 (see PRIORITY_BAND)
--   <p>:{q}:active    zset   "<id>:<claim>" -> lease deadline (ms)
--   <p>:{q}:dead      zset   id -> time it was buried (ms)
--   <p>:{q}:errors    hash   id -> last error text
--   <p>:{q}:claims    string last claim number (one per claimed batch): never
--                            reused, also after the server rolled back
--   <p>:{q}:bell      list   doorbell; at most one element

-- Server time in milliseconds and in microseconds, from one TIME call:
-- producers' and workers' clocks never matter. (Lua numbers are doubles,
-- exact below 2^53: microseconds since 1970 stay exact until the year 2255.)
local function server_time()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

local function now_ms()
  return (server_time())
end

-- Whether `s` is UTF-8: every reader of the queue takes ids (and keys)
-- for strings.
local function is_utf8(s)
  if not string.find(s, '[\128-\255]') then return true end
  local i = 1
  while i <= #s do
    local c, len = string.byte(s, i), 1
    if c >= 0xF0 then len = 4 elseif c >= 0xE0 then len = 3 elseif c >= 0xC2 then len = 2
    elseif c >= 0x80 then return false end
    -- The second byte's range rules out overlong forms, surrogates and
    -- code points beyond U+10FFFF.
    local low, high = 0x80, 0xBF
    if c == 0xE0 then low = 0xA0 elseif c == 0xED then high = 0x9F
    elseif c == 0xF0 then low = 0x90 elseif c == 0xF4 then high = 0x8F
    elseif c > 0xF4 then return false end
    for j = i + 1, i + len - 1 do
      local b = string.byte(s, j)
      if not b or b < low or b > high then return false end
      low, high = 0x80, 0xBF
    end
    i = i + len
  end
  return true
end
-- Parses a due time: a delay in whole ms from `now` ("0" is now; a
-- negative delay is due now too), or "@<unix ms>" for an absolute time (no
-- sign: a negative due time would read as the "not scheduled" marker -1).
-- Returns nil for anything else: tonumber alone would also take " 5",
-- "0x10", "1e3", "1.5", "inf" and "nan". At most 15 digits, so the due time
-- stays an exact Lua number. A due time before 1970 is 0 (never negative,
-- which reads as "not scheduled"); one from 1e13 ms on (the year 2286) is
-- refused: a priority's band of scores holds due times below it.
local function parse_when(now, when)
  local at, sign, digits = string.match(when, '^(@?)(%-?)(%d+)$')
  if not digits or #digits > 15 or (at == '@' and sign == '-') then return nil end
  local n = tonumber(digits)
  if at ~= '@' then
    if sign == '-' then n = -n end
    n = math.max(now + n, 0)
  end
  if n >= 1e13 then return nil end
  return n
end

-- Priorities: each has its band of scores on the prioritized set, the
-- highest priority the lowest band, ordered by due time (then id) within it.
-- A claim looks into the bands from 9 down to 1 before the schedule (a queue
-- without priorities pays one lookup of an empty key). Due times stay below
-- the band (1e13 ms is the year 2286), and every score is exact in a double.
local PRIORITY_BAND = 1e13
local MAX_PRIORITY = 9

-- The lowest score of a priority's band.
local function band(priority)
  return (10 - priority) * PRIORITY_BAND
end

-- The score of a message of `priority` due at `due`: the due time is kept
-- within the band (a due time before 1970 or after 2286 is held at the
-- band's edge, as soon or as late as a band allows).
local function band_score(priority, due)
  return band(priority) + math.min(math.max(due, 0), PRIORITY_BAND - 1)
end

-- The priority and due time a prioritized set's score stands for.
local function unband(score)
  local priority = 10 - math.floor(score / PRIORITY_BAND)
  return priority, score - band(priority)
end

-- Due time of the schedule's head, or nil when the schedule is empty.
local function head_due(schedule)
  return tonumber(redis.call('ZRANGE', schedule, 0, 0, 'WITHSCORES')[2])
end

-- Due time of the head of a priority's band of the prioritized set, or nil.
local function head_due_in_band(prioritized, priority)
  local low = band(priority)
  local head = redis.call('ZRANGEBYSCORE', prioritized, low, '(' .. (low + PRIORITY_BAND),
    'WITHSCORES', 'LIMIT', 0, 1)
  if head[2] then return tonumber(head[2]) - low end
  return nil
end

-- Wakes one idle waiter. The bell holds at most one element: a waiter that
-- was not blocked yet finds it there, and many rings wake no more than one
-- (a bell that is already ringing is left alone: one read, no write).
local function ring(bell)
  if redis.call('LLEN', bell) == 0 then
    redis.call('LPUSH', bell, '1')
  end
end

-- Appends the values to the array `t`, in order (a call per element: the
-- hot loops of push, claim and ack append inline instead).
local function append(t, ...)
  for i = 1, select('#', ...) do t[#t + 1] = (select(i, ...)) end
end

-- Splits a record into its header fields and payload; nil if malformed.
-- Records written before the stall counter existed have three counters
-- ("<enqueued>:<failures>:<deferrals>:<payload>") and read as 0 stalls. The
-- two forms cannot be confused: the four-counter pattern is tried first, and
-- it matches an old record only if its payload starts with "<digits>:",
-- which no JSON text does (a JSON number is never followed by ':').
-- The sixth value is the priority (0 for none): a record that starts with
-- "p<digit>:" has one (a record otherwise starts with a digit).
local function parse(record)
  local priority, rest = string.match(record, '^p(%d):(.*)$')
  priority, record = tonumber(priority) or 0, rest or record
  local enq, failures, deferrals, stalls, payload =
    string.match(record, '^(%d+):(%d+):(%d+):(%d+):(.*)$')
  if enq then
    return enq, tonumber(failures), tonumber(deferrals), tonumber(stalls), payload, priority
  end
  enq, failures, deferrals, payload = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
  if not enq then return nil end
  return enq, tonumber(failures), tonumber(deferrals), 0, payload, priority
end

-- Like parse, but keeps a malformed record whole as the payload (cannot
-- happen for records written by lockgate; the message is kept anyway).
local function parse_or_keep(record)
  local enq, failures, deferrals, stalls, payload, priority = parse(record)
  if not enq then return '0', 0, 0, 0, record, 0 end
  return enq, failures, deferrals, stalls, payload, priority
end

-- Builds a record: the three-counter form while the message has not
-- stalled (what lockgate 0.1 wrote and reads, so old and new workers can
-- share a queue during an upgrade, and 2 bytes less per message), the
-- four-counter form once it has.
-- A priority above 0 prefixes "p<priority>:".
local function make_record(enq, failures, deferrals, stalls, payload, priority)
  local head = ''
  if priority and priority > 0 then head = 'p' .. priority .. ':' end
  if stalls == 0 then
    return head .. enq .. ':' .. failures .. ':' .. deferrals .. ':' .. payload
  end
  return head .. enq .. ':' .. failures .. ':' .. deferrals .. ':' .. stalls .. ':' .. payload
end

-- Dead-letter retention: deletes, oldest first, dead letters buried more
-- than `max_age` ms before `now` and those beyond the newest `max_count`
-- (either "" for no limit), with their records and errors (and, given a
-- `keyof` hash, their entries there: a keyed partition's); at most `budget`
-- of them per call, so a call's work stays bounded (each burial adds one
-- letter and a call may remove many, so the set converges to its limits).
-- Returns how many it deleted.
local function trim_dead(dead, data, errors, now, max_count, max_age, budget, keyof)
  local forgotten = 0
  local function forget(ids)
    if #ids == 0 then return end
    redis.call('ZREM', dead, unpack(ids))
    redis.call('HDEL', data, unpack(ids))
    redis.call('HDEL', errors, unpack(ids))
    if keyof then redis.call('HDEL', keyof, unpack(ids)) end
    budget = budget - #ids
    forgotten = forgotten + #ids
  end
  local age = tonumber(max_age)
  if age and budget > 0 then
    forget(redis.call('ZRANGEBYSCORE', dead, '-inf', '(' .. (now - age), 'LIMIT', 0, budget))
  end
  local count = tonumber(max_count)
  if count and budget > 0 then
    local excess = math.min(redis.call('ZCARD', dead) - count, budget)
    if excess > 0 then forget(redis.call('ZRANGE', dead, 0, excess - 1)) end
  end
  return forgotten
end

-- The earliest due time on the prioritized set, or nil when it is empty
-- (at most one lookup per priority in use).
local function prioritized_head(prioritized)
  local earliest = nil
  local from = 0
  while true do
    local first = redis.call('ZRANGEBYSCORE', prioritized, from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    if not first[2] then return earliest end
    local priority, due = unband(tonumber(first[2]))
    if earliest == nil or due < earliest then earliest = due end
    from = band(priority - 1) -- the next band up (a lower priority)
    if priority <= 1 then return earliest end
  end
end

-- Puts an id (back) on the schedule at `due` (on the prioritized set, in
-- its band, for a priority above 0), ringing the bell when it is now the
-- earliest message of its set, so a waiter sleeping towards a later head
-- wakes (a ring more than needed costs a wake-up, never a message).
local function schedule_at(schedule, prioritized, bell, id, due, priority)
  if priority and priority > 0 then
    local head = head_due_in_band(prioritized, priority)
    redis.call('ZADD', prioritized, band_score(priority, due), id)
    if head == nil or due < head then ring(bell) end
    return
  end
  local head = head_due(schedule)
  redis.call('ZADD', schedule, due, id)
  if head == nil or due < head then ring(bell) end
end

-- Where an id waits, and its due time: the schedule, the prioritized set
-- (with its priority), or nil when it is not waiting (claimed, dead, gone).
local function waiting(schedule, prioritized, id)
  local due = redis.call('ZSCORE', schedule, id)
  if due then return schedule, tonumber(due), 0 end
  local score = redis.call('ZSCORE', prioritized, id)
  if score then
    local priority, at = unband(tonumber(score))
    return prioritized, at, priority
  end
  return nil
end

-- The next claim number, as text, kept in `claims`: the larger of the last
-- one + 1 and the server's time in µs. A plain INCR would hand out old
-- numbers again after the server lost recent writes (a restart from an
-- older snapshot, a lagging replica promoted) while claims made since are
-- still held; the clock moved on meanwhile (unless it was stepped back by
-- more than the lost interval). '%d': not "1.7e+15".
local function next_claim(claims, now_us)
  local claim = math.max((tonumber(redis.call('GET', claims)) or 0) + 1, now_us)
  local tag = string.format('%d', claim)
  redis.call('SET', claims, tag)
  return tag
end

-- What the claim `tag` leased until `deadline` (every lease of a claim call
-- has the same deadline): its `count` members of the active set `active`,
-- without the ":<claim>" suffix, looked up by that score a page at a time
-- (other claims of the same ms share it). For a claim call resent after
-- its reply was lost, from the record the first run left (claim.lua).
local function leases_of(active, tag, deadline, count)
  local found, suffix, from = {}, ':' .. tag, 0
  while #found < count do
    local page = redis.call('ZRANGEBYSCORE', active, deadline, deadline, 'LIMIT', from, 1000)
    for _, member in ipairs(page) do
      if string.sub(member, -#suffix) == suffix then
        found[#found + 1] = string.sub(member, 1, -#suffix - 1)
      end
    end
    if #page < 1000 then break end
    from = from + 1000
  end
  return found
end

-- Splits an active-set member "<id>:<claim>" into its id.
local function member_id(member)
  return string.match(member, '^(.*):%d+$')
end

-- Lifecycle events (Queue::record_events): when the caller passes the
-- queue's events stream and a cap ("" when events are off), each change of
-- a message is appended to the stream, one entry per script call and kind:
--   e <kind> t <server ms> [x <error>] then pairs of <id> <attempt>
-- (`x` for the kinds that carry an error: retried and dead). The stream is
-- capped near `cap` entries (MAXLEN ~). With events off nothing is written.
local function emit(stream, cap, kind, now, error, pairs)
  if cap == nil or cap == '' or #pairs == 0 then return end
  if error then
    redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'e', kind, 't', now, 'x', error,
      unpack(pairs))
  else
    redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'e', kind, 't', now, unpack(pairs))
  end
end

-- The attempt a record's next delivery is: its failures plus one (read
-- without copying the payload).
local function attempt_of(record)
  if not record then return 1 end
  local failures = string.match(record, '^%d+:(%d+):') or string.match(record, '^p%d:%d+:(%d+):')
  return (tonumber(failures) or 0) + 1
end

-- Keeps a completed message on the completed stream (Queue::keep_completed):
-- an entry `id <id> attempt <attempt> payload <payload>` at the server's
-- time, the stream trimmed exactly to at most `max_count` entries and to
-- those of the last `max_age` ms (either "" for no limit).
local function keep_completed(stream, max_count, max_age, now, id, record)
  local _, failures, _, _, payload = parse_or_keep(record)
  if max_count ~= '' then
    redis.call('XADD', stream, 'MAXLEN', max_count, '*', 'id', id, 'attempt', failures + 1,
      'payload', payload)
  else
    redis.call('XADD', stream, '*', 'id', id, 'attempt', failures + 1, 'payload', payload)
  end
  if max_age ~= '' then
    redis.call('XTRIM', stream, 'MINID', string.format('%d', math.max(0, now - tonumber(max_age))))
  end
end

-- Adds messages; an id that exists already is left as it is (de-duplication):
-- its record, its place (scheduled, being processed, dead) and its due time
-- do not change, so pushing again, retrying a push whose reply was lost, or
-- pushing an id a worker holds never makes a message claimable twice.
-- KEYS: data, schedule, bell, prioritized, events: "<p>:{<q>}:data" and so on
--   for queue <q> under prefix <p> (lockgate's default: "lockgate");
--   prioritized may be left out by a producer that pushes no priorities;
--   events is optional (Queue::record_events): then ARGV[1] is its cap
-- ARGV: triplets (id, when, payload): id non-empty UTF-8; `when` a delay in ms
--   from the server's clock ("0": now) or "@<unix ms>" (a past time is due
--   now, before 1970 is 0, 2286 and later are refused), optionally followed
--   by "/<priority>" (1 to 9, higher first; "0" or none: no priority);
--   payload the message as JSON (one starting with digits and a colon is
--   refused: it would be misread).
-- Returns per message {added (1|0), due ms (-1 if it exists but is not
-- scheduled, or, when KEYS[4] was left out, waits with a priority)}.
-- Bad arguments are refused before anything is written, with an error reply
-- starting "lockgate push:".

local first, cap = 1, nil
if KEYS[5] then first, cap = 2, ARGV[1] end
if (#ARGV - first + 1) % 3 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be triplets (id, when, payload), got '
    .. (#ARGV - first + 1) .. ' arguments')
end
-- Refuses message `n`'s arguments (naming its id when given).
local function refuse(n, id, why)
  local named = id and (' (id "' .. id .. '")') or ''
  return redis.error_reply('ERR lockgate push: message ' .. n .. named .. ' has ' .. why)
end
local now = now_ms()
local dues, priorities = {}, {}
for i = first, #ARGV, 3 do
  local n = (i - first) / 3 + 1
  if ARGV[i] == '' then return refuse(n, nil, 'an empty id') end
  if not is_utf8(ARGV[i]) then return refuse(n, nil, 'an id that is not UTF-8') end
  -- JSON never starts so; a record's reader would take the digits for a
  -- stall count.
  if string.find(ARGV[i + 2], '^%d+:') then
    return refuse(n, ARGV[i], 'a payload starting with digits and a colon: not JSON')
  end
  local when, priority = string.match(ARGV[i + 1], '^(.-)/(%d)$')
  if not when then when, priority = ARGV[i + 1], '0' end
  priority = tonumber(priority)
  if priority > 0 and not KEYS[4] then
    return refuse(n, ARGV[i], 'a priority, but the prioritized key (KEYS[4]) was not passed')
  end
  local due = parse_when(now, when)
  if not due then
    return refuse(n, ARGV[i], 'a bad `when` "' .. ARGV[i + 1]
      .. '": expected a delay in ms or "@<unix ms>", optionally followed by "/<priority 0-9>"')
  end
  dues[n] = due
  priorities[n] = priority
end
-- The heads of the schedule and of the bands pushed to, read once.
local heads = {}
local function head_of(priority)
  if heads[priority] == nil then
    if priority > 0 then
      heads[priority] = head_due_in_band(KEYS[4], priority) or false
    else
      heads[priority] = head_due(KEYS[2]) or false
    end
  end
  return heads[priority]
end
local wake = false
local out = {}
local pushed = {}
for i = first, #ARGV, 3 do
  local n = (i - first) / 3 + 1
  local id, due, priority = ARGV[i], dues[n], priorities[n]
  local header = now .. ':0:0:'
  if priority > 0 then header = 'p' .. priority .. ':' .. header end
  if redis.call('HSETNX', KEYS[1], id, header .. ARGV[i + 2]) == 1 then
    local head = head_of(priority)
    if priority > 0 then
      redis.call('ZADD', KEYS[4], band_score(priority, due), id)
    else
      redis.call('ZADD', KEYS[2], due, id)
    end
    if not head or due < head then
      heads[priority] = due
      wake = true
    end
    pushed[#pushed + 1] = id
    pushed[#pushed + 1] = 1
    out[#out + 1] = 1
    out[#out + 1] = due
  else
    out[#out + 1] = 0
    local _, at = waiting(KEYS[2], KEYS[4] or KEYS[2], id)
    out[#out + 1] = at or -1
  end
end
if wake then ring(KEYS[3]) end
emit(KEYS[5], cap, 'pushed', now, nil, pushed)
return out
