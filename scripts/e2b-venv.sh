#!/usr/bin/env bash
# Make (once) a Python venv holding the pinned E2B SDK from PyPI, for the
# E2B compatibility tests and benchmark; print its python's path.
#
# usage: scripts/e2b-venv.sh [DIR]   (default /var/cache/strata-e2b-venv-<version>)
# E2B_SDK_VERSION picks another SDK version (the tests pin 2.63.0).
set -euo pipefail

VERSION=${E2B_SDK_VERSION:-2.63.0}
DIR=${1:-/var/cache/strata-e2b-venv-$VERSION}
PY=${PYTHON:-/usr/bin/python3}
[[ -x $PY ]] || PY=$(command -v python3)

if [[ ! -x $DIR/bin/python ]] || ! "$DIR/bin/python" -c "import e2b, importlib.metadata as m; assert m.version('e2b') == '$VERSION'" 2>/dev/null; then
	rm -rf "$DIR.tmp"
	"$PY" -m venv "$DIR.tmp" >&2 || {
		echo "scripts/e2b-venv.sh: error: $PY -m venv failed (apt-get install python3-venv)" >&2
		exit 1
	}
	"$DIR.tmp/bin/pip" install --quiet --disable-pip-version-check "e2b==$VERSION" >&2
	rm -rf "$DIR"
	mv "$DIR.tmp" "$DIR"
	# A venv records its own path; it moved from DIR.tmp.
	sed -i "s|$DIR.tmp|$DIR|g" "$DIR"/bin/* 2>/dev/null || true
fi
echo "$DIR/bin/python"
