"""The unmodified E2B Python SDK against Strata's E2B listener.

Run by tests/e2b.rs (which starts the daemon, imports the E2B-style image
as the template `base` and sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY,
STRATA_OTHER_KEY and STRATA_HOST_CANARY). Each check names itself; the
first failing one ends the run with a traceback.
"""

import asyncio
import datetime
import hashlib
import io
import json
import os
import sys
import time
import urllib.error
import urllib.request

from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    FileType,
    InvalidArgumentException,
    NotFoundException,
    PtySize,
    Sandbox,
)
from e2b.sandbox.sandbox_api import SandboxQuery
from e2b.api.client.models.sandbox_state import SandboxState

RUN = str(os.getpid())
API = os.environ["E2B_API_URL"]
OTHER_KEY = os.environ["STRATA_OTHER_KEY"]
CANARY = os.environ["STRATA_HOST_CANARY"]
# An envVar the daemon's policy (--e2b-secret-env STRATA_SECRET_*) keeps
# out of the catalog; commands compare its digest, never print it.
SECRET = os.environ["STRATA_E2B_SECRET"]
SECRET_SHA = "printf %s \"$STRATA_SECRET_TOKEN\" | sha256sum | cut -d' ' -f1"


def has_secret(sandbox):
    return sandbox.commands.run(SECRET_SHA).stdout.strip() == hashlib.sha256(SECRET.encode()).hexdigest()


def step(name):
    print(f"--- {name}", flush=True)


def raises(exc, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc as e:
        return e
    raise AssertionError(f"{fn.__name__} did not raise {exc.__name__}")


def envd_call(sandbox_id, token, method, body, host=None):
    """A raw envd unary call, as a hostile client would make it; with
    `host`, the sandbox is named by the Host header alone."""
    headers = {"Content-Type": "application/json", "X-Access-Token": token}
    if host:
        headers["Host"] = host
    else:
        headers["E2b-Sandbox-Id"] = sandbox_id
    req = urllib.request.Request(
        f"{API}/filesystem.Filesystem/{method}", data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


step("create from the image template, with metadata and envs")
sbx = Sandbox.create(
    metadata={"suite": "strata", "run": RUN}, envs={"FROM_CREATE": "yes", "STRATA_SECRET_TOKEN": SECRET}
)
assert sbx.sandbox_id
assert has_secret(sbx), "the secret envVar did not reach the command"
info = sbx.get_info()
assert info.state.value == "running", info.state
assert info.metadata == {"suite": "strata", "run": RUN}, info.metadata

step("commands.run: stdout, stderr, exit code")
r = sbx.commands.run("echo hello; echo oops >&2")
assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0), r
e = raises(CommandExitException, sbx.commands.run, "echo partial; exit 3")
assert e.exit_code == 3 and e.stdout == "partial\n", e

step("commands.run: envs, cwd, the default user and root")
r = sbx.commands.run('echo "$FOO-$FROM_CREATE"; pwd; id -un; echo $HOME', envs={"FOO": "bar"}, cwd="/tmp")
assert r.stdout.split() == ["bar-yes", "/tmp", "user", "/home/user"], r.stdout
assert sbx.commands.run("pwd").stdout.strip() == "/home/user"
sbx.commands.run("mkdir -p work/deeper")
assert sbx.commands.run("pwd", cwd="work/deeper").stdout.strip() == "/home/user/work/deeper"
assert sbx.commands.run("pwd", cwd="~/work").stdout.strip() == "/home/user/work"
assert sbx.commands.run("id -u", user="root").stdout.strip() == "0"

step("any image: no `user` account runs as root in its home; an image's User and WorkingDir lead")
plain = Sandbox.create(template="plain")
try:
    r = plain.commands.run('id -un; pwd; echo $HOME')
    assert r.stdout.split() == ["root", "/root", "/root"], r.stdout
    plain.files.write("/tmp/by-default", "x")
    assert plain.files.get_info("/tmp/by-default").owner == "root"
    e = raises(InvalidArgumentException, plain.commands.run, "true", user="user")
    assert "not in the sandbox's /etc/passwd" in str(e), e
finally:
    plain.kill()
step("a connect to a running sandbox never shortens its deadline, only extends it")
lasting = Sandbox.create(template="plain", timeout=600)
try:
    before = lasting.get_info().end_at
    Sandbox.connect(lasting.sandbox_id, timeout=30)
    kept = lasting.get_info().end_at
    assert kept >= before, (before, kept)
    Sandbox.connect(lasting.sandbox_id, timeout=1200)
    extended = lasting.get_info().end_at
    assert (extended - before).total_seconds() > 500, (before, extended)
finally:
    lasting.kill()
nobody = Sandbox.create(template="plain-nobody")
try:
    r = nobody.commands.run("id -un; pwd")
    assert r.stdout.split() == ["nobody", "/tmp"], r.stdout
    assert nobody.commands.run("id -un", user="root").stdout.strip() == "root"
finally:
    nobody.kill()

step("a background command, listed, then killed")
h = sbx.commands.run("sleep 300", background=True)
assert any(p.pid == h.pid and "sleep 300" in " ".join(p.args) for p in sbx.commands.list())
assert h.kill()
e = raises(CommandExitException, h.wait)
assert e.exit_code != 0
assert all(p.pid != h.pid for p in sbx.commands.list())
assert not sbx.commands.kill(h.pid), "killing a gone process is False"

step("stdin to a command, then closed")
h = sbx.commands.run("cat; echo done", background=True, stdin=True)
sbx.commands.send_stdin(h.pid, "piped\n")
sbx.commands.close_stdin(h.pid)
r = h.wait()
assert r.stdout == "piped\ndone\n", r.stdout

step("stdin streamed (a client stream)")
h = sbx.commands.run("cat", background=True, stdin=True)
sbx.commands.stream_input(h.pid, ["one ", b"two ", "three"])
sbx.commands.close_stdin(h.pid)
assert h.wait().stdout == "one two three"

step("output streamed as it comes, and a reconnect to a running command")
seen = []
h = sbx.commands.run("echo first; sleep 1; echo second", background=True)
h2 = sbx.commands.connect(h.pid)
r = h2.wait(on_stdout=seen.append)
assert "second" in "".join(seen), seen

step("a pty session")
chunks = []
pty = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.resize(pty.pid, PtySize(rows=40, cols=100))
sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7)); exit\n")
pty.wait(on_pty=chunks.append)
out = b"".join(chunks)
assert b"pty-42" in out and b"40 100" in out, out

