-- Takes a message of the queue's own keys into its key's line in this
-- partition (see keyed.lua): an unkeyed message whose key a `LockLayer`
-- found busy, deferred into that line to be claimed with the key's lock. It
-- takes the place its push time gives it (see next_seq); its record keeps
-- its counts, counts the deferral and loses a priority (a key's messages
-- start in push order). An id here already (a resend) is left as it is. The
-- caller then removes the message from the queue.
-- KEYS[1..14]: the partition   ARGV[1]: the key   ARGV[2]: its limits (as
-- keyed_push.lua's)   ARGV[3]: the id   ARGV[4]: the delay in ms before it
-- joins the line   ARGV[5]: its record in the queue
-- Returns {added (1|0), due ms}.
local key, id = ARGV[1], stored_id(ARGV[1], ARGV[3])
local now = now_ms()
local due = now + tonumber(ARGV[4])
local permits, rate = string.match(ARGV[2], '^(%d*)/?(.*)$')
set_limits(key, permits or '', rate or '')
local enq, failures, deferrals, stalls, payload = parse_or_keep(ARGV[5])
local record = make_record(enq, failures, deferrals + 1, stalls, payload)
if redis.call('HSETNX', KEYS[DATA], id, record) == 0 then return {0, due} end
place(key, id, due, now, tonumber(enq))
return {1, due}
