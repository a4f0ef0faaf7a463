#!/usr/bin/env bash
# Snapshot benchmarks, one run on this machine: for deltas of 10 MiB and
# 1 GiB, as many small files and as a few large ones, measure
#   - checkpoint: time frozen, time to a finished blob and time to a finished
#     snapshot (layer + blob, synced), against `cp -a`, `tar -cf - | zstd -1`
#     and `tar -cf - | gzip -1` of the same upper dir (none of the three
#     syncs, as neither the frozen copy nor the blob does: Strata makes layer
#     and blob durable with one syncfs, counted in the total);
#   - suspend (seal by moving the upper);
#   - resume and fork (count 1) of the snapshot.
# Prints a Markdown table.
#
# usage: sudo [SIZES="10485760 1073741824"] [SHAPES="small large"] scripts/bench-snapshots.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-snapshots.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
for tool in zstd gzip python3 curl; do
	command -v "$tool" >/dev/null || { echo "$tool missing: run scripts/install-deps.sh" >&2; exit 1; }
done

echo "==> building (release) and images" >&2
cargo build --release --workspace >&2
images/build-all.sh images/out >&2
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

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
chunk = os.urandom(1 << 20)
for i in range(n):
    sub = os.path.join(d, f"{i // 1000:04d}")
    os.makedirs(sub, exist_ok=True)
    with open(os.path.join(sub, f"f{i}"), "wb") as f:
        left = size
        while left:
            k = min(left, len(chunk))
            f.write(chunk[:k])
            left -= k
PY
	sync
}

printf '| delta | shape | checkpoint frozen ms | checkpoint blob ms | checkpoint total ms | cp -a ms | tar\\|zstd -1 ms | tar\\|gzip -1 ms | suspend ms | resume ms | fork ms |\n'
printf '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for size in ${SIZES:-10485760 1073741824}; do
	for shape in ${SHAPES:-small large}; do
		label=$([[ $size -eq 10485760 ]] && echo "10 MiB" || echo "1 GiB")
		id=$(S create --image busybox)
		upper=$WORK/root/sandboxes/$id/upper
		fill "$upper" "$shape" "$size"
		echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true

		t0=$(now); cp -a "$upper" "$WORK/cp"; t1=$(now); cp_ms=$(secs "$t0" "$t1")
		rm -rf "$WORK/cp"; sync
		t0=$(now); tar -cf - -C "$upper" . | zstd -1 -q >"$WORK/z"; t1=$(now); zstd_ms=$(secs "$t0" "$t1")
		rm -f "$WORK/z"; sync
		t0=$(now); tar -cf - -C "$upper" . | gzip -1 >"$WORK/z"; t1=$(now); gzip_ms=$(secs "$t0" "$t1")
		rm -f "$WORK/z"; sync

		snap_json=$(api POST "/v1/sandboxes/$id/checkpoint")
		frozen=$(python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["info"]["frozen_ms"])' <<<"$snap_json")
		blob=$(python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["info"]["blob_ms"])' <<<"$snap_json")
		total=$(python3 -c 'import json,sys; print("%.0f" % json.load(sys.stdin)["info"]["total_ms"])' <<<"$snap_json")
		snap=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])' <<<"$snap_json")

		t0=$(now); rid=$(S resume "$snap"); t1=$(now); resume_ms=$(secs "$t0" "$t1")
		t0=$(now); fid=$(S fork "$snap" --count 1); t1=$(now); fork_ms=$(secs "$t0" "$t1")
		S rm "$rid" "$fid" >/dev/null

		t0=$(now); ssnap=$(S suspend "$id"); t1=$(now); suspend_ms=$(secs "$t0" "$t1")
		printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$label" \
			"$([[ $shape == small ]] && echo 'many 64 KiB files' || echo '4 large files')" \
			"$frozen" "$blob" "$total" "$cp_ms" "$zstd_ms" "$gzip_ms" "$suspend_ms" "$resume_ms" "$fork_ms"
		# Wait for the suspended snapshot's blob, then free the disk.
		for _ in $(seq 600); do
			api GET "/v1/snapshots/$ssnap" | grep -q '"sealing":false' && break
			sleep 0.1
		done
		S lineage retire "$(api GET "/v1/snapshots/$ssnap" | python3 -c 'import json,sys; print(json.load(sys.stdin)["work_context"])')" >/dev/null
		S snapshot rm "$ssnap" >/dev/null
		S snapshot rm "$snap" >/dev/null
	done
done
