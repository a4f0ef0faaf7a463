#!/usr/bin/env python3
"""CPU a sandbox start costs the whole machine, for scripts/bench.sh.

usage: cpu-per-run.py api SOCKET N          create -> exec true -> rm, N times, through the API
       cpu-per-run.py spawn N ARGV...       run ARGV N times (posix_spawn + wait)

Prints the machine's busy CPU time (user, nice, system, irq, softirq from
/proc/stat: every process and kernel thread, the daemon's threads, the
shims, kworkers cleaning up namespaces) per run, in ms, minus this
client's own CPU. Back to back on a small host the wall time of a start
is bounded by this, not by its latency on an idle machine.
"""
import http.client
import json
import os
import resource
import socket
import sys


def busy_ticks():
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return user + nice + system + irq + softirq


def own_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost")
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.path)


def api_cycle(conn):
    def call(method, path, body=None):
        conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        if r.status >= 300:
            sys.exit(f"{method} {path}: {r.status} {data!r}")
        return json.loads(data) if data else None

    sid = call("POST", "/v1/sandboxes", {"image": "busybox"})["id"]
    call("POST", f"/v1/sandboxes/{sid}/exec", {"argv": ["true"]})
    call("DELETE", f"/v1/sandboxes/{sid}")


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "api" and len(sys.argv) == 4:
        conn, n = UnixHTTP(sys.argv[2]), int(sys.argv[3])
        run = lambda: api_cycle(conn)  # noqa: E731
    elif mode == "spawn" and len(sys.argv) > 3:
        n, argv = int(sys.argv[2]), sys.argv[3:]

        def run():
            pid = os.posix_spawnp(argv[0], argv, os.environ)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                sys.exit(f"{argv[0]}: exit status {status}")
    else:
        sys.exit(__doc__)
    for _ in range(min(n, 10)):  # warm-up
        run()
    hz = os.sysconf("SC_CLK_TCK")
    ticks, own = busy_ticks(), own_seconds()
    for _ in range(n):
        run()
    used = (busy_ticks() - ticks) / hz - (own_seconds() - own)
    print(f"{used / n * 1000:.3f}")


if __name__ == "__main__":
    main()
