#!/usr/bin/env bash
# Build a deterministic OCI image layout of a static busybox rootfs.
#
# usage: images/busybox/build.sh OUTDIR
#
# OUTDIR gets oci-layout, index.json and blobs/sha256/* with one gzip layer,
# tagged "latest". Running it twice on the same host gives identical digests.
# Env: BUSYBOX=/path/to/static/busybox (default /bin/busybox, from Debian's
# busybox-static package).
set -euo pipefail

die() {
	echo "images/busybox/build.sh: error: $*" >&2
	exit 1
}

[[ $# -eq 1 && -n $1 ]] || die "usage: $0 OUTDIR"
OUTDIR=$1

BUSYBOX=${BUSYBOX:-/bin/busybox}
if [[ ! -x $BUSYBOX ]]; then
	die "$BUSYBOX not found or not executable; install Debian's busybox-static package (apt-get install busybox-static)"
fi
# The rootfs has no libc, so the binary must be statically linked.
if command -v ldd >/dev/null 2>&1 && ldd "$BUSYBOX" >/dev/null 2>&1; then
	die "$BUSYBOX is dynamically linked; install busybox-static instead of busybox"
fi

for tool in tar gzip sha256sum stat sort; do
	command -v "$tool" >/dev/null 2>&1 || die "required tool '$tool' not found"
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-busybox-build.XXXXXX")
cleanup() {
	rm -rf "$WORK"
}
trap cleanup EXIT

umask 022
export LC_ALL=C

# ---- rootfs -----------------------------------------------------------------
ROOTFS=$WORK/rootfs
mkdir -p "$ROOTFS"
for d in bin etc usr usr/bin dev proc sys home root tmp; do
	mkdir -p "$ROOTFS/$d"
done
chmod 0755 "$ROOTFS"
find "$ROOTFS" -type d -exec chmod 0755 {} +
chmod 0700 "$ROOTFS/root"
chmod 1777 "$ROOTFS/tmp"

cp "$BUSYBOX" "$ROOTFS/bin/busybox"
chmod 0755 "$ROOTFS/bin/busybox"

applets=0
while IFS= read -r applet; do
	case "$applet" in
	"" | busybox | */* | . | ..) continue ;;
	esac
	[[ -e $ROOTFS/bin/$applet || -L $ROOTFS/bin/$applet ]] && continue
	ln -s busybox "$ROOTFS/bin/$applet"
	applets=$((applets + 1))
done < <("$BUSYBOX" --list | sort -u)
[[ $applets -gt 0 ]] || die "$BUSYBOX --list printed no applets"
[[ -L $ROOTFS/bin/sh ]] || die "$BUSYBOX has no 'sh' applet"

cat >"$ROOTFS/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$ROOTFS/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
: >"$ROOTFS/etc/hostname"
chmod 0644 "$ROOTFS/etc/passwd" "$ROOTFS/etc/group" "$ROOTFS/etc/hostname"

# ---- layout -----------------------------------------------------------------
# shellcheck source=images/lib/layout.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/layout.sh"
echo "busybox image: $OUTDIR (tag latest, $applets applets)"
write_oci_layout "$ROOTFS" "$OUTDIR" "images/busybox/build.sh" '["sh"]'