step("files: write, read, owner, relative paths")
w = sbx.files.write("/home/user/a.txt", "alpha")
assert w.path == "/home/user/a.txt" and w.name == "a.txt", w
assert sbx.files.read("/home/user/a.txt") == "alpha"
assert sbx.commands.run("stat -c %U:%G /home/user/a.txt").stdout.strip() == "user:user"
sbx.files.write("rel/b.bin", b"\x00beta\xff")
assert bytes(sbx.files.read("/home/user/rel/b.bin", format="bytes")) == b"\x00beta\xff"
sbx.files.write_files([{"path": "/home/user/m1.txt", "data": "one"}, {"path": "/home/user/m2.txt", "data": "two"}])
assert sbx.commands.run("cat /home/user/m1.txt /home/user/m2.txt").stdout == "onetwo"
raises(NotFoundException, sbx.files.read, "/home/user/missing.txt")

step("files: octet-stream, gzip, file-object and streamed uploads")
sbx.files.write("/home/user/o1.bin", b"octet", use_octet_stream=True)
sbx.files.write("/home/user/o2.txt", "zipped " * 1000, gzip=True)
sbx.files.write("/home/user/o3.bin", io.BytesIO(b"from a file object"))
sbx.files.write("/home/user/o4.bin", iter([b"chunk1-", b"chunk2"]))
assert sbx.files.read("/home/user/o1.bin") == "octet"
assert sbx.files.read("/home/user/o2.txt", gzip=True) == "zipped " * 1000
assert sbx.files.read("/home/user/o3.bin") == "from a file object"
assert sbx.files.read("/home/user/o4.bin") == "chunk1-chunk2"

