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
