-- The floor's claim with every key it touches declared, as the keyed
-- queue's scripts must (a key's lock and line are named by the caller,
-- never built here): it claims among the ready keys its caller's last
-- claim named, and names the next call's. Otherwise as claim.lua.
-- KEYS: ready, data, counts, then per candidate its lock and its line
-- ARGV: lease ms, most keys, token prefix (each key's token is prefix .. n),
-- how many keys to name for the next call, a number drawn at random, then
-- the candidates' keys
-- Returns {the keys named for the next call, {key, id, token, payload per
-- message claimed}}.
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local claimed, looks, candidates = {}, {}, {}
local deadline = now + tonumber(ARGV[1])
for i = 6, #ARGV do candidates[#candidates + 1] = ARGV[i] end
local froms = #candidates > 0 and redis.call('ZMSCORE', KEYS[1], unpack(candidates)) or {}
local most, taken = tonumber(ARGV[2]), 0
for i, key in ipairs(candidates) do
  if taken >= most then break end
  local from = tonumber(froms[i])
  -- Ready now: not claimed by another since it was named.
  if from and from <= now then
    local token = ARGV[3] .. i
    if redis.call('SET', KEYS[2 + 2 * i], token, 'NX', 'PX', ARGV[1]) then
      local id = redis.call('LINDEX', KEYS[3 + 2 * i], 0)
      if id then
        local n = #claimed
        claimed[n + 1], claimed[n + 2], claimed[n + 3] = key, id, token
        claimed[n + 4] = redis.call('HGET', KEYS[2], id)
        taken = taken + 1
      end
    end
    -- Held (here or elsewhere): looked at again when its lease ends.
    looks[#looks + 1], looks[#looks + 2] = deadline, key
  end
end
if #looks > 0 then redis.call('ZADD', KEYS[1], 'XX', unpack(looks)) end
if #claimed > 0 then redis.call('HINCRBY', KEYS[3], 'active', #claimed / 4) end
-- Named from a place of the caller's own (ARGV[5], at random) among the
-- first 3 x as many ready keys, where there are that many: callers that
-- named the same first keys would take them from each other.
local names = tonumber(ARGV[4])
local skip = tonumber(ARGV[5]) % (2 * names)
local next = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', skip, names)
if skip > 0 and #next < names then
  next = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, names)
end
return {next, claimed}
