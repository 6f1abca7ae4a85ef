"""A producer in another language pushing to a queue of n shards, as
docs/cluster.md describes it: check n against the queue's record, pick the
shard of each message by its id, call scripts/push.lua with EVALSHA on that
shard's keys, then, for a shard other than 0, lower the shard's entry in
the queue's index and ring the queue's doorbell. Standard library only.

usage: sharded_producer.py <port> <queue> <shards> <path to push.lua>
stdin: JSON list of [id, when, payload] (payload any JSON value)
stdout: JSON list with, per message, [added, due_ms, shard] or {"error": text}
"""
import json
import sys

from keyed_producer import SLOTS, crc16, hash_tag, slot_tag
from producer import Redis, Script, answer


class ShardedProducer:
    def __init__(self, redis, queue, shards, script_path, prefix="lockgate"):
        self.redis, self.shards = redis, shards
        self.script = Script(redis, script_path)
        tag = hash_tag(queue)
        own = "%s:{%s}" % (prefix, tag)
        self.index, self.bell = own + ":partitions", own + ":bell"
        if shards > 1:
            # The count is the queue's, fixed at its first use.
            redis.call("SET", own + ":shards", shards, "NX")
            recorded = int(redis.call("GET", own + ":shards"))
            if recorded != shards:
                raise ValueError("queue %r has %d shards, not %d" % (queue, recorded, shards))
        first = crc16(tag.encode()) % SLOTS
        self.bases = [own] + [
            "%s:{%s}#%d:%s" % (prefix, slot_tag((first + i * SLOTS // shards) % SLOTS), i, tag)
            for i in range(1, shards)
        ]

    def push(self, msg_id, when, payload):
        """Returns [added, due_ms, shard]."""
        shard = crc16(msg_id.encode()) % SLOTS % self.shards
        base = self.bases[shard]
        keys = [base + ":" + name for name in ("data", "schedule", "bell", "prioritized")]
        argv = [msg_id, when, json.dumps(payload)]
        reply = self.script.run(keys, argv)
        added, due = reply[0], reply[1]
        if shard > 0 and added == 1:
            # After the script: the shard has work from `due`; idle workers wake.
            self.redis.call("ZADD", self.index, "LT", max(due, 0), SLOTS + shard)
            self.redis.call("LPUSH", self.bell, 1)
            self.redis.call("LTRIM", self.bell, 0, 0)
        return [added, due, shard]


def main():
    port, queue, shards, script_path = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    producer = ShardedProducer(Redis(port), queue, shards, script_path)
    answer(lambda message: producer.push(*message))


if __name__ == "__main__":
    main()
