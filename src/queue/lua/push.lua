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
