#!/usr/bin/env bash
# Build an OCI image layout shaped like E2B's base template, for the E2B
# SDK tests: Debian (the debian-git image's tree: bash, coreutils, git)
# with a `user` account (uid 1000, home /home/user) as the default user
# and working directory, as E2B's sandboxes have.
#
# usage: images/e2b/build.sh OUTDIR
#
# Needs the debian-git layout beside OUTDIR (images/build-all.sh builds it
# first) or at DEBIAN_GIT, and umoci. Cached like debian-git, keyed by the
# recipe and the base image's manifest.
set -euo pipefail

die() {
	echo "images/e2b/build.sh: error: $*" >&2
	exit 1
}

[[ $# -eq 1 && -n $1 ]] || die "usage: $0 OUTDIR"
OUTDIR=$1
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
BASE=${DEBIAN_GIT:-$(dirname "$OUTDIR")/debian-git}
[[ -f $BASE/index.json ]] || die "no debian-git image at $BASE (build it first: images/debian-git/build.sh $BASE)"
command -v umoci >/dev/null || die "umoci not found: apt-get install umoci"
[[ $(id -u) -eq 0 ]] || die "needs root (the tree keeps its owners)"

recipe=$(cat "$HERE/build.sh" "$HERE/../lib/layout.sh" "$BASE/index.json" | sha256sum | cut -d' ' -f1)
CACHE=${STRATA_IMAGE_CACHE:-/var/cache/strata-images}/e2b-${recipe:0:16}
if [[ ${FORCE:-} != 1 && -f $CACHE/oci-layout ]]; then
	rm -rf "$OUTDIR"
	mkdir -p "$(dirname "$OUTDIR")"
	cp -a "$CACHE" "$OUTDIR"
	echo "e2b image: $OUTDIR (from the cache $CACHE)"
	exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-e2b.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
umoci raw unpack --image "$BASE:latest" "$WORK/rootfs" >/dev/null
ROOTFS=$WORK/rootfs

chroot "$ROOTFS" groupadd --gid 1000 user
chroot "$ROOTFS" useradd --uid 1000 --gid 1000 --create-home --home-dir /home/user --shell /bin/bash user
rm -f "$ROOTFS"/var/log/*.log "$ROOTFS"/etc/*- 2>/dev/null || true
find "$ROOTFS/dev" -mindepth 1 -delete 2>/dev/null || true

# shellcheck source=images/lib/layout.sh
source "$HERE/../lib/layout.sh"
echo "e2b image: $OUTDIR (tag latest, user uid 1000)"
write_oci_layout "$ROOTFS" "$OUTDIR" "images/e2b/build.sh" '["bash"]' user /home/user /home/user
rm -rf "$CACHE.tmp"
mkdir -p "$(dirname "$CACHE")"
cp -a "$OUTDIR" "$CACHE.tmp"
rm -rf "$CACHE"
mv "$CACHE.tmp" "$CACHE"
