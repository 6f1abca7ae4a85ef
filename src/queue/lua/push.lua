-- Adds messages; an id that exists already is left as it is (de-duplication).
-- KEYS[1]: data   KEYS[2]: schedule   KEYS[3]: bell
-- ARGV: triplets of (id, when, payload) where `when` is a delay in ms
--       relative to the server's clock, or "@<unix ms>" for an absolute time.
-- Returns per message {added (1|0), due ms (-1 if it exists but is not scheduled)}.
local now = now_ms()
local head = head_due(KEYS[2])
local wake = false
local out = {}
for i = 1, #ARGV, 3 do
  local id, when = ARGV[i], ARGV[i + 1]
  if redis.call('HSETNX', KEYS[1], id, now .. ':0:0:' .. ARGV[i + 2]) == 1 then
    local due
    if string.byte(when, 1) == 64 then
      due = tonumber(string.sub(when, 2))
    else
      due = now + tonumber(when)
    end
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
