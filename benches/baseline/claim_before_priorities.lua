-- The claim script as it was before priorities (commit 203d9fd), kept as
-- the comparator of benches/queue.rs's priority section; loaded after the
-- current prelude, whose server_time, head_due and ring it uses.
-- Claims up to ARGV[1] due messages, in due order, under a lease.
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: active   KEYS[4]: claims   KEYS[5]: bell
-- ARGV[1]: how many at most (bounded by the caller)   ARGV[2]: lease in ms
-- Returns {claim, next due ms or -1, now, then per message id, due ms, record}.
-- A scheduled id whose record is missing (removed by hand) is dropped.
-- When due messages remain after the claim, the bell rings again: a ring
-- wakes one idle worker, and this passes the wake-up on to the next, so a
-- backlog reaches every idle worker, not just the first.
local now, now_us = server_time()
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[1]))
if #due == 0 then
  return {0, head_due(KEYS[2]) or -1, now}
end
local ids = {}
for i = 1, #due, 2 do ids[#ids + 1] = due[i] end
redis.call('ZREM', KEYS[2], unpack(ids))
local records = redis.call('HMGET', KEYS[1], unpack(ids))
-- The claim number is the larger of the last one + 1 and the server's time
-- in microseconds. A plain INCR would hand out old numbers again after the
-- server lost recent writes (a restart from an older snapshot, a promoted
-- replica that lagged): the counter comes back older while the claims made
-- since are still held, and a stale holder's "<id>:<claim>" would equal the
-- new holder's. The clock moved on meanwhile, so the new number is larger
-- than any handed out before the rollback (unless the server's clock was
-- stepped back by more than the lost interval).
local claim = math.max((tonumber(redis.call('GET', KEYS[4])) or 0) + 1, now_us)
-- '%d': concatenating a 16-digit number would write it as "1.7e+15".
local tag = string.format('%d', claim)
redis.call('SET', KEYS[4], tag)
local deadline = now + tonumber(ARGV[2])
local leases = {}
local next_due = head_due(KEYS[2])
if next_due and next_due <= now then ring(KEYS[5]) end
local out = {claim, next_due or -1, now}
for i, id in ipairs(ids) do
  if records[i] then
    leases[#leases + 1] = deadline
    leases[#leases + 1] = id .. ':' .. tag
    out[#out + 1] = id
    out[#out + 1] = due[2 * i]
    out[#out + 1] = records[i]
  end
end
if #leases > 0 then redis.call('ZADD', KEYS[3], unpack(leases)) end
return out
