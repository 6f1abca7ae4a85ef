-- Shared by every queue script; prepended to each at load time, so each
-- script stays a single atomic unit.
--
-- Keys of queue <q> under prefix <p> (all in hash slot {q}):
--   <p>:{q}:data      hash   id -> record "<enqueued_ms>:<failures>:<deferrals>:<payload>"
--   <p>:{q}:schedule  zset   id -> due time (ms); due-now messages are simply due
--   <p>:{q}:active    zset   "<id>:<claim>" -> lease deadline (ms)
--   <p>:{q}:dead      zset   id -> time it was buried (ms)
--   <p>:{q}:errors    hash   id -> last error text
--   <p>:{q}:claims    string claim counter (one INCR per claimed batch)
--   <p>:{q}:bell      list   doorbell; at most one element

-- Server time in milliseconds: producers' and workers' clocks never matter.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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
local function parse(record)
  local enq, failures, deferrals, payload = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
  if not enq then return nil end
  return enq, tonumber(failures), tonumber(deferrals), payload
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
