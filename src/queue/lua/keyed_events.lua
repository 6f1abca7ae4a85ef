-- Records what keyed scripts changed on the queue's own streams (events,
-- completed messages): a keyed message's line lives in its key's hash slot
-- and these streams in the queue's, so no one script reaches both on a
-- Redis Cluster; the caller runs this one right after the keyed script.
-- KEYS[1]: events   KEYS[2]: completed   KEYS[3]: activity (see activity.lua)
-- ARGV[1]: the events' cap ("": none)
-- ARGV[2], ARGV[3]: the completed stream's max count and max age in ms
-- ARGV[4]: how many event entries follow, each: kind, key ("" for none),
--   error ("" for none), n, then n pairs of id and attempt; then per
--   completed message its id and its record (the queue's format)
-- An entry is `e <kind> [k <key>] t <server ms> [x <error>]` then the pairs
-- (see emit in the prelude): the key right after the kind keeps the entry
-- readable by position.
local now = now_ms()
local cap, at = ARGV[1], 5
for _ = 1, tonumber(ARGV[4]) do
  local kind, key, error, n = ARGV[at], ARGV[at + 1], ARGV[at + 2], tonumber(ARGV[at + 3])
  local fields = {'e', kind}
  if key ~= '' then append(fields, 'k', key) end
  append(fields, 't', now)
  if error ~= '' then append(fields, 'x', error) end
  for i = at + 4, at + 3 + 2 * n do fields[#fields + 1] = ARGV[i] end
  if cap ~= '' then redis.call('XADD', KEYS[1], 'MAXLEN', '~', cap, '*', unpack(fields)) end
  count_activity(KEYS[3], cap, kind, now, n)
  at = at + 4 + 2 * n
end
for i = at, #ARGV - 1, 2 do
  keep_completed(KEYS[2], ARGV[2], ARGV[3], now, ARGV[i], ARGV[i + 1])
end
return 1
