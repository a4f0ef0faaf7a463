"""E2B's network options through the real SDK, run by tests/network.rs
inside its own network world (the daemon's namespace; 198.18.1.1 and
198.18.2.1 are the world's internet servers, answering "hello from IP" on
port 80; allowed.test resolves to 198.18.1.1). Nothing here reaches an
address outside the machine."""

import json
import os
import socket
import sys

from e2b import ALL_TRAFFIC, CommandExitException, Sandbox, SandboxNetworkOpts

ALLOWED, DENIED, METADATA = "198.18.1.1", "198.18.2.1", "169.254.169.254"
API = os.environ["E2B_API_URL"]
BUSYBOX = os.environ["STRATA_BUSYBOX"]
HOST, PORT = API.removeprefix("http://").split(":")


def step(name):
    print(f"--- {name}", flush=True)


def fetch(sbx, target):
    """What the sandbox reads over TCP from target:80 (bash's /dev/tcp), or None."""
    cmd = f"timeout 5 bash -c 'exec 3<>/dev/tcp/{target}/80 && cat <&3'"
    try:
        return sbx.commands.run(cmd, timeout=20).stdout.strip()
    except CommandExitException:
        return None


def reaches(sbx, target, ip=None):
    got = fetch(sbx, target)
    assert got == f"hello from {ip or target}", f"{target}: {got!r}"


def blocked(sbx, target):
    got = fetch(sbx, target)
    assert got is None, f"{target} reached: {got!r}"


def raw(host, path="/", headers=None, body=b""):
    """One HTTP/1.1 request to the listener with `Host: host`; (status, head, body)."""
    s = socket.create_connection((HOST, int(PORT)), timeout=10)
    head = [f"GET {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    top, _, rest = data.partition(b"\r\n\r\n")
    return int(top.split()[1]), top.decode(), rest


step("E2B's default: internet access on, the always-denied still shut")
sbx = Sandbox.create("base")
reaches(sbx, ALLOWED)
reaches(sbx, DENIED)
blocked(sbx, METADATA)
sbx.kill()

step("allow_internet_access=False: nothing out")
sbx = Sandbox.create("base", allow_internet_access=False)
blocked(sbx, ALLOWED)
blocked(sbx, DENIED)
sbx.kill()

step("network=SandboxNetworkOpts(...): allowed over denied, domains, a live update")
opts = SandboxNetworkOpts(allow_out=[ALLOWED, "allowed.test"], deny_out=[ALL_TRAFFIC])
sbx = Sandbox.create("base", network=opts)
reaches(sbx, ALLOWED)
blocked(sbx, DENIED)
reaches(sbx, "allowed.test", ALLOWED)
sbx.update_network({"allow_out": [DENIED], "deny_out": [ALL_TRAFFIC]})
reaches(sbx, DENIED)
blocked(sbx, ALLOWED)
sbx.update_network({"allow_internet_access": False})
blocked(sbx, DENIED)
sbx.update_network({})
reaches(sbx, ALLOWED)
sbx.kill()

step("what is not served is a clear error naming the field")
for field, network in [
    ("egressProxy", {"egress_proxy": {"address": "proxy.test:1080"}}),
    ("maskRequestHost", {"mask_request_host": "${PORT}-x.strata.test"}),
]:
    try:
        Sandbox.create("base", network=network)
    except Exception as e:  # the SDK's exception for a 400
        assert field in str(e), (field, str(e))
    else:
        raise AssertionError(f"{field} was accepted")

step("ports in through get_host(port): public, and with a traffic access token")
public = Sandbox.create("base")
private = Sandbox.create("base", network={"allow_public_traffic": False})
assert public.traffic_access_token is None
assert private.traffic_access_token, "a private sandbox has a traffic access token"
with open(BUSYBOX, "rb") as f:
    busybox = f.read()
# An upgrade: 101, then whatever comes back echoed (WebSocket's shape).
upgrader = "#!/tmp/busybox sh\nwhile read -r l && [ \"${l%$(printf '\\r')}\" ]; do :; done\nprintf 'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n\\r\\n'\nexec /tmp/busybox cat\n"
for sbx, name in [(public, "public"), (private, "private")]:
    sbx.files.write("/tmp/busybox", busybox)
    sbx.files.write("/tmp/www/index.html", f"served by {name}\n")
    sbx.files.write("/tmp/upgrade.sh", upgrader)
    sbx.commands.run("chmod +x /tmp/busybox /tmp/upgrade.sh && /tmp/busybox httpd -p 8000 -h /tmp/www")
    sbx.commands.run("/tmp/busybox nc -ll -p 8001 -e /tmp/upgrade.sh", background=True)

status, _, body = raw(public.get_host(8000), "/index.html")
assert status == 200 and body == b"served by public\n", (status, body)
status, _, body = raw(private.get_host(8000), "/index.html")
assert status == 403 and b"e2b-traffic-access-token" in body, (status, body)
status, _, _ = raw(private.get_host(8000), "/index.html", {"e2b-traffic-access-token": "wrong"})
assert status == 403, status
token = {"e2b-traffic-access-token": private.traffic_access_token}
status, _, body = raw(private.get_host(8000), "/index.html", token)
assert status == 200 and body == b"served by private\n", (status, body)
status, _, body = raw(public.get_host(8002))
assert status == 502 and b"not open" in body, (status, body)
status, _, _ = raw(f"8000-nosuch.strata.test")
assert status == 502, status

# The upgraded connection carries bytes both ways.
s = socket.create_connection((HOST, int(PORT)), timeout=10)
s.sendall(f"GET /ws HTTP/1.1\r\nHost: {public.get_host(8001)}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n".encode())
head = b""
while b"\r\n\r\n" not in head:
    head += s.recv(1)
assert head.startswith(b"HTTP/1.1 101"), head
s.sendall(b"ping over the upgrade\n")
echo = b""
while not echo.endswith(b"\n"):
    echo += s.recv(100)
assert echo == b"ping over the upgrade\n", echo
s.close()
public.kill()
private.kill()

print("ALL E2B NETWORK CHECKS PASSED", flush=True)
