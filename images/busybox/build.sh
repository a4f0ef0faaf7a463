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

case "$(uname -m)" in
x86_64) ARCH=amd64 ;;
aarch64 | arm64) ARCH=arm64 ;;
*) die "unsupported machine architecture $(uname -m)" ;;
esac

# Refuse to clobber a directory that is not an OCI layout we could have written.
if [[ -e $OUTDIR ]]; then
	[[ -d $OUTDIR ]] || die "$OUTDIR exists and is not a directory"
	if [[ ! -f $OUTDIR/oci-layout ]] && [[ -n "$(ls -A "$OUTDIR")" ]]; then
		die "$OUTDIR exists, is not empty and is not an OCI layout; refusing to overwrite"
	fi
fi

OUTPARENT=$(dirname "$OUTDIR")
mkdir -p "$OUTPARENT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/strata-busybox-build.XXXXXX")
STAGE=$(mktemp -d "$OUTPARENT/.$(basename "$OUTDIR").tmp.XXXXXX")
cleanup() {
	rm -rf "$WORK" "$STAGE"
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

# ---- layer ------------------------------------------------------------------
# Entry names are relative ("bin/busybox", no "./" prefix) and sorted, owners
# are 0:0, mtimes are the epoch, no atime/ctime/xattrs: same tree, same bytes.
(cd "$ROOTFS" && find . -mindepth 1 -printf '%P\n' | sort) >"$WORK/files"
tar --create --file="$WORK/layer.tar" --directory="$ROOTFS" \
	--format=gnu --no-recursion --verbatim-files-from --files-from="$WORK/files" \
	--sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
	--no-acls --no-xattrs --no-selinux
gzip -n -9 -c "$WORK/layer.tar" >"$WORK/layer.tar.gz"

sha() { sha256sum "$1" | cut -d' ' -f1; }
size() { stat -c %s "$1"; }

BLOBS=$STAGE/blobs/sha256
mkdir -p "$BLOBS"

DIFF_ID=$(sha "$WORK/layer.tar")
LAYER_DIGEST=$(sha "$WORK/layer.tar.gz")
LAYER_SIZE=$(size "$WORK/layer.tar.gz")
mv "$WORK/layer.tar.gz" "$BLOBS/$LAYER_DIGEST"

# ---- config, manifest, index ------------------------------------------------
# Written as compact JSON by printf: fixed key order, so fixed digests.
printf '%s' \
	'{"created":"1970-01-01T00:00:00Z",' \
	'"architecture":"'"$ARCH"'","os":"linux",' \
	'"config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","HOME=/root"],' \
	'"Cmd":["sh"],"WorkingDir":"/"},' \
	'"rootfs":{"type":"layers","diff_ids":["sha256:'"$DIFF_ID"'"]},' \
	'"history":[{"created":"1970-01-01T00:00:00Z","created_by":"images/busybox/build.sh"}]}' \
	>"$WORK/config.json"
CONFIG_DIGEST=$(sha "$WORK/config.json")
CONFIG_SIZE=$(size "$WORK/config.json")
mv "$WORK/config.json" "$BLOBS/$CONFIG_DIGEST"

printf '%s' \
	'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",' \
	'"config":{"mediaType":"application/vnd.oci.image.config.v1+json",' \
	'"digest":"sha256:'"$CONFIG_DIGEST"'","size":'"$CONFIG_SIZE"'},' \
	'"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip",' \
	'"digest":"sha256:'"$LAYER_DIGEST"'","size":'"$LAYER_SIZE"'}]}' \
	>"$WORK/manifest.json"
MANIFEST_DIGEST=$(sha "$WORK/manifest.json")
MANIFEST_SIZE=$(size "$WORK/manifest.json")
mv "$WORK/manifest.json" "$BLOBS/$MANIFEST_DIGEST"

printf '%s' \
	'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",' \
	'"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json",' \
	'"digest":"sha256:'"$MANIFEST_DIGEST"'","size":'"$MANIFEST_SIZE"',' \
	'"platform":{"architecture":"'"$ARCH"'","os":"linux"},' \
	'"annotations":{"org.opencontainers.image.ref.name":"latest"}}]}' \
	>"$STAGE/index.json"
printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$STAGE/oci-layout"

find "$STAGE" -type d -exec chmod 0755 {} +
find "$STAGE" -type f -exec chmod 0644 {} +

# ---- publish ----------------------------------------------------------------
# Swap the finished layout into place; readers never see a half-written one.
rm -rf "$OUTDIR"
mv "$STAGE" "$OUTDIR"

echo "busybox image: $OUTDIR (tag latest)"
echo "  manifest sha256:$MANIFEST_DIGEST"
echo "  config   sha256:$CONFIG_DIGEST"
echo "  layer    sha256:$LAYER_DIGEST ($LAYER_SIZE bytes, diff_id sha256:$DIFF_ID, $applets applets)"
