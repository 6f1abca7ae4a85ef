-- Counts, read at one instant of the server's clock.
-- KEYS: schedule, active, dead, prioritized, and for Queue::activity events
--   and activity, with ARGV: the window in ms, the bucket width in ms, the
--   number of buckets (at most 1,000)
-- Returns {due, later, active, dead, due time of the oldest due message or -1,
-- now, due time of the next message not due yet or -1}, over the schedule and
-- every priority.
local now = now_ms()
local due = redis.call('ZCOUNT', KEYS[1], '-inf', now)
local later = redis.call('ZCARD', KEYS[1]) - due
local oldest = -1
if due > 0 then oldest = head_due(KEYS[1]) end
local next_due = -1
if later > 0 then
  local first = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  if first[2] then next_due = tonumber(first[2]) end
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  for priority = MAX_PRIORITY, 1, -1 do
    local low = band(priority)
    local high = low + PRIORITY_BAND
    local all = redis.call('ZCOUNT', KEYS[4], low, '(' .. high)
    if all > 0 then
      local ready = redis.call('ZCOUNT', KEYS[4], low, low + now)
      due = due + ready
      later = later + all - ready
      if ready > 0 then
        local head = head_due_in_band(KEYS[4], priority)
        if oldest == -1 or head < oldest then oldest = head end
      end
      if all > ready then
        local first = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. (low + now), '(' .. high,
          'WITHSCORES', 'LIMIT', 0, 1)
        local at = tonumber(first[2]) - low
        if next_due == -1 or at < next_due then next_due = at end
      end
    end
  end
end
local out = {due, later, redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]), oldest, now, next_due}
if KEYS[5] then
  -- Then: 1 if the queue records events, and per bucket of the window
  -- (oldest first) the messages done, then those that failed (retried or
  -- dead), from the activity counts (KEYS[6], see activity.lua, prepended).
  local width, count = tonumber(ARGV[2]), tonumber(ARGV[3])
  out[#out + 1] = redis.call('EXISTS', KEYS[5])
  local done, failed = activity_buckets(KEYS[6], now - tonumber(ARGV[1]), now, width, count)
  for i = 1, count do out[#out + 1] = done[i] end
  for i = 1, count do out[#out + 1] = failed[i] end
end
return out
