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
scripts/build-shim.sh debug
images/build-all.sh images/out >&2
STRATA=$REPO_ROOT/target/debug/strata
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
WORK=$(mktemp -d /var/tmp/strata-test-fuzz.XXXXXX)
SOCK=$WORK/api.sock
PARENT=strata-test-fuzz-$$
DAEMON_PID=
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
	stop_daemon "$SOCK" "$DAEMON_PID"
	for d in /sys/fs/cgroup/*/"$PARENT" /sys/fs/cgroup/"$PARENT"; do
		if [[ -d $d ]]; then rmdir "$d" 2>/dev/null || true; fi
	done
	cp "$WORK/daemon.log" "${TMPDIR:-/tmp}/strata-fuzz-daemon.log" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT

start_daemon "$SOCK" "$WORK/root" "$PARENT" "$WORK/daemon.log" --warm-pool 0
"$STRATA" --socket "$SOCK" image import images/out/busybox --name busybox >/dev/null

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