step("files: exists, make_dir, list with depth, get_info")
assert sbx.files.exists("/home/user/rel/b.bin") and not sbx.files.exists("/home/user/nope")
assert sbx.files.make_dir("/home/user/d1/d2")
assert not sbx.files.make_dir("/home/user/d1/d2"), "an existing directory is False"
top = {e.name: e for e in sbx.files.list("/home/user")}
assert {"a.txt", "rel", "d1"} <= set(top), top.keys()
assert top["d1"].type == FileType.DIR and top["a.txt"].type == FileType.FILE and top["a.txt"].size == 5
deep = [e.path for e in sbx.files.list("/home/user", depth=3)]
assert "/home/user/d1/d2" in deep, deep
assert sbx.files.get_info("/home/user/a.txt").owner == "user"

step("files: rename, remove")
sbx.files.rename("/home/user/a.txt", "/home/user/c.txt")
assert not sbx.files.exists("/home/user/a.txt") and sbx.files.read("/home/user/c.txt") == "alpha"
sbx.files.remove("/home/user/d1")
assert not sbx.files.exists("/home/user/d1")
# A path that is not there is removed already (envd's os.RemoveAll).
sbx.files.remove("/home/user/d1")
sbx.files.remove("/home/user/no/such/dir")

step("files: symlinks reported as symlinks, with their target")
sbx.commands.run("ln -sfn c.txt /home/user/link")
link = sbx.files.get_info("/home/user/link")
assert link.type == FileType.SYMLINK and link.symlink_target == "c.txt", link
assert {e.name: e for e in sbx.files.list("/home/user")}["link"].type == FileType.SYMLINK
sbx.files.remove("/home/user/link")
assert sbx.files.exists("/home/user/c.txt"), "removing a link leaves its target"

step("files: user metadata kept as user.e2b.* xattrs, through get_info, list and rename")
meta = {"owner": "alice", "build": "7"}
w = sbx.files.write("/home/user/meta.txt", "m", metadata={"Owner": "alice", "build": "7"})
assert w.metadata == meta, w.metadata
assert sbx.files.get_info("/home/user/meta.txt").metadata == meta
assert {e.name: e for e in sbx.files.list("/home/user")}["meta.txt"].metadata == meta
moved = sbx.files.rename("/home/user/meta.txt", "/home/user/meta2.txt")
assert moved.metadata == meta, moved
assert sbx.files.get_info("/home/user/c.txt").metadata is None
many = sbx.files.write_files(
    [{"path": "/home/user/m1.txt", "data": "1"}, {"path": "/home/user/m2.txt", "data": "2"}], metadata={"batch": "b1"}
)
assert [x.metadata for x in many] == [{"batch": "b1"}, {"batch": "b1"}], many
assert sbx.files.get_info("/home/user/m2.txt").metadata == {"batch": "b1"}
raw = urllib.request.Request(
    f"{API}/files?path=/home/user/bad.txt",
    data=b"x",
    method="POST",
    headers={
        "Content-Type": "application/octet-stream",
        "X-Access-Token": sbx._envd_access_token,
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "X-Metadata-k": "tab\there",
    },
)
e = raises(urllib.error.HTTPError, urllib.request.urlopen, raw)
assert e.code == 400, e
assert not sbx.files.exists("/home/user/bad.txt"), "a refused upload writes nothing"
for f in ["meta2.txt", "m1.txt", "m2.txt"]:
    sbx.files.remove(f"/home/user/{f}")

