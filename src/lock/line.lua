-- A key's line of waiters (see contend.lua and permits.lua), as functions
-- prepended to release.lua and permits.lua, whose releases hand the key on
-- to the first waiter in line whose process is alive: a waiter joins only
-- while its process's release listener is subscribed to the key's channel
-- and to a presence channel beside it, `<channel>#<tag>` (the tag starts
-- every token the process makes). A process that died has its connection
-- closed by its kernel, and Redis drops its subscriptions at once: its
-- waiters are skipped, all together.

-- Whether the process of the line member `member` (a token, or
-- "<token>/<limit>") still listens on `channel`. `publish`: "PUBLISH" on a
-- single server, "SPUBLISH" on a cluster, whose presence channel lives on
-- the node of its hash tag (the channel's), counted by SHARDNUMSUB.
local function listens(channel, member, publish)
  local count = publish == 'SPUBLISH' and 'SHARDNUMSUB' or 'NUMSUB'
  local counts = redis.call('PUBSUB', count, channel .. '#' .. string.sub(member, 1, 8))
  return tonumber(counts[2]) > 0
end

-- Removes from `line` every member of the process `member` belongs to (the
-- first 1,000 members are looked at: lines are short).
local function drop_process(line, member)
  local tag = string.sub(member, 1, 8)
  for _, other in ipairs(redis.call('ZRANGE', line, 0, 999)) do
    if string.sub(other, 1, 8) == tag then
      redis.call('ZREM', line, other)
    end
  end
end

-- Pops the first waiter of `line` whose process listens on `channel`,
-- dropping the waiters of dead processes before it (at most 16 processes);
-- nil when none is left.
local function pop_live(line, channel, publish)
  for _ = 1, 16 do
    local first = redis.call('ZPOPMIN', line)[1]
    if not first or listens(channel, first, publish) then
      return first
    end
    drop_process(line, first)
  end
  return nil
end
