"""A producer in another language, as the README describes it: load
scripts/push.lua and call it with EVALSHA. Standard library only (a minimal
RESP client), so it runs wherever python3 does.

usage: producer.py <port> <queue> <path to push.lua>
stdin: JSON list of [id, when, payload] (payload any JSON value)
stdout: JSON list with, per call, the script's reply or {"error": text}
        (one call per inner list when stdin is a list of lists of triplets)
"""
import json
import socket
import sys


class RedisError(Exception):
    pass


class Redis:
    def __init__(self, port):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.file = self.sock.makefile("rb")

    def call(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for arg in args:
            arg = arg if isinstance(arg, bytes) else str(arg).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        self.sock.sendall(b"".join(out))
        return self.read()

    def read(self):
        line = self.file.readline()[:-2]
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RedisError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self.file.read(n + 2)[:-2]
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RedisError("unexpected reply %r" % line)


class Producer:
    """Pushes to lockgate queue `queue` (default prefix "lockgate")."""

    def __init__(self, redis, queue, script_path):
        self.redis = redis
        with open(script_path, "rb") as f:
            self.script = f.read()
        self.sha = redis.call("SCRIPT", "LOAD", self.script).decode()
        base = "lockgate:{%s}" % queue
        # The fourth key lets it push messages with a priority ("0/5").
        self.keys = [base + ":data", base + ":schedule", base + ":bell", base + ":prioritized"]

    def push(self, messages):
        """messages: (id, when, payload) triplets; `when` is a delay in ms
        ("0": now) or "@<unix ms>". Returns [added, due_ms] per message."""
        argv = []
        for msg_id, when, payload in messages:
            argv += [msg_id, when, json.dumps(payload)]
        try:
            reply = self.redis.call("EVALSHA", self.sha, len(self.keys), *self.keys, *argv)
        except RedisError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
            # The server restarted or flushed its script cache.
            reply = self.redis.call("EVAL", self.script, len(self.keys), *self.keys, *argv)
        return [reply[i:i + 2] for i in range(0, len(reply), 2)]


def main():
    port, queue, script_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    producer = Producer(Redis(port), queue, script_path)
    results = []
    for call in json.load(sys.stdin):
        try:
            results.append(producer.push(call))
        except RedisError as e:
            results.append({"error": str(e)})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
