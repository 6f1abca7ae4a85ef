-- Renews the leases of claimed messages still held by the caller.
-- KEYS: active; ARGV: lease ms, then active members "<id>:<claim>"
-- Returns per member 1 (renewed) or 0 (no longer held: lease expired and recovered).
local deadline = now_ms() + tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', deadline, ARGV[i])
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
