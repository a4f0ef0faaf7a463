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

# need_tools TOOL...: exit, naming it, if a tool is missing.
need_tools() {
	local tool
	for tool in "$@"; do
		command -v "$tool" >/dev/null || { echo "$tool missing: run scripts/install-deps.sh" >&2; exit 1; }
	done
}

# build_release: the release binaries and the test images (benchmarks).
build_release() {
	echo "==> building (release) and images" >&2
	cargo build --release --workspace >&2
	images/build-all.sh images/out >&2
}

# start_registry DIR: a throwaway docker-registry (distribution 2.8) on a
# free loopback port, storing under DIR/registry; sets REG (host:port) and
# REG_PID, and returns once it answers. stop_registry ends it.
start_registry() {
	local dir=$1 port
	port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
	REG=127.0.0.1:$port
	cat >"$dir/registry.yml" <<YML
version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: "$dir/registry"
  delete:
    enabled: true
http:
  addr: $REG
  secret: bench
health:
  storagedriver:
    enabled: false
YML
	docker-registry serve "$dir/registry.yml" >"$dir/registry.log" 2>&1 &
	REG_PID=$!
	for _ in $(seq 200); do
		[[ $(curl -s -o /dev/null -w '%{http_code}' "http://$REG/v2/" || true) == 200 ]] && return 0
		kill -0 "$REG_PID" 2>/dev/null || break
		sleep 0.05
	done
	cat "$dir/registry.log" >&2
	echo "docker-registry did not answer on $REG" >&2
	exit 1
}

stop_registry() {
	[[ -n ${REG_PID:-} ]] || return 0
	kill "$REG_PID" 2>/dev/null || true
	wait "$REG_PID" 2>/dev/null || true
}
