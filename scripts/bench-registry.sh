#!/usr/bin/env bash
# Registry benchmark, one run on this machine: push and pull of a snapshot
# with a 100 MiB delta (4 files of 20 MiB and 2048 files of 10 KiB, all
# random, so zstd cannot shrink it) through a throwaway local registry
# (Debian's docker-registry, distribution 2.8, plain HTTP on 127.0.0.1),
# against `skopeo copy` of the same chain between an OCI layout and the same
# registry. Two daemons stand for two hosts: A checkpoints the sandbox and
# pushes, B pulls. The OCI layout for skopeo is `strata snapshot export` of
# the same snapshot: the snapshot's blob is byte for byte the one Strata
# pushes; the busybox layer under it (about 1 MiB) is serialised again as
# zstd by the export, where the push sends the imported blob.
#
# For i in 1..RUNS, interleaved:
#   - strata push of the snapshot to bench/strata-$i:1 (fresh repository,
#     so every blob is uploaded), from host A;
#   - skopeo copy oci:LAYOUT:latest -> docker://.../bench/skopeo-$i:1;
#   - strata pull of bench/strata-$i:1 on host B, then `snapshot rm` there
#     (and lineage retire first if refused) so the next pull fetches again;
#   - skopeo copy docker://.../bench/skopeo-$i:1 -> oci:<fresh dir>:1.
# Both sides are measured the same way (wall clock around the command, no
# sync, no cache drop). Strata's pull fetches the blobs B lacks (digest
# checked while they arrive), checks the layer's diff_id (decompress and
# hash, no unpack), makes the blob durable and records the snapshot; the
# layer's tree is unpacked in the background (or by the first launch that
# needs it). skopeo writes the blobs. A second Strata row gives the time
# until B's layer is unpacked too (`hydrating` false), which skopeo does
# not do at all.
# skopeo runs as root with its blob-info cache in /var/lib/containers/cache,
# from which it would mount blobs it pushed in an earlier run into the new
# repository instead of uploading them; so each skopeo runs in a private
# mount namespace with an empty cache dir of its own bound there (unshare
# and the bind mount are inside the timing: a few ms).
# Prints a Markdown table (median and all runs, ms); on stderr, per run,
# what was uploaded and fetched, then the parts of a pull done with shell
# tools (curl of the blob, sha256sum, zstd -dc | tar -x, sync) for reading.
#
# usage: sudo [RUNS=3] scripts/bench-registry.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-registry.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools python3 curl skopeo unshare docker-registry zstd
RUNS=${RUNS:-3}
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || { echo "RUNS must be a positive integer" >&2; exit 1; }

build_release
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /var/tmp/strata-bench-reg.XXXXXX)
SOCK_A=$WORK/a.sock
SOCK_B=$WORK/b.sock
PID_A=
PID_B=
REG_PID=
cleanup() {
	stop_daemon "$SOCK_A" "$PID_A"
	stop_daemon "$SOCK_B" "$PID_B"
	stop_registry
	rm -rf "$WORK"
}
trap cleanup EXIT

# ---- the registry ----
start_registry "$WORK"

# ---- two hosts ----
start_daemon "$SOCK_A" "$WORK/root-a" strata-bench-reg-a "$WORK/daemon-a.log"
PID_A=$DAEMON_PID
start_daemon "$SOCK_B" "$WORK/root-b" strata-bench-reg-b "$WORK/daemon-b.log"
PID_B=$DAEMON_PID
A() { "$BIN/strata" --socket "$SOCK_A" "$@"; }
B() { "$BIN/strata" --socket "$SOCK_B" "$@"; }
A image import images/out/busybox --name busybox >/dev/null
B image import images/out/busybox --name busybox >/dev/null

# ---- the snapshot (not timed) ----
echo "==> writing 100 MiB into a sandbox on A and checkpointing it" >&2
ID=$(A create --image busybox)
# shellcheck disable=SC2016 # expanded by the sandbox's shell
A exec "$ID" -- sh -c '
	set -e
	mkdir -p /data/small
	for i in 0 1 2 3; do head -c 20971520 /dev/urandom >/data/large$i; done
	i=0
	while [ $i -lt 2048 ]; do head -c 10240 /dev/urandom >/data/small/f$i; i=$((i + 1)); done'
SNAP=$(A checkpoint "$ID")
A rm "$ID" >/dev/null
A snapshot export "$SNAP" "$WORK/layout" >/dev/null
json() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }
BLOB_SIZE=$(A snapshot inspect "$SNAP" | json '["blob_size"]')
LAYOUT_BYTES=$(du -sb "$WORK/layout/blobs" | cut -f1)
echo "snapshot $SNAP: blob $BLOB_SIZE bytes; OCI layout blobs $LAYOUT_BYTES bytes" >&2
layers_b() { du -sb "$WORK/root-b/layers" | cut -f1; }
LAYERS_B0=$(layers_b)