step("files: watch_dir events (a missing directory is NotFound, as envd answers; one made after the watch is followed)")
raises(NotFoundException, sbx.files.watch_dir, "/home/user/not-yet")
wh = sbx.files.watch_dir("/home/user", recursive=True)
sbx.files.write("/home/user/w.txt", "x")
sbx.commands.run("mkdir -p /home/user/wd && sleep 0.2 && touch /home/user/wd/inner && rm /home/user/c.txt")
time.sleep(0.3)
events = wh.get_new_events()
kinds = {(e.name, e.type) for e in events}
assert ("w.txt", FilesystemEventType.CREATE) in kinds, kinds
assert ("c.txt", FilesystemEventType.REMOVE) in kinds, kinds
sbx.commands.run("touch /home/user/wd/later")
time.sleep(0.2)
assert ("wd/later", FilesystemEventType.CREATE) in {(e.name, e.type) for e in wh.get_new_events()}
wh.stop()

step("files: watch_dir with include_entry: each event carries its entry, when the path is there")
we = sbx.files.watch_dir("/home/user", include_entry=True)
sbx.files.write("/home/user/e.txt", "12345")
sbx.commands.run("touch /home/user/gone && rm /home/user/gone")
time.sleep(0.3)
got = we.get_new_events()
made = [e for e in got if e.name == "e.txt" and e.type == FilesystemEventType.CREATE]
assert made and made[0].entry is not None and made[0].entry.size == 5, got
assert made[0].entry.path == "/home/user/e.txt" and made[0].entry.type == FileType.FILE, made[0].entry
assert all(e.entry is None for e in got if e.name == "gone" and e.type == FilesystemEventType.REMOVE), got
we.stop()
sbx.files.remove("/home/user/e.txt")

step("files: watch_dir as a stream (the async SDK's WatchDir)")


async def watch_stream():
    a = await AsyncSandbox.connect(sbx.sandbox_id)
    got = []
    handle = await a.files.watch_dir("/home/user", on_event=got.append, include_entry=True)
    await a.files.write("/home/user/streamed.txt", "s")
    for _ in range(50):
        if any(e.name == "streamed.txt" for e in got):
            break
        await asyncio.sleep(0.1)
    await handle.stop()
    assert ("streamed.txt", FilesystemEventType.CREATE) in {(e.name, e.type) for e in got}, got
    created = next(e for e in got if e.name == "streamed.txt" and e.type == FilesystemEventType.CREATE)
    assert created.entry is not None and created.entry.name == "streamed.txt", created


asyncio.run(watch_stream())

step("nothing reaches outside the sandbox's root")
sbx.commands.run(f"ln -s / /home/user/up; ln -s /proc/1/root /home/user/magic; ln -s ../../../../.. /home/user/dots")
for path in [CANARY, "/../../.." + CANARY, "/home/user/up" + CANARY, "/home/user/dots" + CANARY]:
    raises(NotFoundException, sbx.files.read, path)
raises(Exception, sbx.files.read, "/home/user/magic" + CANARY)
raises(Exception, sbx.files.read, "/proc/self/environ")
sbx.files.write("/home/user/dots" + CANARY + ".written", "inside")
assert sbx.files.read(CANARY + ".written") == "inside"
sbx.commands.run("rm -f /home/user/up /home/user/magic /home/user/dots")

step("file calls act as the user: its permissions, its files")
raises(Exception, sbx.files.write, "/etc/strata-test", "x")
sbx.commands.run("ln -s /etc /home/user/etclink")
raises(Exception, sbx.files.write, "/home/user/etclink/ld.so.preload", "x")
assert not sbx.files.exists("/etc/ld.so.preload")
raises(Exception, sbx.files.read, "/etc/shadow")
sbx.files.write("/etc/strata-test", "x", user="root")
assert sbx.commands.run("stat -c %U /etc/strata-test").stdout.strip() == "root"
assert sbx.files.read("/etc/shadow", user="root")
raises(Exception, sbx.files.remove, "/dev", user="root")
assert sbx.commands.run("test -c /dev/null").exit_code == 0

