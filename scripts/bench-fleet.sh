#!/usr/bin/env bash
# Fleet benchmark, one run on this machine: hosts sharing one PostgreSQL
# catalog (a throwaway postgresql-15, Unix socket only) and one registry
# (Debian's docker-registry on 127.0.0.1, plain HTTP).
#
# 1. Resume on host B of a snapshot made on host A: A writes SIZE of random
#    data (10 MiB, then 1 GiB: zstd cannot shrink it) into a sandbox and
#    makes a distributed checkpoint (published to the fleet registry). For
#    each run a new host B (a daemon on an empty root: it holds neither the
#    image nor the snapshot) resumes it; timed around `strata resume`, with
#    the phases B's daemon logs (catalog lookup, manifest, fetch of the
#    blobs, unpack, commit; launch is the rest). Against `skopeo copy` of
#    the same reference from the same registry to a directory (blobs only:
#    skopeo neither checks a diff_id nor unpacks), with an empty blob-info
#    cache of its own each run.
# 2. API create -> exec `true` -> rm (strata-bench, one kept-alive
#    connection) on a daemon whose catalog is SQLite, then on one whose
#    catalog is the PostgreSQL above, same store contents, same run.
#
# usage: sudo [RUNS=3] [BENCH_RUNS=50] scripts/bench-fleet.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-fleet.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools python3 curl skopeo unshare docker-registry runuser busybox
RUNS=${RUNS:-3}
BENCH_RUNS=${BENCH_RUNS:-50}
[[ $RUNS =~ ^[1-9][0-9]*$ && $BENCH_RUNS =~ ^[1-9][0-9]*$ ]] || { echo "RUNS and BENCH_RUNS are positive integers" >&2; exit 1; }

build_release
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /var/tmp/strata-bench-fleet.XXXXXX)
SOCK_A=$WORK/a.sock
PID_A=
SOCK_B=
PID_B=
cleanup() {
	stop_daemon "$SOCK_A" "$PID_A"
	[[ -n $SOCK_B ]] && stop_daemon "$SOCK_B" "$PID_B"
	stop_registry
	stop_postgres
	rm -rf "$WORK"
}
trap cleanup EXIT

start_registry "$WORK"
start_postgres "$WORK"
FLEET=$REG/fleet
# fleet_host NAME SOCKET [args...]: a daemon of the fleet on a fresh root.
fleet_host() {
	local name=$1 sock=$2
	shift 2
	start_daemon "$sock" "$WORK/root-$name" "strata-bench-fleet-$name" "$WORK/$name.log" \
		--database "$PG_URL" --host-id "$name" --registry "$FLEET" --insecure-registry "$@"
}
A() { "$STRATA" --socket "$SOCK_A" "$@"; }
B() { "$STRATA" --socket "$SOCK_B" "$@"; }

fleet_host a "$SOCK_A"
PID_A=$DAEMON_PID
A image import images/out/busybox --name busybox >/dev/null

median() { python3 -c 'import statistics, sys; print("%.0f" % statistics.median(int(x) for x in sys.argv[1:]))' "$@"; }