# ---- the runs ----
declare -a push_s push_k pull_s pull_k hyd_s
for i in $(seq "$RUNS"); do
	echo "==> run $i/$RUNS" >&2
	t0=$(now)
	A snapshot push "$SNAP" "$REG/bench/strata-$i:1" --insecure -q >/dev/null 2>"$WORK/push.err"
	t1=$(now)
	push_s+=("$(ms "$t0" "$t1")")
	echo "  strata push: $(cat "$WORK/push.err")" >&2

	t0=$(now)
	skopeo_fresh "$WORK/cache-push-$i" copy --quiet --dest-tls-verify=false \
		"oci:$WORK/layout:latest" "docker://$REG/bench/skopeo-$i:1"
	t1=$(now)
	push_k+=("$(ms "$t0" "$t1")")

	t0=$(now)
	pulled=$(B snapshot pull "$REG/bench/strata-$i:1" --insecure -q 2>"$WORK/pull.err")
	t1=$(now)
	pull_s+=("$(ms "$t0" "$t1")")
	[[ $pulled == "$SNAP" ]] || { echo "pulled $pulled, expected $SNAP" >&2; exit 1; }
	until [[ $(B snapshot inspect "$SNAP" | json '["hydrating"]') == False ]]; do sleep 0.01; done
	t2=$(now)
	hyd_s+=("$(ms "$t0" "$t2")")
	echo "  strata pull: $(cat "$WORK/pull.err"); B's layers now $(layers_b) bytes" >&2
	if ! B snapshot rm "$SNAP" 2>/dev/null; then
		B lineage retire "$(B snapshot inspect "$SNAP" | json '["work_context"]')" >/dev/null
		B snapshot rm "$SNAP"
	fi
	echo "  B's layers: $LAYERS_B0 bytes before the first pull, $(layers_b) after rm" >&2

	t0=$(now)
	skopeo_fresh "$WORK/cache-pull-$i" copy --quiet --src-tls-verify=false \
		"docker://$REG/bench/skopeo-$i:1" "oci:$WORK/pulled-$i:1"
	t1=$(now)
	pull_k+=("$(ms "$t0" "$t1")")
	echo "  skopeo pull: $(du -sb "$WORK/pulled-$i/blobs" | cut -f1) bytes of blobs" >&2
	rm -rf "$WORK/pulled-$i"
done

# Where a pull's time goes (not in the table): the same work with shell
# tools, on the same bytes: fetch the snapshot's blob, hash it, unpack it.
echo "==> the parts of a pull with shell tools (not in the table)" >&2
BLOB=$(A snapshot inspect "$SNAP" | json '["blob_digest"]')
t0=$(now); curl -s -o "$WORK/blob" "http://$REG/v2/bench/strata-1/blobs/$BLOB"; t1=$(now)
echo "  curl of the snapshot blob: $(ms "$t0" "$t1") ms" >&2
t0=$(now); sha256sum "$WORK/blob" >/dev/null; t1=$(now)
echo "  sha256sum of the blob: $(ms "$t0" "$t1") ms" >&2
mkdir "$WORK/untar"
t0=$(now); zstd -dc "$WORK/blob" | tar -xf - -C "$WORK/untar"; t1=$(now)
echo "  zstd -dc | tar -x of the blob ($(find "$WORK/untar" | wc -l) entries): $(ms "$t0" "$t1") ms" >&2
t0=$(now); sync; t1=$(now)
echo "  then sync: $(ms "$t0" "$t1") ms" >&2

# ---- the table ----
ratio() { # STRATA_MS... -- SKOPEO_MS...
	python3 -c '
import statistics, sys
a = sys.argv[1:]
k = a.index("--")
print(f"{statistics.median(map(int, a[:k])) / statistics.median(map(int, a[k + 1:])):.2f}")' "$@"
}
printf '\n%s runs each; %s bytes of snapshot blob, %s bytes of OCI layout blobs\n\n' "$RUNS" "$BLOB_SIZE" "$LAYOUT_BYTES"
printf '| operation | strata median ms (runs) | skopeo median ms (runs) | strata / skopeo |\n'
printf '|---|---:|---:|---:|\n'
printf '| push (layout/store -> registry) | %s | %s | %s |\n' \
	"$(cell "${push_s[@]}")" "$(cell "${push_k[@]}")" "$(ratio "${push_s[@]}" -- "${push_k[@]}")"
printf '| pull (registry -> store/layout) | %s | %s | %s |\n' \
	"$(cell "${pull_s[@]}")" "$(cell "${pull_k[@]}")" "$(ratio "${pull_s[@]}" -- "${pull_k[@]}")"
printf '| pull, until the layer is unpacked (strata only) | %s | - | %s |\n' \
	"$(cell "${hyd_s[@]}")" "$(ratio "${hyd_s[@]}" -- "${pull_k[@]}")"
