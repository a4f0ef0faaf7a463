#!/usr/bin/env bash
# Benchmarks Strata against runc, crun and bubblewrap on the same busybox
# rootfs, in one run, and prints a Markdown table of medians.
#
# usage: sudo scripts/bench.sh [RUNS]        (RUNS >= 30, default 50)
#
# Measured (median / p90 over RUNS, after warm-up):
#   - Strata create -> exec `true` -> rm through the API on one kept-alive
#     connection (strata-bench; no CLI start-up in the loop), with phases;
#   - the same through the CLI (three `strata` processes per run), also
#     with --userns and with --disk 1g;
#   - `runc run`, `crun run` and `bwrap --unshare-all` of /bin/true;
#   - exec of `true` in an already running sandbox, and fork+exec+wait of
#     busybox `true` on the host (the floor), ten of each in turn, so both
#     see the machine at the same speed;
#   - the machine's CPU per start, Strata's API cycle and bwrap's
#     (strata-bench --cpu, --cpu-spawn).
# crun 1.8 refuses this host's hybrid cgroup layout (hugetlb on v2), so it runs
# in a private mount namespace with a tmpfs over /sys/fs/cgroup/unified.
# runc and crun get cgroups under /strata-bench/, removed at the end.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
RUNS=${1:-50}
[[ $RUNS -ge 30 ]] || { echo "RUNS must be >= 30" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench.sh" >&2; exit 1; }
for tool in runc crun bwrap hyperfine umoci python3; do
	command -v "$tool" >/dev/null || { echo "$tool missing: run scripts/install-deps.sh" >&2; exit 1; }
done
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi

echo "==> building (release) and images" >&2
cargo build --release --workspace >&2
scripts/build-shim.sh release
images/build-all.sh images/out >&2
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

WORK=$(mktemp -d /tmp/strata-bench.XXXXXX)
DAEMON_PID=
cleanup() {
	stop_daemon "$WORK/strata.sock" "$DAEMON_PID"
	runc delete -f strata-bench-runc >/dev/null 2>&1 || true
	crun delete -f strata-bench-crun >/dev/null 2>&1 || true
	# Children first, then the parents; only cgroups named strata-bench.
	for d in /sys/fs/cgroup/*/strata-bench /sys/fs/cgroup/strata-bench; do
		[[ -d $d ]] || continue
		find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
	done
	cat "$WORK/cli.err" 2>/dev/null >&2 || true
	rm -rf "$WORK"
}
trap cleanup EXIT

# One busybox rootfs for every runtime.
umoci unpack --image images/out/busybox:latest "$WORK/bundle" >/dev/null
ROOTFS=$WORK/bundle/rootfs
make_bundle() { # name
	local b=$WORK/$1
	mkdir -p "$b"
	(cd "$b" && runc spec)
	python3 - "$b/config.json" "$1" "$ROOTFS" <<'PY'
import json, sys
path, name = sys.argv[1], sys.argv[2]
c = json.load(open(path))
c["process"]["terminal"] = False
c["process"]["args"] = ["/bin/true"]
c["root"] = {"path": sys.argv[3], "readonly": True}
c["linux"]["cgroupsPath"] = f"/strata-bench/{name}"
json.dump(c, open(path, "w"), indent=1)
PY
}
make_bundle runc
make_bundle crun

echo "==> strata daemon" >&2
SOCK=$WORK/strata.sock
start_daemon "$SOCK" "$WORK/root" strata-bench "$WORK/daemon.log"
export STRATA_SOCKET=$SOCK
"$BIN/strata" image import images/out/busybox --name busybox >/dev/null

RESULTS=$WORK/results.txt
: >"$RESULTS"
echo "==> strata API ($RUNS runs)" >&2
"$BIN/strata-bench" "$SOCK" busybox "$RUNS" "$ROOTFS/bin/busybox" | tee -a "$RESULTS" >&2
echo "==> strata API, open loop: 20 creates a second ($((RUNS * 2)) in all)" >&2
"$BIN/strata-bench" --open-loop "$SOCK" busybox 20 $((RUNS * 2)) "" | tee -a "$RESULTS" >&2

# The same with a ready pool of 4 (a second daemon on the same store).
stop_daemon "$SOCK" "$DAEMON_PID"
start_daemon "$SOCK" "$WORK/root" strata-bench "$WORK/daemon-pool.log" --pool busybox=4
for _ in $(seq 200); do
	[[ $("$BIN/strata" info | python3 -c 'import json,sys; print(json.load(sys.stdin)["ready"].get("busybox:latest", 0))') == 4 ]] && break
	sleep 0.05
done
echo "==> strata API with --pool busybox=4 ($RUNS runs)" >&2
"$BIN/strata-bench" "$SOCK" busybox "$RUNS" "$ROOTFS/bin/busybox" pool_ | tee -a "$RESULTS" >&2
echo "==> strata API with --pool busybox=4, open loop: 20 creates a second" >&2
"$BIN/strata-bench" --open-loop "$SOCK" busybox 20 $((RUNS * 2)) pool_ | tee -a "$RESULTS" >&2
hits=$(grep -c 'from the ready pool' "$WORK/daemon-pool.log" || true)
echo "from the ready pool: $hits creates" >&2
echo "pool_hits $hits 0 0" >>"$RESULTS"
stop_daemon "$SOCK" "$DAEMON_PID"
start_daemon "$SOCK" "$WORK/root" strata-bench "$WORK/daemon.log"

hf() { # name, hyperfine args...
	local name=$1
	shift
	echo "==> $name ($RUNS runs)" >&2
	hyperfine --runs "$RUNS" --warmup 3 --export-json "$WORK/$name.json" --style basic "$@" >&2
	python3 - "$WORK/$name.json" "$name" >>"$RESULTS" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["results"][0]["times"]
r.sort()
pct = lambda p: r[round((len(r) - 1) * p)] * 1000
print(f"{sys.argv[2]} {pct(0.5):.3f} {pct(0.9):.3f} {r[0]*1000:.3f}")
PY
}

hf cli_create_exec_rm "sh -c 'id=\$($BIN/strata create --image busybox) && $BIN/strata exec \$id -- true && $BIN/strata rm \$id >/dev/null' 2>>$WORK/cli.err"
# The opt-in confinements: a user namespace (idmapped root built by the
# daemon) and a disk cap (mkfs + loop device); both skip the warm pool.
hf cli_userns "sh -c 'id=\$($BIN/strata create --image busybox --userns) && $BIN/strata exec \$id -- true && $BIN/strata rm \$id >/dev/null' 2>>$WORK/cli.err"
hf cli_disk "sh -c 'id=\$($BIN/strata create --image busybox --disk 1g) && $BIN/strata exec \$id -- true && $BIN/strata rm \$id >/dev/null' 2>>$WORK/cli.err"
hf runc_run -N --prepare "runc delete -f strata-bench-runc" "runc run -b $WORK/runc strata-bench-runc"
hf bwrap_unshare_all -N "bwrap --unshare-all --ro-bind $ROOTFS / --proc /proc --dev /dev /bin/true"
# What a start costs the whole machine in CPU (daemon, shims, kernel
# threads), without the client's own: back to back on a small host, this
# bounds the wall time.
echo "==> CPU per start: strata API and bwrap ($((RUNS * 4)) runs each)" >&2
cpu_strata=$("$BIN/strata-bench" --cpu "$SOCK" busybox $((RUNS * 4)))
cpu_bwrap=$("$BIN/strata-bench" --cpu-spawn $((RUNS * 4)) \
	bwrap --unshare-all --ro-bind "$ROOTFS" / --proc /proc --dev /dev /bin/true)
echo "cpu_api_create_exec_rm $cpu_strata 0 0" >>"$RESULTS"
echo "cpu_bwrap_unshare_all $cpu_bwrap 0 0" >>"$RESULTS"
# crun in a private mount namespace where cgroup2 at .../unified is hidden.
export -f hf
export RUNS WORK RESULTS
unshare -m bash -c "mount -t tmpfs none /sys/fs/cgroup/unified && hf crun_run -N --prepare 'crun delete -f strata-bench-crun' 'crun run -b $WORK/crun strata-bench-crun'"

# Markdown table.
python3 - "$RESULTS" "$RUNS" <<'PY'
import sys
rows = {l.split()[0]: list(map(float, l.split()[1:])) for l in open(sys.argv[1]) if l.strip()}
runs = sys.argv[2]
labels = [
    ("api_create_exec_rm", "Strata API: create -> exec true -> rm (one connection)"),
    ("api_create", "  of which create"),
    ("api_exec_first", "  of which first exec"),
    ("api_rm", "  of which rm"),
    ("cli_create_exec_rm", "Strata CLI: create; exec true; rm (3 processes + sh)"),
    ("cli_userns", "  the same with --userns (cold shim, idmapped root)"),
    ("cli_disk", "  the same with --disk 1g (cold shim, mkfs + loop device)"),
    ("bwrap_unshare_all", "bwrap --unshare-all /bin/true"),
    ("crun_run", "crun run /bin/true"),
    ("runc_run", "runc run /bin/true"),
    ("api_warm_exec", "Strata API: exec true in a running sandbox"),
    ("host_fork_exec", "host fork+exec+wait of busybox true, in turn with it (floor)"),
    ("pool_api_create_exec_rm", "with --pool busybox=4: API create -> exec true -> rm"),
    ("pool_api_create", "  of which create"),
    ("pool_api_exec_first", "  of which first exec"),
    ("pool_api_rm", "  of which rm"),
    ("pool_api_warm_exec", "  exec true in a running sandbox"),
    ("pool_host_fork_exec", "  host fork+exec+wait of busybox true, in turn with it (floor)"),
]
print(f"| measurement ({runs} runs) | median ms | p90 ms | min ms |")
print("|---|---:|---:|---:|")
for k, label in labels:
    if k in rows:
        m, p, lo = rows[k]
        print(f"| {label} | {m:.2f} | {p:.2f} | {lo:.2f} |")
r = lambda a, b: rows[a][0] / rows[b][0]
print()
print("Open loop: create -> exec true -> rm started 20 a second, each on its own connection, timed from when it was due:")
print()
print("| open loop | p50 ms | p90 ms | p99 ms |")
print("|---|---:|---:|---:|")
for k, label in [("open_create_exec_rm", "no ready pool (warm shims: 2)"), ("pool_open_create_exec_rm", "--pool busybox=4")]:
    if k in rows:
        a, b, c = rows[k]
        print(f"| {label} | {a:.2f} | {b:.2f} | {c:.2f} |")
if "pool_hits" in rows:
    print()
    print(f"Creates served from the ready pool: {int(rows['pool_hits'][0])}")
if "cpu_api_create_exec_rm" in rows:
    print()
    print("CPU per start, the whole machine's (/proc/stat: every process and kernel thread), the client's own excluded:")
    print()
    print("| CPU per start | ms |")
    print("|---|---:|")
    print(f"| Strata API: create -> exec true -> rm (warm shims: 2) | {rows['cpu_api_create_exec_rm'][0]:.2f} |")
    print(f"| bwrap --unshare-all /bin/true | {rows['cpu_bwrap_unshare_all'][0]:.2f} |")
print()
print(f"Ratios: API create->exec->rm / bwrap = {r('api_create_exec_rm', 'bwrap_unshare_all'):.2f} (target <= 1); "
      f"warm exec / host floor = {r('api_warm_exec', 'host_fork_exec'):.2f} (target <= 1.5); "
      f"crun / bwrap = {r('crun_run', 'bwrap_unshare_all'):.2f}; runc / bwrap = {r('runc_run', 'bwrap_unshare_all'):.2f}")
if "pool_api_create_exec_rm" in rows:
    print(f"With the ready pool: API create->exec->rm / bwrap = {r('pool_api_create_exec_rm', 'bwrap_unshare_all'):.2f}; "
          f"warm exec / host floor = {r('pool_api_warm_exec', 'pool_host_fork_exec'):.2f}")
PY
