"""envd's process table across daemon restarts, through the unmodified E2B
Python SDK.

Run by tests/e2b.rs in three phases against one sandbox, the daemon
killed (SIGKILL) and started again between them:

    restart.py before   creates the sandbox, starts the commands
    restart.py after    checks them after the first restart, starts one more
    restart.py again    checks that one after the second restart

E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and STRATA_WORK (where the
phases keep what they share, state.json) are set.
"""

import json
import os
import sys
import time

from e2b import PtySize, Sandbox

STATE = os.path.join(os.environ["STRATA_WORK"], "state.json")
TICKER = "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.1; done"
# More than a pipe holds, written while no daemon reads: the command
# waits (it never sees EPIPE) and finishes once a daemon reads again.
FLOOD = "sleep 1; head -c 2000000 /dev/zero | tr '\\0' x && echo done > /tmp/flood-done"


def step(name):
    print(f"--- {name}", flush=True)


def until(what, fn, limit=20):
    t0 = time.time()
    while True:
        v = fn()
        if v:
            return v
        assert time.time() - t0 < limit, f"{what}: not within {limit} s"
        time.sleep(0.1)


def first_output(handle, want, limit=20):
    """Read `handle`'s stream until its output (stdout or pty) holds
    `want`; the text read."""
    seen = ""
    t0 = time.time()
    for stdout, _stderr, pty in handle:
        seen += stdout or ""
        seen += (pty or b"").decode(errors="replace")
        if want(seen):
            return seen
        assert time.time() - t0 < limit, f"not within {limit} s: {seen[-500:]!r}"
    raise AssertionError(f"the stream ended first: {seen[-500:]!r}")


def listed(sbx):
    return {p.pid: p for p in sbx.commands.list()}


def reconnect(*names):
    """The state the phase before left, its sandbox (connected again) and
    the commands listed now, `names` among them."""
    s = json.load(open(STATE))
    sbx = Sandbox.connect(s["sandbox"])
    pids = listed(sbx)
    for name in names:
        assert s[name] in pids, (name, s[name], pids)
    return s, sbx, pids


def ticks(text):
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("tick ") and line[5:].isdigit()]


phase = sys.argv[1]

if phase == "before":
    step("commands started before the restart")
    sbx = Sandbox.create("base", timeout=600)
    ticker = sbx.commands.run(TICKER, background=True, timeout=0)
    seen = first_output(ticker, lambda s: len(ticks(s)) >= 3)
    catter = sbx.commands.run("cat; echo cat-closed", background=True, stdin=True, timeout=0, envs={"TOKEN": "s3cret"})
    flood = sbx.commands.run(FLOOD, background=True, timeout=0)
    short = sbx.commands.run("sleep 1", background=True, timeout=0)
    pty = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    pids = listed(sbx)
    for h in (ticker, catter, flood, short, pty):
        assert h.pid in pids, (h.pid, pids)
    assert pids[catter.pid].envs == {"TOKEN": "s3cret"}, pids[catter.pid]
    json.dump(
        {
            "sandbox": sbx.sandbox_id,
            "ticker": ticker.pid,
            "last_tick": max(ticks(seen)),
            "catter": catter.pid,
            "flood": flood.pid,
            "short": short.pid,
            "pty": pty.pid,
        },
        open(STATE, "w"),
    )
    print("BEFORE DONE", flush=True)

elif phase == "after":
    step("the list after the restart: the running commands, with their ids and config")
    s, sbx, pids = reconnect("ticker", "catter", "pty")
    assert pids[s["ticker"]].cmd == "/bin/bash" and TICKER in pids[s["ticker"]].args, pids[s["ticker"]]
    assert "cat; echo cat-closed" in pids[s["catter"]].args, pids[s["catter"]]
    # Its environment was never written to the catalog.
    assert pids[s["catter"]].envs == {}, pids[s["catter"]]
    # It ended while no daemon ran: gone from the table.
    assert s["short"] not in pids, pids

    step("connect(pid) reattaches to the output from then on")
    h = sbx.commands.connect(s["ticker"])
    seen = first_output(h, lambda t: len(ticks(t)) >= 2)
    # The ticker wrote on while the daemon was down (no EPIPE killed it).
    assert min(ticks(seen)) > s["last_tick"] + 10, (s["last_tick"], seen[:200])
    h.disconnect()

    step("a command that filled its pipe while the daemon was down goes on")
    # The new daemon took it back as it started, and reads it again: it
    # ends (had its pipe closed under it, `tr` would die of SIGPIPE).
    until("the flood to finish", lambda: sbx.files.exists("/tmp/flood-done"))
    until("the flood to leave the list", lambda: s["flood"] not in listed(sbx))

    step("stdin kept open across the restart, then closed")
    h = sbx.commands.connect(s["catter"])
    sbx.commands.send_stdin(s["catter"], "after the restart\n")
    first_output(h, lambda t: "after the restart" in t)
    sbx.commands.close_stdin(s["catter"])
    until("cat to end on EOF", lambda: s["catter"] not in listed(sbx))

    step("a pty session across the restart")
    h = sbx.pty.connect(s["pty"])
    sbx.pty.send_stdin(s["pty"], b"echo pty-$((6*7))\n")
    first_output(h, lambda t: "pty-42" in t)
    h.disconnect()

    step("a command started after the restart, for the next one")
    later = sbx.commands.run("sleep 600", background=True, timeout=0)
    s["later"] = later.pid
    json.dump(s, open(STATE, "w"))
    print("AFTER DONE", flush=True)

elif phase == "again":
    step("after a second restart: the old and the new commands are listed")
    s, sbx, pids = reconnect("ticker", "pty", "later")
    assert "sleep 600" in pids[s["later"]].args, pids[s["later"]]

    step("kill through the table")
    h = sbx.commands.connect(s["ticker"])
    first_output(h, lambda t: len(ticks(t)) >= 1)
    assert sbx.commands.kill(s["ticker"])
    assert sbx.commands.kill(s["later"])
    assert sbx.pty.kill(s["pty"])
    until("the killed commands to leave the list", lambda: not listed(sbx))
    sbx.kill()
    print("AGAIN DONE", flush=True)
