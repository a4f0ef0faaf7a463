#!/usr/bin/env bash
# Build the workspace in release mode and every test image into images/out.
#
# usage: scripts/build.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

die() {
	echo "scripts/build.sh: error: $*" >&2
	exit 1
}

# rustup installs into ~/.cargo/bin, which `sudo` drops from PATH.
if ! command -v cargo >/dev/null 2>&1; then
	for dir in "${CARGO_HOME:-$HOME/.cargo}/bin" /root/.cargo/bin; do
		if [[ -x $dir/cargo ]]; then
			PATH="$dir:$PATH"
			break
		fi
	done
fi
command -v cargo >/dev/null 2>&1 || die "cargo not found; run scripts/install-deps.sh first"

printf '\n==> cargo build --workspace --release; scripts/build-shim.sh release\n'
cargo build --workspace --release
scripts/build-shim.sh release

printf '\n==> images/build-all.sh %s\n' "$REPO_ROOT/images/out"
images/build-all.sh "$REPO_ROOT/images/out"

printf '\n==> built: %s %s\n' "$REPO_ROOT/target/release/strata" "$REPO_ROOT/target/release/strata-shim"
