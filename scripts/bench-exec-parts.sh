#!/usr/bin/env bash
# Where a warm exec's time goes, in parts measured around Strata rather
# than through it (BENCHMARKS.md, "What a warm exec is made of"):
#   - fork+exec+wait of busybox `true`, bare and with the shim child's
#     steps, inside a sandbox (run by `strata exec`) and on the host, with
#     the same busybox binary (tests/bench/exec_parts.c, built static);
#   - a one-byte round trip between two processes over a Unix socket,
#     back to back and after 500 µs idle (what a hop between the client,
#     the daemon and the shim costs at least);
#   - strata-bench's warm exec, host floor and API round trip (GET
#     /v1/version), 20 create cycles first.
#
# usage: sudo scripts/bench-exec-parts.sh [N]     (N default 2000)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
N=${1:-2000}
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-exec-parts.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools gcc umoci
build_release
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /tmp/strata-exec-parts.XXXXXX)
DAEMON_PID=
cleanup() {
	stop_daemon "$WORK/strata.sock" "$DAEMON_PID"
	rm -rf "$WORK"
}
trap cleanup EXIT

gcc -O2 -Wall -static -o "$WORK/exec_parts" tests/bench/exec_parts.c
umoci unpack --image images/out/busybox:latest "$WORK/bundle" >/dev/null
ROOTFS=$WORK/bundle/rootfs
start_daemon "$WORK/strata.sock" "$WORK/root" strata-exec-parts "$WORK/daemon.log"
export STRATA_SOCKET=$WORK/strata.sock
"$STRATA" image import images/out/busybox --name busybox >/dev/null
id=$("$STRATA" create --image busybox)
"$STRATA" cp "$WORK/exec_parts" "$id:/exec_parts" >/dev/null

echo "== fork+exec+wait of busybox true, $N of each kind, ten at a time in turn"
echo "-- inside a sandbox"
"$STRATA" exec "$id" -- /exec_parts spawn /bin/busybox "$N"
echo "-- on the host"
"$WORK/exec_parts" spawn "$ROOTFS/bin/busybox" "$N"
"$STRATA" rm "$id" >/dev/null
echo "== two processes, one byte there and back, $N times"
"$WORK/exec_parts" pingpong "$N" 0
"$WORK/exec_parts" pingpong "$N" 500
echo "== strata-bench (median, p90, min in ms)"
"$BIN/strata-bench" "$STRATA_SOCKET" busybox 20 "$ROOTFS/bin/busybox" |
	grep -E '^(api_warm_exec|host_fork_exec|api_round_trip) '
