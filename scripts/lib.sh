# shellcheck shell=bash
# Shared by the scripts that run a throwaway daemon (bench*.sh,
# fuzz-api.sh). Source it after setting STRATA to the `strata` binary.

# start_daemon SOCKET ROOT CGROUP_PARENT LOG [daemon args...]: start a daemon
# in the background, set DAEMON_PID, and return once its socket exists (exit
# with its log if it dies or does not come up within 10 s).
start_daemon() {
	local sock=$1 root=$2 parent=$3 log=$4
	shift 4
	"$STRATA" daemon --root "$root" --socket "$sock" --cgroup-parent "$parent" "$@" >"$log" 2>&1 &
	DAEMON_PID=$!
	for _ in $(seq 200); do
		[[ -S $sock ]] && return 0
		kill -0 "$DAEMON_PID" 2>/dev/null || break
		sleep 0.05
	done
	kill "$DAEMON_PID" 2>/dev/null || true
	cat "$log" >&2
	echo "strata daemon on $sock did not start" >&2
	exit 1
}

# stop_daemon SOCKET PID: remove every sandbox (shims outlive their daemon),
# then SIGTERM the daemon and wait for it. Nothing to do without a pid.
stop_daemon() {
	[[ -n $2 ]] || return 0
	local id
	for id in $("$STRATA" --socket "$1" ps 2>/dev/null | awk 'NR > 1 {print $1}'); do
		"$STRATA" --socket "$1" rm "$id" >/dev/null || true
	done
	kill "$2" 2>/dev/null || true
	wait "$2" 2>/dev/null || true
}
