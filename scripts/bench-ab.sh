#!/usr/bin/env bash
# Warm exec of two builds side by side: a daemon of OTHER_TREE's release
# build (A) and one of this tree's (B), one client alternating requests
# between them (strata-bench --ab), so that the machine's drift hits both
# alike. Prints, per build: p50 and mean ms, the daemon's and the shim's
# (with its commands) CPU per exec in µs.
#
# With `cycle`, each request is a create -> exec `true` -> rm instead, with
# an untimed 10 ms pause after it for its teardown; the daemon's CPU then
# includes the shims it reaped, and the shim column means nothing.
#
# usage: sudo scripts/bench-ab.sh OTHER_TREE [COUNT] [cycle]   (COUNT default 5000)
# OTHER_TREE is a checkout with its release build done, e.g.
#   git worktree add /tmp/strata-old main
#   (cd /tmp/strata-old && cargo build --release && scripts/build-shim.sh release)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $# -ge 1 ]] || { echo "usage: scripts/bench-ab.sh OTHER_TREE [COUNT] [cycle]" >&2; exit 2; }
OTHER=$(cd "$1" && pwd)
COUNT=${2:-5000}
MODE=${3:-}
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-ab.sh" >&2; exit 1; }
[[ -x $OTHER/target/release/strata && -x $OTHER/target/release/strata-shim ]] ||
	{ echo "$OTHER has no release build (cargo build --release && scripts/build-shim.sh release)" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
build_release

WORK=$(mktemp -d /tmp/strata-bench-ab.XXXXXX)
PID_A=''
PID_B=''
cleanup() {
	STRATA=$OTHER/target/release/strata stop_daemon "$WORK/a.sock" "$PID_A"
	STRATA=$REPO_ROOT/target/release/strata stop_daemon "$WORK/b.sock" "$PID_B"
	rm -rf "$WORK"
}
trap cleanup EXIT
for side in a b; do
	if [[ $side == a ]]; then STRATA=$OTHER/target/release/strata; else STRATA=$REPO_ROOT/target/release/strata; fi
	start_daemon "$WORK/$side.sock" "$WORK/root-$side" "strata-bench-$side" "$WORK/daemon-$side.log"
	if [[ $side == a ]]; then PID_A=$DAEMON_PID; else PID_B=$DAEMON_PID; fi
	STRATA_SOCKET=$WORK/$side.sock "$STRATA" image import images/out/busybox --name busybox >/dev/null
done
echo "A = $OTHER ($(git -C "$OTHER" rev-parse --short HEAD 2>/dev/null || echo '?')), B = $REPO_ROOT ($(git rev-parse --short HEAD))" >&2
echo "side p50_ms mean_ms daemon_cpu_us shim_cpu_us"
"$REPO_ROOT/target/release/strata-bench" --ab "$WORK/a.sock" "$WORK/b.sock" busybox "$COUNT" ${MODE:+"$MODE"}
