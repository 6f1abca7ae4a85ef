-- Looks at a queue's next waiting messages and its active ones, changing
-- nothing (for dashboards and listings).
-- KEYS: data, schedule, prioritized, active; ARGV[1]: how many of each at most
-- Returns {waiting, active}: waiting as {id, due ms, priority, record or
-- false}, the schedule's first then the prioritized set's first (highest
-- priority first), each in its own order (the caller merges them); active as
-- {id, lease deadline ms, record or false}, soonest lease end first.
local limit = tonumber(ARGV[1]) - 1
local function record(id) return redis.call('HGET', KEYS[1], id) end
local waiting, active = {}, {}
local plain = redis.call('ZRANGE', KEYS[2], 0, limit, 'WITHSCORES')
for i = 1, #plain, 2 do
  waiting[#waiting + 1] = {plain[i], plain[i + 1], 0, record(plain[i])}
end
local prioritized = redis.call('ZRANGE', KEYS[3], 0, limit, 'WITHSCORES')
for i = 1, #prioritized, 2 do
  local priority, due = unband(tonumber(prioritized[i + 1]))
  waiting[#waiting + 1] = {prioritized[i], string.format('%d', due), priority, record(prioritized[i])}
end
local leased = redis.call('ZRANGE', KEYS[4], 0, limit, 'WITHSCORES')
for i = 1, #leased, 2 do
  local id = member_id(leased[i]) or leased[i]
  active[#active + 1] = {id, leased[i + 1], record(id)}
end
return {waiting, active}
