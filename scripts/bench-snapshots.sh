#!/usr/bin/env bash
# Snapshot benchmarks, one run on this machine: for deltas of 10 MiB and
# 1 GiB, as many small files and as a few large ones, measure
#   - checkpoint: time spent writing the capture ahead, with its pre-copies
#     (the sandbox running; whether the blob made then was used is printed
#     on stderr as blob_ahead),
#     time frozen, time to a finished blob and time to a finished snapshot
#     (layer + blob, synced; both from the start of the call), against
#     `cp -a`, `tar -cf - | zstd -1` and `tar -cf - | gzip -1` of the same
#     upper dir (none of the three syncs, as neither the frozen copy nor the
#     blob does: Strata makes layer and blob durable with one syncfs,
#     counted in the total);
#   - suspend (seal by moving the upper);
#   - resume and fork (count 1) of the snapshot.
# Each case runs REPEAT times (default 3) on a fresh sandbox; the table has
# the median of each column. Before each timed step the machine is brought
# to the same state (`settle`): dirty data synced, caches dropped, the upper
# read back into the page cache, a pause for the VM's free-page reporting.
# Every contender then reads a warm upper and writes into memory the
# hypervisor has reclaimed, which is what costs most on a VM (see
# BENCHMARKS.md), instead of whoever runs first after a large free getting
# cheap pages.
# Prints a Markdown table.
#
# usage: sudo [SIZES="10485760 1073741824"] [SHAPES="small large"] [REPEAT=3] scripts/bench-snapshots.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-snapshots.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools zstd gzip python3 curl
build_release
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /var/tmp/strata-bench-snap.XXXXXX)
SOCK=$WORK/strata.sock
DAEMON_PID=
cleanup() {
	stop_daemon "$SOCK" "$DAEMON_PID"
	rm -rf "$WORK"
}
trap cleanup EXIT

start_daemon "$SOCK" "$WORK/root" strata-bench-snap "$WORK/daemon.log"
export STRATA_SOCKET=$SOCK
S() { "$BIN/strata" "$@"; }
S image import images/out/busybox --name busybox >/dev/null

api() { # METHOD PATH -> body on stdout
	curl -s --unix-socket "$SOCK" -X "$1" "http://strata$2"
}
now() { date +%s.%N; }
secs() { python3 -c "import sys; print(f'{(float(sys.argv[2]) - float(sys.argv[1])) * 1000:.0f}')" "$1" "$2"; }

# fill UPPER SHAPE BYTES: write random files into a sandbox's upper dir (on
# the host side, before the capture: faster than doing it through the shell
# in the sandbox, and the same bytes for every tool).
fill() {
	python3 - "$1" "$2" "$3" <<'PY'
import os, sys
upper, shape, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = os.path.join(upper, "data")
os.makedirs(d, exist_ok=True)
size = 64 * 1024 if shape == "small" else max(total // 4, 1)
n = max(total // size, 1)
for i in range(n):
    sub = os.path.join(d, f"{i // 1000:04d}")
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, f"f{i}"), "wb") as f:
        left = size
        while left:
            # Fresh random bytes throughout: no file repeats another, so
            # no compressor finds matches across files.
            k = min(left, 1 << 20)
            f.write(os.urandom(k))
            left -= k
PY
	sync
}

# settle UPPER: the same starting state for every timed step.
settle() {
	sync
	echo 3 >/proc/sys/vm/drop_caches
	find "$1" -type f -exec cat {} + >/dev/null
	sleep 2
}
info() { python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["info"][sys.argv[1]])' "$1"; }
median() { python3 -c 'import statistics,sys; print("%.0f" % statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }

printf '| delta | shape | checkpoint written ahead ms | checkpoint frozen ms | checkpoint blob ms | checkpoint total ms | cp -a ms | tar\\|zstd -1 ms | tar\\|gzip -1 ms | suspend ms | resume ms | fork ms |\n'
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for size in ${SIZES:-10485760 1073741824}; do
	for shape in ${SHAPES:-small large}; do
		label=$([[ $size -eq 10485760 ]] && echo "10 MiB" || echo "1 GiB")
		declare -A runs=()
		for _ in $(seq "${REPEAT:-3}"); do
			id=$(S create --image busybox)
			upper=$WORK/root/sandboxes/$id/upper
			fill "$upper" "$shape" "$size"

			settle "$upper"
			t0=$(now); cp -a "$upper" "$WORK/cp"; t1=$(now); runs[cp]+=" $(secs "$t0" "$t1")"
			rm -rf "$WORK/cp"
			settle "$upper"
			t0=$(now); tar -cf - -C "$upper" . | zstd -1 -q >"$WORK/z"; t1=$(now); runs[zstd]+=" $(secs "$t0" "$t1")"
			rm -f "$WORK/z"
			settle "$upper"
			t0=$(now); tar -cf - -C "$upper" . | gzip -1 >"$WORK/z"; t1=$(now); runs[gzip]+=" $(secs "$t0" "$t1")"
			rm -f "$WORK/z"

			settle "$upper"
			snap_json=$(api POST "/v1/sandboxes/$id/checkpoint")
			for k in precopy_ms frozen_ms blob_ms total_ms blob_ahead; do runs[$k]+=" $(info "$k" <<<"$snap_json")"; done
			snap=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])' <<<"$snap_json")

			t0=$(now); fid=$(S fork "$snap" --count 1); t1=$(now); runs[fork]+=" $(secs "$t0" "$t1")"
			S rm "$fid" >/dev/null

			t0=$(now); ssnap=$(S suspend "$id"); t1=$(now); runs[suspend]+=" $(secs "$t0" "$t1")"
			# A resume continues the lineage, which only one live sandbox
			# works in: the checkpoint's, once the suspend released it.
			t0=$(now); rid=$(S resume "$snap"); t1=$(now); runs[resume]+=" $(secs "$t0" "$t1")"
			S rm "$rid" >/dev/null
			# Wait for the suspended snapshot's blob, then free the disk.
			for _ in $(seq 600); do
				api GET "/v1/snapshots/$ssnap" | grep -q '"sealing":false' && break
				sleep 0.1
			done
			S lineage retire "$(api GET "/v1/snapshots/$ssnap" | python3 -c 'import json,sys; print(json.load(sys.stdin)["work_context"])')" >/dev/null
			S snapshot rm "$ssnap" >/dev/null
			S snapshot rm "$snap" >/dev/null
		done
		echo "$label $shape runs: $(for k in "${!runs[@]}"; do printf '%s:%s; ' "$k" "${runs[$k]}"; done)" >&2
		# shellcheck disable=SC2086 # each entry is a list of numbers
		printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$label" \
			"$([[ $shape == small ]] && echo 'many 64 KiB files' || echo '4 large files')" \
			"$(median ${runs[precopy_ms]})" "$(median ${runs[frozen_ms]})" "$(median ${runs[blob_ms]})" "$(median ${runs[total_ms]})" \
			"$(median ${runs[cp]})" "$(median ${runs[zstd]})" "$(median ${runs[gzip]})" \
			"$(median ${runs[suspend]})" "$(median ${runs[resume]})" "$(median ${runs[fork]})"
		unset runs
	done
done
