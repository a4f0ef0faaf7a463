#!/usr/bin/env bash
# Build strata-shim into target/PROFILE/strata-shim, where the daemon looks
# for it (next to `strata`).
#
# usage: scripts/build-shim.sh [debug|release]        (default debug)
#
# It is a static binary for the musl target when rustup can provide that
# target: the shim is executed once per sandbox, and a glibc executable
# spends most of its start-up in the dynamic loader and in glibc's CPU
# probing (CPUID, which traps to the hypervisor in a VM): 0.4 ms of every
# create -> exec -> rm on the benchmark VM (BENCHMARKS.md). Without the
# target it falls back to a glibc build, which works the same, only slower
# to start. A plain `cargo build` does not build the shim (its [[bin]]
# needs the `binary` feature): cargo would put its glibc copy back over
# this one at every build.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"
PROFILE=${1:-debug}
case $PROFILE in
debug) flags=() ;;
release) flags=(--release) ;;
*)
	echo "usage: scripts/build-shim.sh [debug|release]" >&2
	exit 2
	;;
esac
if ! command -v cargo >/dev/null 2>&1; then PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"; fi
TARGET_DIR=${CARGO_TARGET_DIR:-$REPO_ROOT/target}
MUSL=$(uname -m)-unknown-linux-musl

have_musl() {
	command -v rustup >/dev/null 2>&1 || return 1
	local installed
	installed=$(rustup target list --installed 2>/dev/null || true)
	grep -qx "$MUSL" <<<"$installed" && return 0
	echo "==> rustup target add $MUSL" >&2
	rustup target add "$MUSL" >&2
}

if have_musl && cargo build -p strata-shim --features binary --target "$MUSL" "${flags[@]}" >&2; then
	install -m 0755 "$TARGET_DIR/$MUSL/$PROFILE/strata-shim" "$TARGET_DIR/$PROFILE/strata-shim"
	echo "==> $TARGET_DIR/$PROFILE/strata-shim (static, $MUSL)" >&2
else
	echo "warning: no static $MUSL build (rustup target add $MUSL): building a glibc strata-shim, slower to start" >&2
	cargo build -p strata-shim --features binary "${flags[@]}" >&2
fi
