"""A 1 GiB file through the unmodified E2B Python SDK: up (octet-stream
and multipart), checked inside the sandbox, down as a stream; then a file
larger than what is left of the sandbox's disk: NotEnoughSpace (envd's
507) and nothing left of it.

Run by tests/e2b.rs against a daemon in a 256 MiB memory cgroup whose E2B
sandboxes have a 1200 MiB disk (`--e2b-disk`); E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY and STRATA_WORK (a scratch directory) set.
"""

import hashlib
import os
import tempfile

from e2b import NotEnoughSpaceException, Sandbox

MIB = 1 << 20
SIZE_MIB = 1024


def step(name):
    print(f"--- {name}", flush=True)


def make_file(path, mib):
    """`mib` MiB of numbered random blocks (a block out of place changes
    the digest); its sha256."""
    block = os.urandom(MIB)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for i in range(mib):
            b = i.to_bytes(8, "big") + block[8:]
            h.update(b)
            f.write(b)
    return h.hexdigest()


work = os.environ["STRATA_WORK"]
src = os.path.join(work, "big.bin")
digest = make_file(src, SIZE_MIB)
sbx = Sandbox.create("base", timeout=600)
try:
    for mode, octet in [("octet-stream", True), ("multipart", False)]:
        step(f"1 GiB up as {mode}, checked inside")
        with open(src, "rb") as f:
            sbx.files.write("/home/user/big.bin", f, use_octet_stream=octet, request_timeout=600)
        r = sbx.commands.run("sha256sum /home/user/big.bin", timeout=300, request_timeout=300)
        assert r.stdout.split()[0] == digest, (mode, r.stdout)

    step("1 GiB down as a stream")
    h, n = hashlib.sha256(), 0
    for chunk in sbx.files.read("/home/user/big.bin", format="stream", request_timeout=600):
        h.update(chunk)
        n += len(chunk)
    assert (n, h.hexdigest()) == (SIZE_MIB * MIB, digest), n

    step("past the sandbox's disk: NotEnoughSpace, the new file gone, the old one whole")
    with open(src, "rb") as f:
        try:
            sbx.files.write("/home/user/more.bin", f, request_timeout=600)
        except NotEnoughSpaceException as e:
            print(f"refused: {e}", flush=True)
        else:
            raise AssertionError("a write past the disk succeeded")
    assert not sbx.files.exists("/home/user/more.bin"), "a failed upload left its file"

    step("a refused path: the client still gets the answer, not a broken pipe")
    with open(src, "rb") as f:
        try:
            sbx.files.write("/proc/1/big.bin", f, request_timeout=600)
        except Exception as e:
            # envd's answer (an E2B exception), not the transport's.
            assert "Broken pipe" not in str(e) and "WriteError" not in type(e).__name__, repr(e)
            print(f"refused: {type(e).__name__}: {e}", flush=True)
        else:
            raise AssertionError("a write under /proc succeeded")
    assert sbx.files.get_info("/home/user/big.bin").size == SIZE_MIB * MIB
    assert sbx.commands.run("echo ok").stdout == "ok\n"
finally:
    sbx.kill()
print("LARGE FILES PASSED")
