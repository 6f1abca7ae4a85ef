-- Counts, read at one instant of the server's clock.
-- KEYS[1]: schedule   KEYS[2]: active   KEYS[3]: dead   KEYS[4]: prioritized
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
return {due, later, redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]), oldest, now, next_due}
