# shellcheck shell=bash
# Shared by the scripts that run a throwaway daemon (bench*.sh,
# fuzz-api.sh). Source it after setting STRATA to the `strata` binary.

# start_daemon SOCKET ROOT CGROUP_PARENT LOG [daemon args...]: start a daemon
# in the background, set DAEMON_PID, and return once its socket exists (exit
# with its log if it dies or does not come up within 10 s). Networking is
# off unless the args say --network: these daemons run in the host's own
# network namespace, whose forwarding and nftables they leave alone.
start_daemon() {
	local sock=$1 root=$2 parent=$3 log=$4
	shift 4
	[[ " $* " == *" --network "* ]] || set -- --network off "$@"
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
	scripts/build-shim.sh release
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

# start_postgres DIR: a throwaway PostgreSQL (Debian's postgresql-15) in
# DIR/pg, run as the postgres user, Unix socket only (no TCP), fsync off;
# sets PG_URL (a database `strata` on it) and PG_DATA. stop_postgres ends it.
start_postgres() {
	local dir=$1/pg bin=/usr/lib/postgresql/15/bin
	[[ -x $bin/initdb ]] || { echo "postgresql-15 missing: run scripts/install-deps.sh" >&2; exit 1; }
	mkdir -p "$dir"
	# The postgres user must reach DIR/pg (traverse only above it).
	chmod 711 "$1"
	chown postgres: "$dir"
	PG_DATA=$dir/data
	runuser -u postgres -- "$bin/initdb" -D "$PG_DATA" -A trust -U postgres >"$dir/initdb.log" 2>&1 ||
		{ cat "$dir/initdb.log" >&2; echo "initdb failed" >&2; exit 1; }
	runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DATA" -l "$dir/server.log" -w \
		-o "-k $dir -c listen_addresses='' -c fsync=off -c max_connections=200" start >/dev/null ||
		{ cat "$dir/server.log" >&2; echo "PostgreSQL did not start" >&2; exit 1; }
	PG_SOCKET_DIR=$dir
	# shellcheck disable=SC2034 # read by the sourcing script
	PG_URL=$(pg_database strata)
}

# pg_database NAME: create database NAME on the server start_postgres
# started; prints its connection string.
pg_database() {
	runuser -u postgres -- /usr/lib/postgresql/15/bin/createdb -h "$PG_SOCKET_DIR" -U postgres "$1"
	echo "host=$PG_SOCKET_DIR user=postgres dbname=$1"
}

stop_postgres() {
	[[ -n ${PG_DATA:-} && -d $PG_DATA ]] || return 0
	runuser -u postgres -- /usr/lib/postgresql/15/bin/pg_ctl -D "$PG_DATA" -m fast -w stop >/dev/null 2>&1 || true
}

# skopeo_fresh CACHE_DIR ARGS...: skopeo as root keeps a blob-info cache in
# /var/lib/containers/cache, from which it would mount blobs an earlier run
# pushed instead of uploading them: each run gets an empty cache dir of its
# own, bound there in a private mount namespace.
skopeo_fresh() {
	mkdir -p "$1" /var/lib/containers/cache
	# shellcheck disable=SC2016 # expanded by the inner sh
	unshare --mount --propagation private -- sh -c \
		'mount --bind "$0" /var/lib/containers/cache && exec skopeo "$@"' "$@"
}

# cell MS...: "median (run1, run2, ...)" for a Markdown table.
cell() {
	python3 -c '
import statistics, sys
v = [int(x) for x in sys.argv[1:]]
print("%.0f (%s)" % (statistics.median(v), ", ".join(map(str, v))))' "$@"
}

# now: a timestamp for ms; ms T0 T1: milliseconds from T0 to T1.
now() { date +%s.%N; }
ms() { python3 -c "import sys; print(f'{(float(sys.argv[2]) - float(sys.argv[1])) * 1000:.0f}')" "$1" "$2"; }
