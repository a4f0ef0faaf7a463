"""Create -> run `true` -> remove, timed three ways against one daemon:
the E2B SDK (Sandbox.create, commands.run, kill), Strata's API over its
Unix socket (HTTP+JSON from this process), and Strata's CLI (a process per
step). Run by scripts/bench-e2b.sh, which starts the daemon. Prints a
Markdown table (milliseconds; median, p90 over RUNS rounds, interleaved).
"""

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time

from e2b import Sandbox

SOCK = os.environ["STRATA_SOCKET"]
STRATA = os.environ["STRATA"]
RUNS = int(os.environ.get("RUNS", "30"))


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("strata")
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.path)


api_conn = UnixConnection(SOCK)


def api(method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    api_conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    r = api_conn.getresponse()
    out = r.read()
    if r.status >= 300:
        raise RuntimeError(f"{method} {path}: {r.status} {out!r}")
    return json.loads(out) if out else None


def e2b_round():
    t0 = time.perf_counter()
    s = Sandbox.create()
    t1 = time.perf_counter()
    s.commands.run("true")
    t2 = time.perf_counter()
    s.kill()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def api_round(argv):
    t0 = time.perf_counter()
    sid = api("POST", "/v1/sandboxes", {"image": "base"})["id"]
    t1 = time.perf_counter()
    api("POST", f"/v1/sandboxes/{sid}/exec", {"argv": argv})
    t2 = time.perf_counter()
    api("DELETE", f"/v1/sandboxes/{sid}")
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


E2B_URL = os.environ["E2B_API_URL"].removeprefix("http://")
e2b_conn = http.client.HTTPConnection(E2B_URL)


def e2b_raw(method, path, body=None, headers=None, stream=False):
    h = {"X-API-KEY": os.environ["E2B_API_KEY"], **(headers or {})}
    if stream:
        data = json.dumps(body).encode()
        data = b"\0" + len(data).to_bytes(4, "big") + data
        h["Content-Type"] = "application/connect+json"
    else:
        data = json.dumps(body).encode() if body is not None else None
        if data:
            h["Content-Type"] = "application/json"
    e2b_conn.request(method, path, body=data, headers=h)
    r = e2b_conn.getresponse()
    out = r.read()
    if r.status >= 300:
        raise RuntimeError(f"{method} {path}: {r.status} {out!r}")
    return json.loads(out) if out and not stream else out


def e2b_raw_round():
    """The requests the SDK sends, from one kept-alive http.client
    connection: the listener's own cost, without the SDK's."""
    t0 = time.perf_counter()
    made = e2b_raw("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {}, "envVars": {}})
    t1 = time.perf_counter()
    frames = e2b_raw(
        "POST",
        "/process.Process/Start",
        {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "true"]}, "stdin": False},
        {"E2b-Sandbox-Id": made["sandboxID"], "X-Access-Token": made["envdAccessToken"]},
        stream=True,
    )
    assert b'"end"' in frames, frames
    t2 = time.perf_counter()
    e2b_raw("DELETE", f"/sandboxes/{made['sandboxID']}")
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def cli_round():
    env = dict(os.environ, STRATA_SOCKET=SOCK)
    t0 = time.perf_counter()
    sid = subprocess.run([STRATA, "create", "--image", "base"], env=env, check=True, capture_output=True, text=True).stdout.strip()
    t1 = time.perf_counter()
    subprocess.run([STRATA, "exec", sid, "--", "true"], env=env, check=True, capture_output=True)
    t2 = time.perf_counter()
    subprocess.run([STRATA, "rm", sid], env=env, check=True, capture_output=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


ways = {
    "E2B SDK 2.63.0: `Sandbox.create()`, `commands.run(\"true\")` (`/bin/bash -l -c true`), `kill()`": e2b_round,
    "E2B API without the SDK: the same three requests from `http.client` (one kept-alive connection)": e2b_raw_round,
    "Strata API: create, exec `/bin/bash -l -c true`, rm (one kept-alive connection)": lambda: api_round(
        ["/bin/bash", "-l", "-c", "true"]
    ),
    "Strata API: create, exec `true`, rm": lambda: api_round(["true"]),
    "Strata CLI: `strata create`, `strata exec ID -- true`, `strata rm ID` (a process each)": cli_round,
}
results = {name: [] for name in ways}
for name, fn in ways.items():  # warm-up
    fn()
for _ in range(RUNS):
    for name, fn in ways.items():
        results[name].append(fn())


def ms(xs, q):
    xs = sorted(xs)
    return 1000 * (statistics.median(xs) if q == 50 else xs[min(len(xs) - 1, int(len(xs) * q / 100))])


print(f"| steps ({RUNS} rounds, interleaved) | total p50 | total p90 | create p50 | run p50 | remove p50 |")
print("|---|---:|---:|---:|---:|---:|")
for name, rounds in results.items():
    total = [sum(r) for r in rounds]
    cols = [ms(total, 50), ms(total, 90)] + [ms([r[i] for r in rounds], 50) for i in range(3)]
    print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cols) + " |")

# Metrics: one sandbox, its metrics read RUNS times each way, interleaved.
sbx = Sandbox.create()
e2b_raw("GET", f"/sandboxes/{sbx.sandbox_id}")  # the kept-alive connection
strata_id = next(s["id"] for s in api("GET", "/v1/sandboxes") if s["state"] == "running")
reads = {
    "E2B SDK 2.63.0: `sandbox.get_metrics()`": lambda: sbx.get_metrics(),
    "E2B API without the SDK: `GET /sandboxes/{id}/metrics` (`http.client`, kept alive)": lambda: e2b_raw(
        "GET", f"/sandboxes/{sbx.sandbox_id}/metrics"
    ),
    "Strata API: `GET /v1/sandboxes/{id}/metrics` (kept alive)": lambda: api("GET", f"/v1/sandboxes/{strata_id}/metrics"),
    "Strata API: `GET /metrics` (Prometheus text, kept alive)": lambda: api_text("/metrics"),
}


def api_text(path):
    api_conn.request("GET", path)
    r = api_conn.getresponse()
    out = r.read()
    if r.status >= 300:
        raise RuntimeError(f"GET {path}: {r.status} {out!r}")
    return out


timed = {name: [] for name in reads}
for fn in reads.values():
    fn()
for _ in range(RUNS):
    for name, fn in reads.items():
        t0 = time.perf_counter()
        fn()
        timed[name].append(time.perf_counter() - t0)
sbx.kill()
print()
print(f"| metrics read ({RUNS} rounds, interleaved) | p50 | p90 |")
print("|---|---:|---:|")
for name, xs in timed.items():
    print(f"| {name} | {ms(xs, 50):.2f} | {ms(xs, 90):.2f} |")
