"""A producer in another language pushing keyed messages, as
docs/internals.md describes it: load scripts/push_keyed.lua and call it
with EVALSHA on the queue's partition (on one server the queue's own
slot's; on a Redis Cluster the slot of each key's lock), then mark the
partition in the queue's index and ring the queue's doorbell. Standard
library only.

usage: keyed_producer.py <port> <queue> <path to push_keyed.lua> [--no-index]
  [--by-lock-slot]
--by-lock-slot: on one server too, each key's partition in its lock's slot,
as lockgate 0.1 pushed them (messages an upgrade finds waiting)
stdin: JSON list of [key, id, when, payload] or [key, id, when, payload,
limits] (payload any JSON value; limits the script's: "2" for 2 permits,
"/<limit>/<period us>/<burst>/<window us>" for a rate, or both)
stdout: JSON list with, per message, [added, due_ms] or {"error": text}
"""
import json
import sys

from producer import Redis, RedisError, Script

SLOTS = 16384


def crc16(data):
    """CRC16-XMODEM, the hash of Redis Cluster's slots."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key):
    """A key as lockgate writes it inside {...}: \\ as \\\\, } as \\)."""
    return key.replace("\\", "\\\\").replace("}", "\\)")


_tags = {}
_next = [0]


def slot_tag(slot):
    """The smallest non-negative integer whose decimal text hashes to
    `slot`, as text: the tag of the slot's partitions."""
    while slot not in _tags:
        text = str(_next[0])
        _tags.setdefault(crc16(text.encode()) % SLOTS, text)
        _next[0] += 1
    return _tags[slot]


class KeyedProducer:
    NAMES = ["data", "schedule", "active", "dead", "errors", "claims", "lines", "ready",
             "keyof", "seq", "limits"]

    def __init__(self, redis, queue, script_path, prefix="lockgate", cluster=False,
                 by_lock_slot=False):
        self.redis, self.prefix, self.queue = redis, prefix, hash_tag(queue)
        self.by_lock_slot = cluster or by_lock_slot
        self.script = Script(redis, script_path)
        base = "%s:{%s}" % (prefix, self.queue)
        self.index, self.bell = base + ":partitions", base + ":bell"
        # Where the script keeps the counts (and the claim and seq
        # counters): the queue's on one server, the partition's own on a
        # Redis Cluster.
        self.counted = None if cluster else base + ":keyed"

    def partition(self, key):
        """The slot of `key`'s partition and the partition's 13 keys: on
        one server the queue's own slot, whatever the key, and the
        counters and counts are the queue's; on a cluster the slot of the
        key's lock."""
        tag = hash_tag(key) if self.by_lock_slot else self.queue
        slot = crc16(tag.encode("utf-8")) % SLOTS
        base = "%s:{%s}:%s" % (self.prefix, slot_tag(slot), self.queue)
        counted = self.counted or base
        own = {"claims", "seq"} if self.counted else set()
        return slot, [(counted if name in own else base) + ":" + name
                      for name in self.NAMES] + [counted + ":counts", counted + ":oldest"]

    def push_all(self, messages, index=True):
        """Pushes `messages` ([key, id, when, payload] or [key, id, when,
        payload, limits]), one script call per partition, in order within
        each; returns per message [added, due_ms] or {"error": text} (a
        refused call refuses all its messages). `index=False` leaves out
        step 4, as a producer that stopped after its script would."""
        calls = {}
        for n, message in enumerate(messages):
            key, msg_id, when, payload = message[:4]
            limits = message[4] if len(message) > 4 else ""
            slot, keys = self.partition(key)
            call = calls.setdefault(slot, {"keys": keys, "argv": [], "at": []})
            call["argv"] += [key, str(limits), msg_id, when, json.dumps(payload)]
            call["at"].append(n)
        results = [None] * len(messages)
        for slot, call in calls.items():
            try:
                reply = self.script.run(call["keys"], call["argv"])
            except RedisError as e:
                for n in call["at"]:
                    results[n] = {"error": str(e)}
                continue
            # One flat list, two entries per message: added, due ms.
            for n, i in zip(call["at"], range(0, len(reply), 2)):
                results[n] = [reply[i], reply[i + 1]]
            if index:
                # Step 4, required: the index is how workers find the
                # partition, and the bell wakes them.
                self.redis.call("ZADD", self.index, "LT", 0, slot)
                self.redis.call("LPUSH", self.bell, 1)
                self.redis.call("LTRIM", self.bell, 0, 0)
        return results


def main():
    port, queue, script_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    index = "--no-index" not in sys.argv[4:]
    by_lock_slot = "--by-lock-slot" in sys.argv[4:]
    producer = KeyedProducer(Redis(port), queue, script_path, by_lock_slot=by_lock_slot)
    json.dump(producer.push_all(json.load(sys.stdin), index), sys.stdout)


if __name__ == "__main__":
    main()