step("another sandbox, another key: refused")
other = Sandbox.create(metadata={"suite": "strata", "run": RUN, "other": "yes"})
status, body = envd_call(other.sandbox_id, sbx._envd_access_token, "Stat", {"path": "/"})
assert status == 401 and body["code"] == "unauthenticated", (status, body)
status, _ = envd_call(other.sandbox_id, other._envd_access_token, "Stat", {"path": "/"})
assert status == 200, status
status, body = envd_call(None, other._envd_access_token, "Stat", {"path": "/home"}, host=f"49983-{other.sandbox_id}.strata.test")
assert status == 200 and body["entry"]["name"] == "home", (status, body)
status, _ = envd_call(None, sbx._envd_access_token, "Stat", {"path": "/"}, host=f"49983-{other.sandbox_id}.strata.test")
assert status == 401, status
status, _ = envd_call(other.sandbox_id, "", "Stat", {"path": "/"})
assert status == 401, status
raises(NotFoundException, Sandbox.get_info, sbx.sandbox_id, api_key=OTHER_KEY)
assert Sandbox.list(api_key=OTHER_KEY).next_items() == []
assert not Sandbox.kill(sbx.sandbox_id, api_key=OTHER_KEY)

step("list: metadata filter, newest first, order=asc")
mine = Sandbox.list(query=SandboxQuery(metadata={"run": RUN})).next_items()
assert [s.sandbox_id for s in mine] == [other.sandbox_id, sbx.sandbox_id], mine
oldest = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}), order="asc").next_items()
assert [s.sandbox_id for s in oldest] == [sbx.sandbox_id, other.sandbox_id], oldest
only = Sandbox.list(query=SandboxQuery(metadata={"run": RUN, "other": "yes"})).next_items()
assert [s.sandbox_id for s in only] == [other.sandbox_id], only
for bad in ["order=sideways", "limit=0", "startedAfter=yesterday", "state=dead", "nextToken=garbage"]:
    raw = urllib.request.Request(f"{API}/v2/sandboxes?{bad}", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
    e = raises(urllib.error.HTTPError, urllib.request.urlopen, raw)
    assert e.code == 400 and json.loads(e.read())["message"], (bad, e)

step("list: by template and start time")
assert {s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, template="base")).next_items()} == {
    sbx.sandbox_id,
    other.sandbox_id,
}
assert Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, template="nosuch")).next_items() == []
since = other.get_info().started_at
later = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, started_after=since)).next_items()
assert [s.sandbox_id for s in later] == [other.sandbox_id], later

step("list pages by x-next-token, neither repeating nor skipping while sandboxes come and go")
paged = [Sandbox.create(metadata={"run": RUN, "paged": "yes"}) for _ in range(3)]
pager = Sandbox.list(query=SandboxQuery(metadata={"run": RUN, "paged": "yes"}), limit=2)
first = pager.next_items()
assert [s.sandbox_id for s in first] == [paged[2].sandbox_id, paged[1].sandbox_id] and pager.has_next, first
# One made after the first page (it is newer: before the cursor) and
# one of the first page killed.
late = Sandbox.create(metadata={"run": RUN, "paged": "yes"})
paged[2].kill()
second = pager.next_items()
assert [s.sandbox_id for s in second] == [paged[0].sandbox_id] and not pager.has_next, second
for s in paged[:2] + [late]:
    s.kill()

other.kill()

step("get_metrics: E2B's SandboxMetric from the sandbox's cgroup and disk")
sbx.commands.run("head -c 50000000 /dev/urandom | md5sum; dd if=/dev/zero of=/home/user/fill bs=1M count=4")
metrics = sbx.get_metrics()
assert metrics, "no metrics"
m = metrics[-1]
assert m.cpu_count >= 1 and 0 <= m.cpu_used_pct <= 100, m
assert 0 < m.mem_used <= m.mem_total and 0 < m.disk_used <= m.disk_total, m
assert m.timestamp.tzinfo is not None and abs(m.timestamp.timestamp() - time.time()) < 60, m
assert [x.timestamp for x in metrics] == sorted(x.timestamp for x in metrics)
future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
assert sbx.get_metrics(start=future) == []
assert Sandbox.get_metrics(sbx.sandbox_id)
raises(NotFoundException, Sandbox.get_metrics, "i00000000000000000000")
sbx.commands.run("rm /home/user/fill")

