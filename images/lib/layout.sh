# shellcheck shell=bash
# Shared by the image recipes: write one rootfs directory as a deterministic
# OCI image layout (one gzip layer, tagged "latest").
#
# usage (after `source images/lib/layout.sh`):
#   write_oci_layout ROOTFS OUTDIR CREATED_BY CMD_JSON [USER WORKDIR HOME]
# Needs: tar gzip sha256sum stat sort. Sets LAYER_DIGEST, LAYER_SIZE,
# DIFF_ID, CONFIG_DIGEST and MANIFEST_DIGEST. OUTDIR is replaced atomically
# (a reader never sees a half-written layout); an existing OUTDIR that is
# not an OCI layout is refused.

write_oci_layout() {
	local rootfs=$1 outdir=$2 created_by=$3 cmd_json=$4
	local user=${5:-} workdir=${6:-/} home=${7:-/root} user_json=""
	[[ -z $user ]] || user_json='"User":"'"$user"'",'
	local arch work stage blobs
	case "$(uname -m)" in
	x86_64) arch=amd64 ;;
	aarch64 | arm64) arch=arm64 ;;
	*)
		echo "write_oci_layout: unsupported machine architecture $(uname -m)" >&2
		return 1
		;;
	esac
	if [[ -e $outdir ]]; then
		if [[ ! -d $outdir ]] || { [[ ! -f $outdir/oci-layout ]] && [[ -n "$(ls -A "$outdir")" ]]; }; then
			echo "write_oci_layout: $outdir exists and is not an OCI layout; refusing to overwrite" >&2
			return 1
		fi
	fi
	mkdir -p "$(dirname "$outdir")"
	work=$(mktemp -d "${TMPDIR:-/tmp}/strata-layout.XXXXXX")
	stage=$(mktemp -d "$(dirname "$outdir")/.$(basename "$outdir").tmp.XXXXXX")
	# Entry names are relative (no "./" prefix) and sorted, owners are kept
	# numerically, mtimes are the epoch, no atime/ctime/xattrs: same tree,
	# same bytes.
	(cd "$rootfs" && find . -mindepth 1 -printf '%P\n' | LC_ALL=C sort) >"$work/files"
	tar --create --file="$work/layer.tar" --directory="$rootfs" \
		--format=gnu --no-recursion --verbatim-files-from --files-from="$work/files" \
		--sort=name --mtime=@0 --numeric-owner \
		--no-acls --no-xattrs --no-selinux
	gzip -n -6 -c "$work/layer.tar" >"$work/layer.tar.gz"

	_sha() { sha256sum "$1" | cut -d' ' -f1; }
	_size() { stat -c %s "$1"; }
	blobs=$stage/blobs/sha256
	mkdir -p "$blobs"
	DIFF_ID=$(_sha "$work/layer.tar")
	LAYER_DIGEST=$(_sha "$work/layer.tar.gz")
	LAYER_SIZE=$(_size "$work/layer.tar.gz")
	mv "$work/layer.tar.gz" "$blobs/$LAYER_DIGEST"

	# Compact JSON by printf: fixed key order, so fixed digests.
	printf '%s' \
		'{"created":"1970-01-01T00:00:00Z",' \
		'"architecture":"'"$arch"'","os":"linux",' \
		'"config":{'"$user_json"'"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin","HOME='"$home"'"],' \
		'"Cmd":'"$cmd_json"',"WorkingDir":"'"$workdir"'"},' \
		'"rootfs":{"type":"layers","diff_ids":["sha256:'"$DIFF_ID"'"]},' \
		'"history":[{"created":"1970-01-01T00:00:00Z","created_by":"'"$created_by"'"}]}' \
		>"$work/config.json"
	CONFIG_DIGEST=$(_sha "$work/config.json")
	local config_size
	config_size=$(_size "$work/config.json")
	mv "$work/config.json" "$blobs/$CONFIG_DIGEST"

	printf '%s' \
		'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",' \
		'"config":{"mediaType":"application/vnd.oci.image.config.v1+json",' \
		'"digest":"sha256:'"$CONFIG_DIGEST"'","size":'"$config_size"'},' \
		'"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip",' \
		'"digest":"sha256:'"$LAYER_DIGEST"'","size":'"$LAYER_SIZE"'}]}' \
		>"$work/manifest.json"
	MANIFEST_DIGEST=$(_sha "$work/manifest.json")
	local manifest_size
	manifest_size=$(_size "$work/manifest.json")
	mv "$work/manifest.json" "$blobs/$MANIFEST_DIGEST"

	printf '%s' \
		'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json",' \
		'"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json",' \
		'"digest":"sha256:'"$MANIFEST_DIGEST"'","size":'"$manifest_size"',' \
		'"platform":{"architecture":"'"$arch"'","os":"linux"},' \
		'"annotations":{"org.opencontainers.image.ref.name":"latest"}}]}' \
		>"$stage/index.json"
	printf '%s' '{"imageLayoutVersion":"1.0.0"}' >"$stage/oci-layout"
	find "$stage" -type d -exec chmod 0755 {} +
	find "$stage" -type f -exec chmod 0644 {} +
	rm -rf "$outdir" "$work"
	mv "$stage" "$outdir"
	echo "  manifest sha256:$MANIFEST_DIGEST"
	echo "  config   sha256:$CONFIG_DIGEST"
	echo "  layer    sha256:$LAYER_DIGEST ($LAYER_SIZE bytes, diff_id sha256:$DIFF_ID)"
}
