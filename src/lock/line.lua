-- A key's line of waiters (see contend.lua and permits.lua), as functions
-- prepended to release.lua and permits.lua, whose releases hand the key on
-- to the first waiter in line whose process is alive: a waiter joins only
-- while its process's release listener is subscribed to the key's channel
-- and to a presence channel beside it, `<channel>#<tag>` (the tag starts
-- every token the process makes). A process that died has its connection
-- closed by its kernel, and Redis drops its subscriptions at once: its
-- waiters are skipped, and leave the line as a release looks at them.

-- Whether the process of the line member `member` (a token, or
-- "<token>/<limit>") still listens on `channel`. `publish`: "PUBLISH" on a
-- single server, "SPUBLISH" on a cluster, whose presence channel lives on
-- the node of its hash tag (the channel's), counted by SHARDNUMSUB.
local function listens(channel, member, publish)
  local count = publish == 'SPUBLISH' and 'SHARDNUMSUB' or 'NUMSUB'
  local counts = redis.call('PUBSUB', count, channel .. '#' .. string.sub(member, 1, 8))
  return tonumber(counts[2]) > 0
end

-- The most waiters one release looks at. Waiters of dead processes among
-- them leave the line as they are looked at (one presence check per
-- process); those further back stay until they come to the front (or the
-- line expires), so a long line of dead waiters costs each release
-- LINE_LOOK waiters at most, and shrinks by as many. Past LINE_LOOK dead
-- waiters, a release hands the key to nobody and wakes every waiter.
local LINE_LOOK = 64

-- Whether the process of `member` listens on `channel`, asked once per
-- process: `alive` keeps the answers by process tag.
local function lives(alive, channel, member, publish)
  local tag = string.sub(member, 1, 8)
  if alive[tag] == nil then alive[tag] = listens(channel, member, publish) end
  return alive[tag]
end

-- Pops the first waiter of `line` whose process listens on `channel`,
-- dropping the waiters of dead processes before it (at most LINE_LOOK
-- waiters are looked at); nil when none is found.
local function pop_live(line, channel, publish)
  local alive = {}
  for _ = 1, LINE_LOOK do
    local first = redis.call('ZPOPMIN', line)[1]
    if not first or lives(alive, channel, first, publish) then
      return first
    end
  end
  return nil
end
