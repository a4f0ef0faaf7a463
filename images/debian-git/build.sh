#!/usr/bin/env bash
# Build an OCI image layout of a minimal Debian (bookworm, debootstrap's
# minbase variant) with git, for the baseline tests: `strata baseline
# publish` validates a repository with git inside the sandbox.
#
# usage: images/debian-git/build.sh OUTDIR
#
# Needs root (debootstrap) and a Debian mirror (MIRROR, default
# http://deb.debian.org/debian). The finished layout is cached under
# STRATA_IMAGE_CACHE (default /var/cache/strata-images), keyed by the
# recipe's hash, and reused by later runs (CI clones afresh each time);
# FORCE=1 rebuilds.
set -euo pipefail

die() {
	echo "images/debian-git/build.sh: error: $*" >&2
	exit 1
}

[[ $# -eq 1 && -n $1 ]] || die "usage: $0 OUTDIR"
OUTDIR=$1
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SUITE=${SUITE:-bookworm}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

[[ $(id -u) -eq 0 ]] || die "debootstrap needs root"
command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"

recipe=$(cat "$HERE/build.sh" "$HERE/../lib/layout.sh" | sha256sum | cut -d' ' -f1)
CACHE=${STRATA_IMAGE_CACHE:-/var/cache/strata-images}/debian-git-${recipe:0:16}
if [[ ${FORCE:-} != 1 && -f $CACHE/oci-layout ]]; then
	rm -rf "$OUTDIR"
	mkdir -p "$(dirname "$OUTDIR")"
	cp -a "$CACHE" "$OUTDIR"
	echo "debian-git image: $OUTDIR (from the cache $CACHE)"
	exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-debian-git.XXXXXX")
cleanup() {
	rm -rf "$WORK"
}
trap cleanup EXIT
ROOTFS=$WORK/rootfs

debootstrap --variant=minbase --include=git --components=main "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
	{ tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (log above)"; }

version=$(chroot "$ROOTFS" git --version) || die "git does not run in the rootfs"

# What a layer may not carry, and what only makes it bigger: device nodes
# (the sandbox gets its own /dev), package caches and lists, logs.
find "$ROOTFS/dev" -mindepth 1 -delete
rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/* \
	"$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
if find "$ROOTFS" \( -type b -o -type c -o -type s -o -type p \) | grep -q .; then
	die "special files left in the rootfs: $(find "$ROOTFS" \( -type b -o -type c -o -type s -o -type p \) | head -5)"
fi

# shellcheck source=images/lib/layout.sh
source "$HERE/../lib/layout.sh"
echo "debian-git image: $OUTDIR (tag latest, $SUITE, $version)"
write_oci_layout "$ROOTFS" "$OUTDIR" "images/debian-git/build.sh" '["bash"]'
rm -rf "$CACHE.tmp"
mkdir -p "$(dirname "$CACHE")"
cp -a "$OUTDIR" "$CACHE.tmp"
rm -rf "$CACHE"
mv "$CACHE.tmp" "$CACHE"
