"""A producer in another language, as docs/internals.md describes it: load
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


class Script:
    """A script file loaded once, called with EVALSHA (EVAL after NOSCRIPT:
    the server restarted or flushed its script cache)."""

    def __init__(self, redis, path):
        self.redis = redis
        with open(path, "rb") as f:
            self.source = f.read()
        self.sha = redis.call("SCRIPT", "LOAD", self.source).decode()

    def run(self, keys, argv):
        try:
            return self.redis.call("EVALSHA", self.sha, len(keys), *keys, *argv)
        except RedisError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
            return self.redis.call("EVAL", self.source, len(keys), *keys, *argv)


class Producer:
    """Pushes to lockgate queue `queue` (default prefix "lockgate")."""

    def __init__(self, redis, queue, script_path):
        self.script = Script(redis, script_path)
        base = "lockgate:{%s}" % queue
        # The fourth key lets it push messages with a priority ("0/5").
        self.keys = [base + ":data", base + ":schedule", base + ":bell", base + ":prioritized"]

    def push(self, messages):
        """messages: (id, when, payload) triplets; `when` is a delay in ms
        ("0": now) or "@<unix ms>". Returns [added, due_ms] per message."""
        argv = []
        for msg_id, when, payload in messages:
            argv += [msg_id, when, json.dumps(payload)]
        reply = self.script.run(self.keys, argv)
        return [reply[i:i + 2] for i in range(0, len(reply), 2)]


def answer(push):
    """Calls `push` with each item of the JSON list on stdin and prints the
    JSON list of what it returned, or {"error": text} for a Redis error."""
    results = []
    for call in json.load(sys.stdin):
        try:
            results.append(push(call))
        except RedisError as e:
            results.append({"error": str(e)})
    json.dump(results, sys.stdout)


def main():
    port, queue, script_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    answer(Producer(Redis(port), queue, script_path).push)


if __name__ == "__main__":
    main()
