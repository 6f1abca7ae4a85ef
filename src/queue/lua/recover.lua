-- Returns messages whose lease ran out (their worker died or stalled) to the
-- schedule, due now, counting a failed attempt; buries those that used up
-- their attempts. Safe to run from any number of processes at once.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: active   KEYS[4]: dead
-- KEYS[5]: errors   KEYS[6]: bell
-- ARGV[1]: max attempts   ARGV[2]: how many at most in this call
-- Returns {requeued, buried, examined}: a caller loops while examined is the
-- batch size (entries without a record are dropped and not counted otherwise).
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local max_attempts = tonumber(ARGV[1])
local requeued, buried = 0, 0
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[3], member)
  local id = member_id(member)
  local record = id and redis.call('HGET', KEYS[1], id)
  if record then
    local enq, failures, deferrals, payload = parse(record)
    if not enq then
      enq, failures, deferrals, payload = '0', 0, 0, record
    end
    failures = failures + 1
    redis.call('HSET', KEYS[1], id, enq .. ':' .. failures .. ':' .. deferrals .. ':' .. payload)
    redis.call('HSET', KEYS[5], id, 'lease expired: the worker died or stalled')
    if failures >= max_attempts then
      redis.call('ZADD', KEYS[4], now, id)
      buried = buried + 1
    else
      schedule_at(KEYS[2], KEYS[6], id, now)
      requeued = requeued + 1
    end
  end
end
return {requeued, buried, #expired}
