-- Shared by every queue script; prepended to each at load time, so each
-- script stays a single atomic unit. (scripts/push.lua, the file producers
-- in other languages load, is this prelude followed by push.lua.)
--
-- Keys of queue <q> under prefix <p> (all in hash slot {q}):
--   <p>:{q}:data      hash   id -> record
--                            "<enqueued_ms>:<failures>:<deferrals>:<stalls>:<payload>"
--   <p>:{q}:schedule  zset   id -> due time (ms); due-now messages are simply due
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

-- Server time in milliseconds.
local function now_ms()
  return (server_time())
end

-- Parses a due time: a delay in whole ms from `now` ("0" is now; a
-- negative delay is due now too), or "@<unix ms>" for an absolute time (no
-- sign: a negative due time would read as the "not scheduled" marker -1).
-- Returns nil for anything else: tonumber alone would also take " 5",
-- "0x10", "1e3", "1.5", "inf" and "nan". At most 15 digits, so the due time
-- stays an exact Lua number far beyond any real date.
local function parse_when(now, when)
  local at, sign, digits = string.match(when, '^(@?)(%-?)(%d+)$')
  if not digits or #digits > 15 or (at == '@' and sign == '-') then return nil end
  local n = tonumber(digits)
  if at == '@' then return n end
  if sign == '-' then n = -n end
  return now + n
end

-- Due time of the schedule's head, or nil when the schedule is empty.
local function head_due(schedule)
  local head = redis.call('ZRANGE', schedule, 0, 0, 'WITHSCORES')
  if head[2] then return tonumber(head[2]) end
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

-- Splits a record into its header fields and payload; nil if malformed.
-- Records written before the stall counter existed have three counters
-- ("<enqueued>:<failures>:<deferrals>:<payload>") and read as 0 stalls. The
-- two forms cannot be confused: the four-counter pattern is tried first, and
-- it matches an old record only if its payload starts with "<digits>:",
-- which no JSON text does (a JSON number is never followed by ':').
local function parse(record)
  local enq, failures, deferrals, stalls, payload =
    string.match(record, '^(%d+):(%d+):(%d+):(%d+):(.*)$')
  if enq then
    return enq, tonumber(failures), tonumber(deferrals), tonumber(stalls), payload
  end
  enq, failures, deferrals, payload = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
  if not enq then return nil end
  return enq, tonumber(failures), tonumber(deferrals), 0, payload
end

-- Like parse, but keeps a malformed record whole as the payload (cannot
-- happen for records written by lockgate; the message is kept anyway).
local function parse_or_keep(record)
  local enq, failures, deferrals, stalls, payload = parse(record)
  if not enq then return '0', 0, 0, 0, record end
  return enq, failures, deferrals, stalls, payload
end

-- Builds a record: the three-counter form while the message has not
-- stalled (what lockgate 0.1 wrote and reads, so old and new workers can
-- share a queue during an upgrade, and 2 bytes less per message), the
-- four-counter form once it has.
local function make_record(enq, failures, deferrals, stalls, payload)
  if stalls == 0 then
    return enq .. ':' .. failures .. ':' .. deferrals .. ':' .. payload
  end
  return enq .. ':' .. failures .. ':' .. deferrals .. ':' .. stalls .. ':' .. payload
end

-- Dead-letter retention: deletes, oldest first, dead letters buried more
-- than `max_age` ms before `now` and those beyond the newest `max_count`
-- (either "" for no limit), with their records and errors; at most `budget`
-- of them per call, so a call's work stays bounded (each burial adds one
-- letter and a call may remove many, so the set converges to its limits).
local function trim_dead(dead, data, errors, now, max_count, max_age, budget)
  local function forget(ids)
    if #ids == 0 then return end
    redis.call('ZREM', dead, unpack(ids))
    redis.call('HDEL', data, unpack(ids))
    redis.call('HDEL', errors, unpack(ids))
    budget = budget - #ids
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
end

-- Puts an id (back) on the schedule at `due`, ringing the bell when it is now
-- the earliest message, so a waiter sleeping towards a later head wakes.
local function schedule_at(schedule, bell, id, due)
  local head = head_due(schedule)
  redis.call('ZADD', schedule, due, id)
  if head == nil or due < head then ring(bell) end
end

-- Splits an active-set member "<id>:<claim>" into its id.
local function member_id(member)
  return string.match(member, '^(.*):%d+$')
end

-- Adds messages; an id that exists already is left as it is (de-duplication):
-- its record, its place (scheduled, being processed, dead) and its due time
-- do not change, so pushing again, retrying a push whose reply was lost, or
-- pushing an id a worker holds never makes a message claimable twice.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: bell
--          (queue <q> under prefix <p>: "<p>:{<q>}:data", "<p>:{<q>}:schedule",
--          "<p>:{<q>}:bell"; lockgate's default prefix is "lockgate")
-- ARGV: triplets of (id, when, payload): id non-empty; `when` a delay in ms
--       relative to the server's clock ("0" for now), or "@<unix ms>" for an
--       absolute time (a past time is due now); payload the message as JSON.
-- Returns per message {added (1|0), due ms (-1 if it exists but is not scheduled)}.
-- Bad arguments are refused before anything is written, with an error reply
-- starting "lockgate push:".
if #ARGV % 3 ~= 0 then
  return redis.error_reply('ERR lockgate push: arguments must be triplets (id, when, payload), got '
    .. #ARGV .. ' arguments')
end
local now = now_ms()
local dues = {}
for i = 1, #ARGV, 3 do
  local n = (i + 2) / 3
  if ARGV[i] == '' then
    return redis.error_reply('ERR lockgate push: message ' .. n .. ' has an empty id')
  end
  local due = parse_when(now, ARGV[i + 1])
  if not due then
    return redis.error_reply('ERR lockgate push: message ' .. n .. ' (id "' .. ARGV[i]
      .. '") has a bad `when` "' .. ARGV[i + 1]
      .. '": expected a delay in ms or "@<unix ms>"')
  end
  dues[n] = due
end
local head = head_due(KEYS[2])
local wake = false
local out = {}
for i = 1, #ARGV, 3 do
  local id, due = ARGV[i], dues[(i + 2) / 3]
  if redis.call('HSETNX', KEYS[1], id, now .. ':0:0:' .. ARGV[i + 2]) == 1 then
    redis.call('ZADD', KEYS[2], due, id)
    if head == nil or due < head then
      head = due
      wake = true
    end
    out[#out + 1] = 1
    out[#out + 1] = due
  else
    out[#out + 1] = 0
    out[#out + 1] = tonumber(redis.call('ZSCORE', KEYS[2], id) or '-1')
  end
end
if wake then ring(KEYS[3]) end
return out