step("bad key, unknown sandbox")
raises(AuthenticationException, Sandbox.create, api_key="not-a-key")
raises(NotFoundException, Sandbox.get_info, "i00000000000000000000")
raises(NotFoundException, Sandbox.connect, "i00000000000000000000")

step("pause, then connect: files still there, and a new boot id (a filesystem-only resume boots)")
sbx.files.write("/home/user/keep.txt", "kept")
BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
boot_before = sbx.commands.run(BOOT_ID, user="root").stdout.strip()
assert len(boot_before) == 36 and boot_before != open("/proc/sys/kernel/random/boot_id").read().strip(), boot_before
e = raises(Exception, sbx.pause, mode="full")
assert "memory snapshots are not supported" in str(e), e
assert sbx.pause()
assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
assert not sbx.pause(), "pausing a paused sandbox is False"
raw = urllib.request.Request(f"{API}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": os.environ["E2B_API_KEY"]})
with urllib.request.urlopen(raw) as r:
    assert json.loads(r.read())["pauseMode"] == "filesystem", "a pause keeps files, not processes"
assert Sandbox.get_info(sbx.sandbox_id).lifecycle["on_timeout"] == "kill"
assert Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()[0].sandbox_id == sbx.sandbox_id
sbx.connect()
assert sbx.get_info().state.value == "running"
assert sbx.files.read("/home/user/keep.txt") == "kept"
assert sbx.commands.run("echo back").stdout == "back\n"
assert has_secret(sbx), "the resume lost the secret envVar"
boot_after = sbx.commands.run(BOOT_ID, user="root").stdout.strip()
assert len(boot_after) == 36 and boot_after != boot_before, (boot_before, boot_after)

step("a snapshot, then a new sandbox from it")
snap = sbx.create_snapshot()
assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
named = sbx.create_snapshot(name=f"kept-{RUN}")
assert [s.snapshot_id for s in Sandbox.list_snapshots(name=f"kept-{RUN}").next_items()] == [named.snapshot_id]
assert Sandbox.list_snapshots(name=f"nosuch-{RUN}").next_items() == []
snaps = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
assert [s.snapshot_id for s in snaps.next_items()] == [named.snapshot_id] and snaps.has_next, "newest first"
assert [s.snapshot_id for s in snaps.next_items()] == [snap.snapshot_id] and not snaps.has_next
assert Sandbox.delete_snapshot(named.snapshot_id)
child = Sandbox.create(template=snap.snapshot_id)
assert child.files.read("/home/user/keep.txt") == "kept"
child.kill()

step("fork: new sandboxes from a running one, each with its files")
forks = sbx.fork(count=2)
assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 3
for f in forks:
    assert f.files.read("/home/user/keep.txt") == "kept"
    assert has_secret(f), "a fork lacks its parent's secret envVar"
    f.kill()

step("set_timeout, then expiry: killed, or paused with on_timeout pause")
short = Sandbox.create(timeout=60)
auto = Sandbox.create(timeout=60, lifecycle={"on_timeout": "pause"})
auto.files.write("/home/user/auto.txt", "auto")
short.set_timeout(2)
auto.set_timeout(2)
time.sleep(2)
# Expired within moments (the reaper ticks; a pause seals to disk).
until = time.monotonic() + 10
while not (
    not short.is_running()
    and Sandbox.get_info(auto.sandbox_id).state.value == "paused"
):
    assert time.monotonic() < until, "the two sandboxes never expired"
    time.sleep(0.2)
raises(NotFoundException, Sandbox.get_info, short.sandbox_id)
auto.connect()
assert auto.files.read("/home/user/auto.txt") == "auto"
auto.kill()

step("kill")
sbx.kill()
raises(NotFoundException, Sandbox.get_info, sbx.sandbox_id)
assert not Sandbox.kill(sbx.sandbox_id)
assert Sandbox.delete_snapshot(snap.snapshot_id)

print("ALL E2B SDK CHECKS PASSED", flush=True)
sys.exit(0)
