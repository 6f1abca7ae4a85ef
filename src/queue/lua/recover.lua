-- Returns messages whose lease ran out (their worker died or stalled) to the
-- schedule, due now, counting a stall (not a failed attempt: the handler may
-- never have started, e.g. a dead worker's prefetched messages); buries
-- those whose lease ran out ARGV[1] times (a message that kills its worker
-- every time), then applies the dead-letter retention. Safe to run from any
-- number of processes at once.
-- KEYS: data, schedule, active, dead, errors, bell, prioritized, events, activity
-- ARGV: max stalls, how many at most in this call, the dead letters' most
--   count and most age in ms, the events' cap (each "" for none)
-- Returns {requeued, buried, examined}: a caller loops while examined is the
-- batch size (entries without a record are dropped and not counted otherwise).
local now = now_ms()
local expired = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local max_stalls = tonumber(ARGV[1])
local requeued, buried = 0, 0
local back, dead = {}, {}
for _, member in ipairs(expired) do
  redis.call('ZREM', KEYS[3], member)
  local id = member_id(member)
  local record = id and redis.call('HGET', KEYS[1], id)
  if record then
    local enq, failures, deferrals, stalls, payload, priority = parse_or_keep(record)
    stalls = stalls + 1
    redis.call('HSET', KEYS[1], id, make_record(enq, failures, deferrals, stalls, payload, priority))
    if stalls >= max_stalls then
      redis.call('HSET', KEYS[5], id, 'lease expired ' .. stalls .. ' times (limit '
        .. max_stalls .. '): its worker died or stalled every time it held the message')
      redis.call('ZADD', KEYS[4], now, id)
      buried = buried + 1
      append(dead, id, failures + 1)
    else
      redis.call('HSET', KEYS[5], id, 'lease expired: the worker died or stalled')
      schedule_at(KEYS[2], KEYS[7], KEYS[6], id, now, priority)
      requeued = requeued + 1
      append(back, id, failures + 1)
    end
  end
end
-- Retention runs on every call, not only when something was buried: the
-- workers call recover periodically, so old letters of a queue that stopped
-- failing still go (an idle trim is one range query and one ZCARD).
emit(KEYS[8], ARGV[5], 'recovered', now, nil, back)
emit_counted(KEYS[8], KEYS[9], ARGV[5], 'dead', now, 'lease expired too many times', dead)
trim_dead(KEYS[4], KEYS[1], KEYS[5], now, ARGV[3], ARGV[4], 100 + buried)
return {requeued, buried, #expired}
