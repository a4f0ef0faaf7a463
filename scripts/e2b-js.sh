#!/usr/bin/env bash
# Install (once) the pinned E2B JavaScript SDK from npm into a cache dir
# for the E2B compatibility test; print the dir. Needs Node >= 20.18 (the
# SDK's engines); exits 3 without printing when there is none.
#
# usage: scripts/e2b-js.sh [DIR]   (default /var/cache/strata-e2b-js-<version>)
set -euo pipefail

VERSION=${E2B_JS_SDK_VERSION:-2.51.0}
DIR=${1:-/var/cache/strata-e2b-js-$VERSION}

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
	echo "scripts/e2b-js.sh: node and npm not found" >&2
	exit 3
fi
if ! node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 18) ? 0 : 1)'; then
	echo "scripts/e2b-js.sh: node $(node --version) is older than the SDK's 20.18" >&2
	exit 3
fi
if [[ ! -f $DIR/node_modules/e2b/package.json ]] ||
	[[ $(node -p "require('$DIR/node_modules/e2b/package.json').version") != "$VERSION" ]]; then
	rm -rf "$DIR.tmp"
	mkdir -p "$DIR.tmp"
	(cd "$DIR.tmp" && npm init -y >/dev/null && npm install --silent --no-audit --no-fund "e2b@$VERSION" >&2)
	rm -rf "$DIR"
	mv "$DIR.tmp" "$DIR"
fi
echo "$DIR"
