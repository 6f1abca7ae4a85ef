"""A producer in another language pushing keyed messages, as the README
describes it: load scripts/push_keyed.lua and call it with EVALSHA on the
partition of each key's lock slot, then mark the partition in the queue's
index and ring the queue's doorbell. Standard library only.

usage: keyed_producer.py <port> <queue> <path to push_keyed.lua>
stdin: JSON list of [key, id, when, payload] or [key, id, when, payload,
limits] (payload any JSON value; limits the script's: "2" for 2 permits,
"/<limit>/<period us>/<burst>/<window us>" for a rate, or both)
stdout: JSON list with, per message, [added, due_ms] or {"error": text}
"""
import json
import sys

from producer import Redis, Script, answer

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

    def __init__(self, redis, queue, script_path, prefix="lockgate"):
        self.redis, self.prefix, self.queue = redis, prefix, hash_tag(queue)
        self.script = Script(redis, script_path)
        base = "%s:{%s}" % (prefix, self.queue)
        self.index, self.bell = base + ":partitions", base + ":bell"

    def push(self, key, msg_id, when, payload, limits=""):
        """Returns [added, due_ms]. `limits`: "" (as they are), the key's
        permits, and/or "/<rate>" (see scripts/push_keyed.lua)."""
        slot = crc16(hash_tag(key).encode()) % SLOTS
        base = "%s:{%s}:%s" % (self.prefix, slot_tag(slot), self.queue)
        keys = [base + ":" + name for name in self.NAMES]
        argv = [key, str(limits), msg_id, when, json.dumps(payload)]
        reply = self.script.run(keys, argv)
        # After the script: the partition may have work, and idle workers wake.
        self.redis.call("ZADD", self.index, "LT", 0, slot)
        self.redis.call("LPUSH", self.bell, 1)
        self.redis.call("LTRIM", self.bell, 0, 0)
        return reply


def main():
    port, queue, script_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    producer = KeyedProducer(Redis(port), queue, script_path)
    answer(lambda message: producer.push(*message))


if __name__ == "__main__":
    main()
