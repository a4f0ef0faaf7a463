#!/usr/bin/env bash
# One-command demo on a fresh Debian 12 host, as root: install dependencies,
# build, start a throwaway daemon, import the busybox image, run a sandbox,
# look around inside it, checkpoint it, fork the snapshot three times, remove
# everything, and clean up on exit.
#
# usage: sudo scripts/demo.sh
# env:   ROOT=DIR          daemon root (default: a fresh mktemp dir, removed on exit)
#        SKIP_DEPS=1       skip scripts/install-deps.sh
#        SKIP_BUILD=1      skip scripts/build.sh (use the existing target/release)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

die() {
	echo "scripts/demo.sh: error: $*" >&2
	exit 1
}
banner() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }

# Quote one word for display only if it needs it.
shown() {
	if [[ $1 =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
		printf '%s' "$1"
	else
		printf "'%s'" "${1//\'/\'\\\'\'}"
	fi
}
# Print "$ cmd args" and run it.
run() {
	local word line=""
	for word in "$@"; do
		line+="${line:+ }$(shown "$word")"
	done
	printf '\n\033[1;36m$ %s\033[0m\n' "$line"
	"$@"
}

[[ $(id -u) -eq 0 ]] || die "must run as root (try: sudo $0)"

if [[ -z ${SKIP_DEPS:-} ]]; then
	banner "installing dependencies (scripts/install-deps.sh)"
	scripts/install-deps.sh
fi
if [[ -z ${SKIP_BUILD:-} ]]; then
	banner "building (scripts/build.sh)"
	scripts/build.sh
fi

[[ -x target/release/strata ]] || die "target/release/strata missing; run scripts/build.sh"
[[ -f images/out/busybox/index.json ]] || die "images/out/busybox missing; run images/build-all.sh"
export PATH="$REPO_ROOT/target/release:$PATH"

OWN_ROOT=""
if [[ -z ${ROOT:-} ]]; then
	ROOT=$(mktemp -d /tmp/strata-demo.XXXXXX)
	OWN_ROOT=1
fi
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
SOCK=$ROOT/strata.sock
LOG=$ROOT/daemon.log
DAEMON_PID=""
ID=""
FORKS=""

cleanup() {
	local status=$? mnt
	set +e
	banner "cleaning up"
	if [[ -n $ID ]]; then
		echo "removing sandbox $ID"
		strata rm "$ID" || echo "warning: strata rm $ID failed" >&2
	fi
	for f in ${FORKS:-}; do
		strata rm "$f" >/dev/null 2>&1 || true
	done
	if [[ -n $DAEMON_PID ]] && kill -0 "$DAEMON_PID" 2>/dev/null; then
		echo "stopping daemon (pid $DAEMON_PID)"
		kill "$DAEMON_PID"
		for _ in $(seq 50); do
			kill -0 "$DAEMON_PID" 2>/dev/null || break
			sleep 0.1
		done
		if kill -0 "$DAEMON_PID" 2>/dev/null; then
			echo "warning: daemon did not stop on SIGTERM; sending SIGKILL" >&2
			kill -KILL "$DAEMON_PID"
		fi
		wait "$DAEMON_PID" 2>/dev/null
	fi
	if [[ $status -ne 0 && -f $LOG ]]; then
		echo "--- daemon log ($LOG) ---" >&2
		tail -n 50 "$LOG" >&2
	fi
	if [[ -n $OWN_ROOT ]]; then
		# Never rm -rf through a live mount: detach anything still under ROOT first.
		while read -r mnt; do
			echo "warning: unmounting leftover mount $mnt" >&2
			umount -l "$mnt"
		done < <(awk -v root="$ROOT" '$5 == root || index($5, root "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
		rm -rf "$ROOT"
		echo "removed $ROOT"
	fi
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

banner "starting the daemon"
echo "root:   $ROOT"
echo "socket: $SOCK"
echo "log:    $LOG"
# Networking off: the demo's daemon leaves this host's forwarding and
# nftables alone (tests/network.rs shows egress, in a namespace world of its own).
strata daemon --root "$ROOT" --socket "$SOCK" --network off >"$LOG" 2>&1 &
DAEMON_PID=$!
for _ in $(seq 100); do
	[[ -S $SOCK ]] && break
	kill -0 "$DAEMON_PID" 2>/dev/null || die "daemon exited early (see log below)"
	sleep 0.1
done
[[ -S $SOCK ]] || die "daemon did not create $SOCK within 10s"
echo "daemon pid $DAEMON_PID is listening"
export STRATA_SOCKET=$SOCK

banner "images"
run strata image import images/out/busybox --name busybox:latest
run strata image ls

banner "a sandbox: 256 MiB memory, 128 pids, its own hostname"
# shellcheck disable=SC2016 # printed literally, as the command the user would type
printf '\n\033[1;36m$ ID=$(strata create --image busybox:latest --work-context demo-task --memory 268435456 --pids 128 --hostname demo)\033[0m\n'
ID=$(strata create --image busybox:latest --work-context demo-task --memory 268435456 --pids 128 --hostname demo)
ID=${ID//[[:space:]]/}
[[ -n $ID ]] || die "strata create printed no sandbox id"
echo "ID=$ID"
run strata ps

banner "inside the sandbox"
run strata exec "$ID" -- hostname
echo "# only the sandbox's own processes:"
run strata exec "$ID" -- ps
echo "# a private network namespace: only lo"
run strata exec "$ID" -- ip link
run strata exec "$ID" -- cat /proc/net/dev
echo "# a private writable layer"
run strata exec "$ID" -- sh -c 'echo hello > /tmp/f; cat /tmp/f'
echo "# the host's / versus the sandbox's /"
run ls /
run strata exec "$ID" -- ls /

banner "checkpoint and fork"
echo "# seal the sandbox's changes as a snapshot; it keeps running"
# shellcheck disable=SC2016 # printed literally, as the command the user would type
printf '\n\033[1;36m$ SNAP=$(strata checkpoint %s)\033[0m\n' "$ID"
SNAP=$(strata checkpoint "$ID")
echo "SNAP=$SNAP"
run strata diff "$SNAP"
echo "# three independent sandboxes from it, no file data copied"
printf '\n\033[1;36m$ strata fork %s --count 3\033[0m\n' "$SNAP"
FORKS=$(strata fork "$SNAP" --count 3)
echo "$FORKS"
for f in $FORKS; do
	run strata exec "$f" -- sh -c "cat /tmp/f; echo \$(hostname) > /tmp/mine; cat /tmp/mine"
done
run strata ps

banner "removing the sandboxes and the snapshot"
run strata rm "$ID"
ID=""
# shellcheck disable=SC2086 # one word per id
run strata rm $FORKS
FORKS=""
echo "# the lineage: its checkpoints in order and every activation (forks branch into lineages of their own)"
run strata lineage show demo-task
echo "# a lineage's head goes once the work is finished: retire it, then remove"
run strata lineage retire demo-task
run strata snapshot rm "$SNAP"
run strata ps

banner "demo finished"
