#!/usr/bin/env bash
# Incremental checkpoints against whole captures, one run on this machine.
# A sandbox's upper holds 1 GiB: 16,384 files of 48 KiB and 4 files of
# 64 MiB (random bytes, so compression cannot hide the size). After a
# first checkpoint (pushed to a throwaway loopback registry), for a change
# of 1 KiB, 10 MiB and 100 MiB (a new file of random bytes) it takes
#   - an incremental checkpoint (what changed since the last one), then
#   - a whole capture of the same upper (`strata checkpoint --whole`, what
#     every checkpoint was before incremental ones),
# and reports for each: the time frozen and the time to a finished blob
# (from the snapshot's info), the blob's bytes, and the bytes a push of it
# (after the snapshots before it) added to the registry's storage.
# Prints a Markdown table.
#
# usage: sudo scripts/bench-incremental.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-incremental.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools python3 curl docker-registry
build_release
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /var/tmp/strata-bench-inc.XXXXXX)
SOCK=$WORK/strata.sock
DAEMON_PID=
cleanup() {
	stop_daemon "$SOCK" "$DAEMON_PID"
	stop_registry
	rm -rf "$WORK"
}
trap cleanup EXIT

start_registry "$WORK"
start_daemon "$SOCK" "$WORK/root" strata-bench-inc "$WORK/daemon.log"
S() { "$BIN/strata" --socket "$SOCK" "$@"; }
S image import images/out/busybox --name busybox >/dev/null

api() { # METHOD PATH [BODY] -> body on stdout
	curl -sf --unix-socket "$SOCK" -X "$1" -H 'Content-Type: application/json' -d "${3:-{\}}" "http://strata$2"
}
field() { python3 -c "import json, sys; v = json.load(sys.stdin); print(eval(sys.argv[1]))" "$@"; }
# Bytes of the files the registry stores (its directories not counted).
stored() { find "$WORK/registry" -type f -printf '%s\n' | awk '{n += $1} END {printf "%.0f\n", n}'; }

echo "==> writing 1 GiB into a sandbox" >&2
ID=$(S create --image busybox --memory 2g)
# shellcheck disable=SC2016 # expanded by the sandbox's shell
S exec "$ID" -- sh -c '
	set -e
	mkdir -p /data/small
	for d in $(seq 0 63); do
		mkdir /data/small/$d
		for f in $(seq 0 255); do head -c 49152 /dev/urandom > /data/small/$d/$f; done
	done
	for i in 1 2 3 4; do head -c 67108864 /dev/urandom > /data/large$i; done
' >/dev/null
FIRST=$(api POST "/v1/sandboxes/$ID/checkpoint")
echo "first (whole) checkpoint: $(echo "$FIRST" | field '"%d bytes, frozen %.0f ms" % (v["blob_size"], v["info"]["frozen_ms"])')" >&2
api POST "/v1/snapshots/$(echo "$FIRST" | field 'v["id"]')/push" "{\"reference\": \"$REG/bench/inc:first\", \"insecure\": true}" >/dev/null

row() { # KIND CHANGE SNAPSHOT-JSON PUSHED
	echo "$3" | field "f'| $2 | $1 | {v[\"info\"][\"frozen_ms\"]:.1f} | {v[\"info\"][\"blob_ms\"]:.0f} | {v[\"blob_size\"]:,} | {int(sys.argv[2]):,} |'" "$4"
}

ROWS=()
n=0
for change in 1024 10485760 104857600; do
	n=$((n + 1))
	S exec "$ID" -- sh -c "head -c $change /dev/urandom > /data/change$n" >/dev/null
	# Past the 50 ms in which a change cannot be told from one right after
	# the capture (it would be written again by the next).
	sleep 0.2
	for kind in incremental whole; do
		body='{}'
		[[ $kind == whole ]] && body='{"whole": true}'
		snap=$(api POST "/v1/sandboxes/$ID/checkpoint" "$body")
		before=$(stored)
		api POST "/v1/snapshots/$(echo "$snap" | field 'v["id"]')/push" \
			"{\"reference\": \"$REG/bench/inc:$kind$n\", \"insecure\": true}" >/dev/null
		pushed=$(($(stored) - before))
		label=$(python3 -c "import sys; n = int(sys.argv[1]); print(f'{n // 1048576} MiB' if n >= 1048576 else f'{n // 1024} KiB')" "$change")
		ROWS+=("$(row "$kind" "$label" "$snap" "$pushed")")
	done
done

echo
echo "| change since the last checkpoint | capture | frozen ms | blob ms | blob bytes | pushed bytes |"
echo "| --- | --- | ---: | ---: | ---: | ---: |"
printf '%s\n' "${ROWS[@]}"
