#!/usr/bin/env bash
# Benchmarks sandbox networking in a world of its own (no packet leaves the
# machine): two network namespaces, the daemon in one, the other playing
# the internet (198.18.1.1, a sink server of tests/bench/netb.c), a veth
# between them. Prints a Markdown table.
#
# usage: sudo scripts/bench-network.sh [RUNS]   (RUNS >= 30, default 50)
#
# Measured, in one run:
#   - create -> exec `true` -> rm through the API (strata-bench --net),
#     `network: none` and `egress` in turn, and the create alone;
#   - the kernel's floor: `bwrap --unshare-all` of /bin/true, and the same
#     in a network namespace with a veth, both made by `ip` (netns add,
#     link add, addr, up, route, netns del) per run;
#   - TCP connect latency (200 connects) and throughput (3 s, five rounds
#     taking turns, medians) to the internet's server from an egress
#     sandbox, from the daemon's namespace (the host's side: the same route
#     minus veth, rules and NAT), and from the sandbox's namespace entered
#     by nsenter (the network path without the sandbox's confinement), and
#     from a second egress sandbox whose veth the script puts back on the
#     kernel's default path (`ethtool -K gro off` on its host end: no
#     NAPI, so none threaded), to show what the daemon's fast path gives.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
RUNS=${1:-50}
[[ $RUNS -ge 30 ]] || { echo "RUNS must be >= 30" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-network.sh" >&2; exit 1; }
for tool in bwrap hyperfine umoci gcc nft ip nsenter python3 ethtool; do
	command -v "$tool" >/dev/null || { echo "$tool missing: run scripts/install-deps.sh" >&2; exit 1; }
done
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi

echo "==> building (release) and images" >&2
cargo build --release --workspace >&2
scripts/build-shim.sh release >&2
images/build-all.sh images/out >&2
BIN=$REPO_ROOT/target/release
STRATA=$BIN/strata

WORK=$(mktemp -d /tmp/strata-bench-net.XXXXXX)
H=strata-bench-net-$$-h
I=strata-bench-net-$$-i
SOCK=$WORK/strata.sock
DAEMON_PID='' SINK_PID=''
cleanup() {
	if [[ -n $DAEMON_PID ]]; then
		for id in $(STRATA_SOCKET=$SOCK "$STRATA" ps 2>/dev/null | awk 'NR > 1 {print $1}'); do
			STRATA_SOCKET=$SOCK "$STRATA" rm "$id" >/dev/null 2>&1 || true
		done
		kill -TERM "$DAEMON_PID" 2>/dev/null && wait "$DAEMON_PID" 2>/dev/null || true
	fi
	[[ -n $SINK_PID ]] && kill "$SINK_PID" 2>/dev/null || true
	ip netns del "$H" 2>/dev/null || true
	ip netns del "$I" 2>/dev/null || true
	for d in /sys/fs/cgroup/*/strata-bench-net /sys/fs/cgroup/strata-bench-net; do
		[[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null || true
	done
	umount -R "$WORK/root" 2>/dev/null || true
	[[ -n ${KEEP_LOG:-} ]] && cp "$WORK/daemon.log" "$KEEP_LOG"
	rm -rf "$WORK"
}
trap cleanup EXIT

gcc -static -O2 -o "$WORK/netb" tests/bench/netb.c
umoci unpack --image images/out/busybox:latest "$WORK/bundle" >/dev/null
ROOTFS=$WORK/bundle/rootfs

echo "==> the world: $H (daemon) <-> $I (internet)" >&2
ip netns add "$H"
ip netns add "$I"
ip -n "$H" link set lo up
ip -n "$I" link set lo up
ip -n "$H" link add uplink type veth peer name downlink netns "$I"
ip -n "$H" addr add 198.18.0.1/30 dev uplink
ip -n "$H" link set uplink up
ip -n "$H" route add default via 198.18.0.2
ip -n "$I" addr add 198.18.0.2/30 dev downlink
ip -n "$I" link set downlink up
ip -n "$I" addr add 198.18.1.1/32 dev lo
nsenter --net="/run/netns/$I" "$WORK/netb" serve 5001 &
SINK_PID=$!

STRATA_LOG=${STRATA_LOG:-info} nsenter --net="/run/netns/$H" "$STRATA" --socket "$SOCK" daemon --root "$WORK/root" \
	--cgroup-parent strata-bench-net --dns-upstream 198.18.0.2:53 >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 200); do
	STRATA_SOCKET=$SOCK "$STRATA" ps >/dev/null 2>&1 && break
	sleep 0.05
done
export STRATA_SOCKET=$SOCK
"$STRATA" image import images/out/busybox --name busybox:latest >/dev/null

echo "==> strata-bench --net ($RUNS each)" >&2
declare -A R
while read -r name p50 p90 _; do
	R[$name]="$p50 $p90"
done < <("$BIN/strata-bench" --net "$SOCK" busybox:latest "$RUNS")

echo "==> bwrap, without and with a veth made by ip" >&2
cat >"$WORK/bwrap-veth.sh" <<EOF
set -e
ns=sbv\$\$
ip netns add \$ns
ip link add sbh\$\$ type veth peer name eth0 netns \$ns
ip -n \$ns addr add 10.99.0.1/31 dev eth0
ip -n \$ns link set eth0 up
ip -n \$ns route add default via 10.99.0.0 dev eth0 onlink
ip netns exec \$ns bwrap --unshare-user-try --unshare-ipc --unshare-pid --unshare-uts --unshare-cgroup-try \
	--ro-bind $ROOTFS / --dev /dev --proc /proc /bin/true
ip netns del \$ns
EOF
# In the world's daemon namespace, so that the veths' host ends live there.
nsenter --net="/run/netns/$H" hyperfine -N --warmup 5 --runs "$RUNS" --export-json "$WORK/bwrap.json" \
	"bwrap --unshare-all --ro-bind $ROOTFS / --dev /dev --proc /proc /bin/true" \
	"bash $WORK/bwrap-veth.sh" >/dev/null 2>&1
read -r BW BWV < <(python3 -c "
import json,sys
r=json.load(open('$WORK/bwrap.json'))['results']
print(' '.join('%.3f' % (x['median']*1e3) for x in r))")

echo "==> TCP from an egress sandbox and from the daemon's namespace" >&2
ID=$("$STRATA" create --image busybox:latest --network egress)
"$STRATA" cp "$WORK/netb" "$ID:/bin/netb" >/dev/null
in_sandbox() { "$STRATA" exec "$ID" -- netb "$@"; }
in_host() { nsenter --net="/run/netns/$H" "$WORK/netb" "$@"; }
SB_CONNECT=$(in_sandbox connect 198.18.1.1 5001 200)
HOST_CONNECT=$(in_host connect 198.18.1.1 5001 200)
# Throughput is noisy on a 2-core VM (+-8% between runs of one setup):
# the three senders take turns, five rounds, and each column is the
# median of its five; the ratio is the median of the rounds' ratios.
SHIM_PID=$("$STRATA" inspect "$ID" | python3 -c 'import json,sys; print(json.load(sys.stdin)["shim_pid"])')
in_netns() { nsenter --net="/proc/$SHIM_PID/ns/net" "$WORK/netb" "$@"; }
ID2=$("$STRATA" create --image busybox:latest --network egress)
"$STRATA" cp "$WORK/netb" "$ID2:/bin/netb" >/dev/null
# The host end is the link whose index the sandbox's eth0 names as its peer.
PEER=$("$STRATA" exec "$ID2" -- cat /sys/class/net/eth0/iflink)
LINK2=$(ip -n "$H" -o link show | awk -F': ' -v i="$PEER" '$1 == i {split($2, a, "@"); print a[1]}')
ip netns exec "$H" ethtool -K "$LINK2" gro off
SB=() HOSTS=() NS=() SLOW=()
for _ in 1 2 3 4 5; do
	SB+=("$(in_sandbox send 198.18.1.1 5001 3)")
	HOSTS+=("$(in_host send 198.18.1.1 5001 3)")
	NS+=("$(in_netns send 198.18.1.1 5001 3)")
	SLOW+=("$("$STRATA" exec "$ID2" -- netb send 198.18.1.1 5001 3)")
done
read -r SB_TPUT HOST_TPUT NS_TPUT SLOW_TPUT RATIO SLOW_RATIO < <(python3 -c "
import statistics as s
sb, host, ns, slow = [$(IFS=,; echo "${SB[*]}")], [$(IFS=,; echo "${HOSTS[*]}")], [$(IFS=,; echo "${NS[*]}")], [$(IFS=,; echo "${SLOW[*]}")]
ratio = lambda xs: 100 * s.median([a / b for a, b in zip(xs, host)])
print('%.1f %.1f %.1f %.1f %.0f%% %.0f%%' % (s.median(sb), s.median(host), s.median(ns), s.median(slow), ratio(sb), ratio(slow)))")
"$STRATA" rm "$ID" >/dev/null
"$STRATA" rm "$ID2" >/dev/null

p50() { echo "${R[$1]%% *}"; }
cat <<EOF

| measurement | median ms | p90 ms |
|---|---|---|
| create, \`network: none\` | $(p50 net_none_create) | ${R[net_none_create]#* } |
| create, \`network: egress\` | $(p50 net_egress_create) | ${R[net_egress_create]#* } |
| create -> exec true -> rm, none | $(p50 net_none_create_exec_rm) | ${R[net_none_create_exec_rm]#* } |
| create -> exec true -> rm, egress | $(p50 net_egress_create_exec_rm) | ${R[net_egress_create_exec_rm]#* } |
| egress minus none (create -> exec -> rm) | $(python3 -c "print('%.3f' % ($(p50 net_egress_create_exec_rm) - $(p50 net_none_create_exec_rm)))") | |
| bwrap --unshare-all true | $BW | |
| bwrap in a netns + veth made by ip | $BWV | |
| bwrap: veth minus none | $(python3 -c "print('%.3f' % ($BWV - $BW))") | |

| TCP to the internet's server | from an egress sandbox | from the daemon's namespace | sandbox / host |
|---|---|---|---|
| connect, p50 / p90 ms (200) | ${SB_CONNECT/ / \/ } | ${HOST_CONNECT/ / \/ } | |
| throughput MB/s (3 s, median of 5 rounds) | $SB_TPUT | $HOST_TPUT | $RATIO |
| the same from the sandbox's namespace, outside its cgroup and seccomp (nsenter) | $NS_TPUT | | |
| the same from a sandbox whose veth is on the kernel's default path (GRO off, no NAPI thread) | $SLOW_TPUT | | $SLOW_RATIO |
EOF