TABLE=$WORK/table.md
printf '| snapshot | publish on A ms | resume on B ms: total (runs) | catalog | manifest | fetch | unpack | commit | launch | skopeo copy ms (runs) |\n' >"$TABLE"
printf '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n' >>"$TABLE"
for mib in 10 1024; do
	echo "==> $mib MiB of random data on A, checkpointed as distributed" >&2
	ID=$(A create --image busybox)
	A exec "$ID" -- sh -c "head -c $((mib * 1048576)) /dev/urandom >/data.bin"
	t0=$(now)
	SNAP=$(A checkpoint "$ID" --type distributed)
	t1=$(now)
	publish=$(ms "$t0" "$t1")
	A rm "$ID" >/dev/null
	declare -a total=() lookup=() manifest=() fetch=() unpack=() commit=() launch=() sko=()
	for i in $(seq "$RUNS"); do
		name=b-$mib-$i
		SOCK_B=$WORK/$name.sock
		fleet_host "$name" "$SOCK_B"
		PID_B=$DAEMON_PID
		t0=$(now)
		SB=$(B resume "$SNAP" 2>/dev/null)
		t1=$(now)
		t=$(ms "$t0" "$t1")
		# "brought N layer(s) of snapshot S from R (BYTES bytes; catalog X ms,
		# manifest X ms, fetch X ms, unpack X ms, commit X ms)"
		line=$(grep -o "brought .* of snapshot $SNAP .*" "$WORK/$name.log" | tail -1)
		[[ -n $line ]] || { echo "host $name logged no fetch:" >&2; cat "$WORK/$name.log" >&2; exit 1; }
		echo "  run $i: $t ms; $line" >&2
		read -r c m f u k < <(python3 -c '
import re, sys
d = dict(re.findall(r"(catalog|manifest|fetch|unpack|commit) (\d+) ms", sys.argv[1]))
print(d["catalog"], d["manifest"], d["fetch"], d["unpack"], d["commit"])' "$line")
		total+=("$t") lookup+=("$c") manifest+=("$m") fetch+=("$f") unpack+=("$u") commit+=("$k")
		launch+=("$((t - c - m - f - u - k))")
		B rm "$SB" >/dev/null
		stop_daemon "$SOCK_B" "$PID_B"
		SOCK_B=
		rm -rf "$WORK/root-$name"
		t0=$(now)
		skopeo_fresh "$WORK/cache-$name" copy --quiet --src-tls-verify=false \
			"docker://$FLEET:$SNAP" "dir:$WORK/skopeo-$name"
		t1=$(now)
		sko+=("$(ms "$t0" "$t1")")
		echo "  skopeo copy: ${sko[-1]} ms, $(du -sb "$WORK/skopeo-$name" | cut -f1) bytes" >&2
		rm -rf "$WORK/skopeo-$name"
	done
	printf '| %s MiB | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$mib" "$publish" "$(cell "${total[@]}")" \
		"$(median "${lookup[@]}")" "$(median "${manifest[@]}")" "$(median "${fetch[@]}")" "$(median "${unpack[@]}")" \
		"$(median "${commit[@]}")" "$(median "${launch[@]}")" "$(cell "${sko[@]}")" >>"$TABLE"
done

echo "==> create -> exec true -> rm: SQLite catalog, then PostgreSQL ($BENCH_RUNS runs each)" >&2
stop_daemon "$SOCK_A" "$PID_A"
PID_A=
declare -A api
for engine in sqlite postgres; do
	# In SOCK_B/PID_B: stopped by cleanup if anything below fails.
	SOCK_B=$WORK/$engine.sock
	args=()
	[[ $engine == postgres ]] && args=(--database "$(pg_database api)")
	start_daemon "$SOCK_B" "$WORK/root-$engine" "strata-bench-fleet-$engine" "$WORK/$engine.log" "${args[@]}"
	PID_B=$DAEMON_PID
	B image import images/out/busybox --name busybox >/dev/null
	out=$("$BIN/strata-bench" "$SOCK_B" busybox "$BENCH_RUNS" /bin/busybox)
	while read -r line; do echo "  $engine: $line" >&2; done <<<"$out"
	api[$engine]=$(echo "$out" | awk '$1 == "api_create_exec_rm" {print $2 " / " $3}')
	stop_daemon "$SOCK_B" "$PID_B"
	SOCK_B=
done

printf '\nResume on a new host B of a snapshot made on host A (%s runs; medians, ms):\n\n' "$RUNS"
cat "$TABLE"
printf '\nAPI create -> exec true -> rm, median / p90 ms (%s runs each):\n\n' "$BENCH_RUNS"
printf '| catalog | median / p90 ms |\n|---|---:|\n'
printf '| SQLite (ROOT/strata.db) | %s |\n' "${api[sqlite]}"
printf '| PostgreSQL (same machine, Unix socket) | %s |\n' "${api[postgres]}"
