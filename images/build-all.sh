#!/usr/bin/env bash
# Build every image under images/<name>/build.sh into OUTROOT/<name>.
#
# usage: images/build-all.sh [OUTROOT]     (default OUTROOT: images/out)
set -euo pipefail

IMAGES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUTROOT=${1:-$IMAGES_DIR/out}
mkdir -p "$OUTROOT"

built=0
for script in "$IMAGES_DIR"/*/build.sh; do
	[[ -f $script ]] || continue
	name=$(basename "$(dirname "$script")")
	echo "==> building image '$name' into $OUTROOT/$name"
	bash "$script" "$OUTROOT/$name"
	built=$((built + 1))
done

if [[ $built -eq 0 ]]; then
	echo "images/build-all.sh: error: no images/*/build.sh found" >&2
	exit 1
fi
echo "==> built $built image(s) into $OUTROOT"
