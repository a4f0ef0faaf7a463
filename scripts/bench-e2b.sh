#!/usr/bin/env bash
# The E2B SDK against Strata's own API and CLI for the same steps (create a
# sandbox of the E2B-style image, run `true`, remove it), one run on this
# machine, one daemon (release build) serving both APIs. Prints a Markdown
# table (scripts/bench_e2b.py).
#
# usage: sudo scripts/bench-e2b.sh      (RUNS=30 rounds by default)
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
[[ $(id -u) -eq 0 ]] || { echo "run as root: sudo scripts/bench-e2b.sh" >&2; exit 1; }
if ! command -v cargo >/dev/null; then PATH="$HOME/.cargo/bin:$PATH"; fi
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
need_tools python3
build_release
export STRATA=$REPO_ROOT/target/release/strata
PY=$(scripts/e2b-venv.sh)

WORK=$(mktemp -d /var/tmp/strata-bench-e2b.XXXXXX)
SOCK=$WORK/strata.sock
DAEMON_PID=
cleanup() {
	stop_daemon "$SOCK" "$DAEMON_PID"
	rm -rf "$WORK"
}
trap cleanup EXIT

echo "bench-key" >"$WORK/keys"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_daemon "$SOCK" "$WORK/root" strata-bench-e2b "$WORK/daemon.log" \
	--e2b-listen "127.0.0.1:$PORT" --e2b-api-keys "$WORK/keys"
"$STRATA" --socket "$SOCK" image import images/out/e2b --name base >/dev/null

echo "==> $(nproc) CPUs, kernel $(uname -r), e2b SDK $("$PY" -c 'import importlib.metadata as m; print(m.version("e2b"))')" >&2
E2B_API_URL=http://127.0.0.1:$PORT E2B_SANDBOX_URL=http://127.0.0.1:$PORT E2B_API_KEY=bench-key \
	STRATA_SOCKET=$SOCK "$PY" scripts/bench_e2b.py
