-- Looks at a queue's next waiting messages and its active ones, changing
-- nothing (for dashboards and listings).
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: prioritized   KEYS[4]: active
-- ARGV[1]: how many of each at most
-- Returns {waiting count n, then n times {id, due ms, priority, record or
-- false}, then per active message {id, lease deadline ms, record or false}}.
-- Waiting: the schedule's first, then the prioritized set's first (highest
-- priority first), each in its own order; the caller merges them.
local limit = tonumber(ARGV[1]) - 1
local waiting = {}
local plain = redis.call('ZRANGE', KEYS[2], 0, limit, 'WITHSCORES')
for i = 1, #plain, 2 do
  waiting[#waiting + 1] = {plain[i], plain[i + 1], 0}
end
local prioritized = redis.call('ZRANGE', KEYS[3], 0, limit, 'WITHSCORES')
for i = 1, #prioritized, 2 do
  local priority, due = unband(tonumber(prioritized[i + 1]))
  waiting[#waiting + 1] = {prioritized[i], string.format('%d', due), priority}
end
local out = {#waiting}
for _, w in ipairs(waiting) do
  append(out, w[1], w[2], w[3], redis.call('HGET', KEYS[1], w[1]))
end
local active = redis.call('ZRANGE', KEYS[4], 0, limit, 'WITHSCORES')
for i = 1, #active, 2 do
  local id = member_id(active[i]) or active[i]
  append(out, id, active[i + 1], redis.call('HGET', KEYS[1], id))
end
return out
