#!/usr/bin/env bash
# `ctr run --rm` of busybox `true` on containerd 1.6, side by side: Strata's
# shim (io.containerd.strata.v2, against a release daemon), runc's shim with
# runc (containerd's default) and with crun. One containerd of the
# script's (a temporary root and socket) serves Strata and runc; crun 1.8
# refuses this host's hybrid cgroup layout (hugetlb on cgroup2), so a second
# one runs it in a private mount namespace with a tmpfs over
# /sys/fs/cgroup/unified (as scripts/bench.sh does). The runtimes take turns
# run by run, so the machine's drift hits all alike. Prints median, p90 and
# min ms of each, and the ratios to runc's shim.
#
# usage: sudo scripts/bench-containerd.sh [RUNS]      (default 30)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
RUNS=${1:-30}
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-containerd.sh" >&2; exit 1; }
for tool in containerd ctr runc crun python3; do
	command -v "$tool" >/dev/null || { echo "$tool missing: run scripts/install-deps.sh" >&2; exit 1; }
done
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
build_release
# shellcheck disable=SC2034 # lib.sh's start_daemon and stop_daemon run it
STRATA=$REPO_ROOT/target/release/strata
BIN=$REPO_ROOT/target/release

WORK=$(mktemp -d /tmp/strata-bench-ctd.XXXXXX)
NS=strata-bench
DAEMON_PID=
CTD_PIDS=()
cleanup() {
	local p
	for p in "${CTD_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${CTD_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
	# Shims of these containerds (their address is a path of ours).
	for p in $(pgrep -f -- "-address $WORK/" || true); do kill -9 "$p" 2>/dev/null || true; done
	stop_daemon "$WORK/strata.sock" "$DAEMON_PID"
	grep -o " $WORK/[^ ]*" /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
	for d in /sys/fs/cgroup/*/"$NS" /sys/fs/cgroup/"$NS"; do
		if [[ -d $d ]]; then find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true; fi
	done
	rm -rf "$WORK"
}
trap cleanup EXIT

start_daemon "$WORK/strata.sock" "$WORK/strata-root" "strata-bench-ctd" "$WORK/daemon.log"

# start_containerd NAME [WRAP...]: a containerd under $WORK/NAME (run by
# WRAP, if given), its CRI plugin off, the Strata shim on its PATH, the
# busybox image imported.
start_containerd() {
	local dir=$WORK/$1
	shift
	mkdir -p "$dir"
	cat >"$dir/config.toml" <<TOML
version = 2
root = "$dir/root"
state = "$dir/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$dir/c.sock"
[ttrpc]
  address = "$dir/c.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$dir/opt"
TOML
	PATH="$BIN:$PATH" STRATA_SOCKET=$WORK/strata.sock "$@" containerd --config "$dir/config.toml" >"$dir/log" 2>&1 &
	CTD_PIDS+=($!)
	for _ in $(seq 200); do
		ctr --address "$dir/c.sock" version >/dev/null 2>&1 && break
		sleep 0.1
	done
	tar -C images/out/busybox -cf "$dir/busybox.tar" .
	ctr --address "$dir/c.sock" -n $NS images import --base-name docker.io/library/busybox "$dir/busybox.tar" >/dev/null
}
start_containerd main
# shellcheck disable=SC2016 # "$0" "$@" are the inner shell's: containerd and its flags
start_containerd crun unshare -m sh -c 'mount -t tmpfs none /sys/fs/cgroup/unified && exec "$0" "$@"'

IMAGE=docker.io/library/busybox:latest
run_once() { # RUNTIME ADDRESS ID [EXTRA...]
	local runtime=$1 address=$2 id=$3
	shift 3
	ctr --address "$address" -n $NS run --rm --runtime "$runtime" "$@" "$IMAGE" "$id" true
}
time_once() { # LABEL RUNTIME ADDRESS ID [EXTRA...]
	local label=$1 t0 t1
	shift
	t0=$(date +%s%N)
	run_once "$@" >/dev/null
	t1=$(date +%s%N)
	echo "$label $(((t1 - t0) / 1000))" >>"$WORK/times"
}

echo "==> warm-up" >&2
for i in 1 2 3; do
	run_once io.containerd.strata.v2 "$WORK/main/c.sock" "w-s$i" >/dev/null
	run_once io.containerd.runc.v2 "$WORK/main/c.sock" "w-r$i" >/dev/null
	run_once io.containerd.runc.v2 "$WORK/crun/c.sock" "w-c$i" --runc-binary /usr/bin/crun >/dev/null
done
echo "==> $RUNS runs of each, in turn" >&2
for i in $(seq "$RUNS"); do
	time_once strata io.containerd.strata.v2 "$WORK/main/c.sock" "s$i"
	time_once runc io.containerd.runc.v2 "$WORK/main/c.sock" "r$i"
	time_once crun io.containerd.runc.v2 "$WORK/crun/c.sock" "c$i" --runc-binary /usr/bin/crun
done

python3 - "$WORK/times" "$RUNS" <<'PY'
import sys
rows = {}
for line in open(sys.argv[1]):
    k, us = line.split()
    rows.setdefault(k, []).append(int(us) / 1000)
def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]
labels = [("strata", "Strata shim (io.containerd.strata.v2)"), ("runc", "runc shim + runc (containerd's default)"), ("crun", "runc shim + crun")]
print(f"| ctr run --rm busybox true ({sys.argv[2]} runs each) | median ms | p90 ms | min ms | median / runc's |")
print("|---|---:|---:|---:|---:|")
base = q(rows["runc"], 0.5)
for k, label in labels:
    v = rows[k]
    print(f"| {label} | {q(v, 0.5):.1f} | {q(v, 0.9):.1f} | {min(v):.1f} | {q(v, 0.5) / base:.2f} |")
PY
