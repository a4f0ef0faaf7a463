#!/usr/bin/env bash
# Fuzz the daemon's API from docs/openapi.yaml with schemathesis: a daemon on
# a temporary root and socket, exposed through socat on the loopback of a
# network namespace of its own (so no other user of the host can reach the
# root daemon through the TCP port while it runs), with the
# busybox image imported; schemathesis generates requests (examples,
# coverage and fuzzing phases) and checks every response against the spec
# (no 5xx, documented status codes and content types, response schemas,
# schema-violating requests refused). Registry routes (pull/push) are left
# out: their references would make the daemon contact hosts on the network.
# Check left out: positive_data_acceptance (much of the validation depends
# on the host: paths that must exist, CPU counts, mount rules).
#
# scripts/test.sh runs it with a fixed seed; scripts/install-deps.sh installs
# socat and schemathesis (a venv in /var/cache/strata-fuzz-venv). Its root,
# socket and cgroup parent carry the test suite's marker (strata-test), so
# the leftover check after it covers it too.
#
# The daemon's log is kept in ${TMPDIR:-/tmp}/strata-fuzz-daemon.log.
#
# usage: sudo [EXAMPLES=50] [SEED=1] scripts/fuzz-api.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/fuzz-api.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
VENV=/var/cache/strata-fuzz-venv
if ! command -v socat >/dev/null || [[ ! -x $VENV/bin/st ]]; then
	echo "socat or schemathesis missing: run scripts/install-deps.sh" >&2
	exit 1
fi

cargo build --workspace >&2
images/build-all.sh images/out >&2
BIN=$REPO_ROOT/target/debug/strata
WORK=$(mktemp -d /var/tmp/strata-test-fuzz.XXXXXX)
SOCK=$WORK/api.sock
PARENT=strata-test-fuzz-$$
DAEMON_PID=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
	if [[ -n $DAEMON_PID ]]; then
		for id in $("$BIN" --socket "$SOCK" ps 2>/dev/null | awk 'NR > 1 {print $1}'); do
			"$BIN" --socket "$SOCK" rm "$id" >/dev/null || true
		done
		kill "$DAEMON_PID" 2>/dev/null || true
		wait "$DAEMON_PID" 2>/dev/null || true
	fi
	for d in /sys/fs/cgroup/*/"$PARENT" /sys/fs/cgroup/"$PARENT"; do
		if [[ -d $d ]]; then rmdir "$d" 2>/dev/null || true; fi
	done
	cp "$WORK/daemon.log" "${TMPDIR:-/tmp}/strata-fuzz-daemon.log" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT

"$BIN" daemon --root "$WORK/root" --socket "$SOCK" --cgroup-parent "$PARENT" --warm-pool 0 >"$WORK/daemon.log" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 200); do [[ -S $SOCK ]] && break; sleep 0.05; done
"$BIN" --socket "$SOCK" image import images/out/busybox --name busybox >/dev/null

rc=0
# shellcheck disable=SC2016 # expanded by the inner shell
unshare --net -- bash -c '
	set -euo pipefail
	ip link set lo up
	socat TCP-LISTEN:8080,bind=127.0.0.1,reuseaddr,fork "UNIX-CONNECT:$1" &
	socat_pid=$!
	trap "kill $socat_pid" EXIT
	sleep 0.5
	"$2/bin/st" run docs/openapi.yaml --url http://127.0.0.1:8080 \
		-n "$3" --seed "$4" \
		--checks all --exclude-checks positive_data_acceptance \
		--phases examples,coverage,fuzzing --exclude-path-regex "pull|push"
' fuzz "$SOCK" "$VENV" "${EXAMPLES:-50}" "${SEED:-1}" || rc=$?
if grep -qiE 'panicked|overflow' "$WORK/daemon.log"; then
	echo "the daemon panicked:" >&2
	grep -iE -A5 'panicked|overflow' "$WORK/daemon.log" >&2
	rc=1
fi
exit "$rc"
