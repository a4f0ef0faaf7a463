#!/usr/bin/env bash
# Install what building, testing and benchmarking Strata needs on a fresh
# Debian 12 (or Ubuntu) host, qemu for the VM lane (scripts/vm-test)
# included. Run as root. Idempotent: a second run installs nothing and does
# not touch the network unless something is missing.
#
# usage: sudo scripts/install-deps.sh
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO_ROOT"

log() { printf '\n==> %s\n' "$*"; }
die() {
	echo "scripts/install-deps.sh: error: $*" >&2
	exit 1
}

[[ $(id -u) -eq 0 ]] || die "must run as root (try: sudo $0)"
command -v apt-get >/dev/null 2>&1 || die "apt-get not found; only Debian 12 and Ubuntu are supported"

if [[ -r /etc/os-release ]]; then
	# shellcheck disable=SC1091
	. /etc/os-release
	case "${ID:-}" in
	debian | ubuntu) ;;
	*) echo "warning: untested distribution '${ID:-unknown}'; trying anyway" >&2 ;;
	esac
fi

export DEBIAN_FRONTEND=noninteractive

PACKAGES=(
	build-essential pkg-config git curl ca-certificates
	busybox-static umoci skopeo runc crun bubblewrap
	hyperfine iproute2 python3 jq tar gzip shellcheck
	qemu-system-x86 xz-utils debootstrap
	docker-registry apache2-utils e2fsprogs socat python3-venv
	postgresql-15 nftables dnsmasq-base iperf3 ethtool
	containerd containernetworking-plugins
)

installed() {
	[[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

missing=()
for pkg in "${PACKAGES[@]}"; do
	installed "$pkg" && continue
	# GitHub's Ubuntu runners ship moby-runc, which conflicts with the distro
	# runc package; any runc binary on the host is good enough.
	if [[ $pkg == runc ]] && command -v runc >/dev/null 2>&1; then
		continue
	fi
	missing+=("$pkg")
done

if [[ ${#missing[@]} -gt 0 ]]; then
	log "apt-get install ${missing[*]}"
	apt-get update
	apt-get install -y --no-install-recommends "${missing[@]}"
	# The tests start their own loopback registries (tests/support/registry.rs);
	# the packaged service, listening on :5000 on every interface, is not wanted.
	if [[ " ${missing[*]} " == *" docker-registry "* ]] && [[ -d /run/systemd/system ]]; then
		log "systemctl disable --now docker-registry.service"
		systemctl disable --now docker-registry.service || true
	fi
	# Likewise the suite starts its own PostgreSQL (tests/support/pg.rs); the
	# cluster Debian creates on install is not used.
	if [[ " ${missing[*]} " == *" postgresql-15 "* ]] && [[ -d /run/systemd/system ]]; then
		log "systemctl disable --now postgresql.service"
		systemctl disable --now postgresql.service || true
	fi
	# And its own containerd (tests/containerd.rs), in a temporary root.
	if [[ " ${missing[*]} " == *" containerd "* ]] && [[ -d /run/systemd/system ]]; then
		log "systemctl disable --now containerd.service"
		systemctl disable --now containerd.service || true
	fi
else
	log "system packages already installed"
fi

# Rust: the workspace needs a newer toolchain than Debian 12 packages, so use
# rustup, but only when no cargo is available at all.
if ! command -v cargo >/dev/null 2>&1 && [[ -x ${CARGO_HOME:-$HOME/.cargo}/bin/cargo ]]; then
	export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi
if command -v cargo >/dev/null 2>&1; then
	log "cargo found: $(command -v cargo) ($(cargo --version))"
else
	log "installing Rust with rustup (https://sh.rustup.rs)"
	curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs |
		sh -s -- -y --no-modify-path --profile minimal --component rustfmt,clippy
	export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
	cargo --version
fi
# scripts/test.sh needs rustfmt and clippy; scripts/build-shim.sh the musl
# target (a static strata-shim; without it the shim is built for glibc).
if command -v rustup >/dev/null 2>&1; then
	have=$(rustup component list --installed 2>/dev/null || true)
	for component in rustfmt clippy; do
		if ! grep -q "^$component" <<<"$have"; then
			log "rustup component add $component"
			rustup component add "$component"
		fi
	done
	musl=$(uname -m)-unknown-linux-musl
	if ! rustup target list --installed 2>/dev/null | grep -qx "$musl"; then
		log "rustup target add $musl"
		rustup target add "$musl" || log "warning: no $musl target; strata-shim will be a glibc build"
	fi
fi

# API fuzzing (scripts/fuzz-api.sh, run by scripts/test.sh): schemathesis
# from PyPI in a venv of its own, pinned to a major version.
FUZZ_VENV=/var/cache/strata-fuzz-venv
if [[ ! -x $FUZZ_VENV/bin/st ]]; then
	log "installing schemathesis into $FUZZ_VENV"
	python3 -m venv "$FUZZ_VENV"
	"$FUZZ_VENV/bin/pip" install -q 'schemathesis>=4,<5'
else
	log "schemathesis found: $FUZZ_VENV/bin/st"
fi

# The E2B JavaScript SDK's test (tests/e2b.rs) needs Node >= 20.18, which
# Debian 12 does not ship (its nodejs is 18). Where the host has none that
# qualifies, take the node binary of the npm registry's `node-linux-<arch>`
# package (the one the `node` npm package installs), with Debian's npm to
# fetch it, into /usr/local/lib/strata-node, linked from /usr/local/bin.
NODE_VERSION=20.20.2
node_ok() {
	command -v node >/dev/null 2>&1 &&
		node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 18) ? 0 : 1)'
}
if node_ok && command -v npm >/dev/null 2>&1; then
	log "node found: $(command -v node) ($(node --version))"
else
	command -v npm >/dev/null 2>&1 || { log "apt-get install npm"; apt-get install -y --no-install-recommends npm; }
	case $(uname -m) in
	x86_64) node_arch=x64 ;;
	aarch64) node_arch=arm64 ;;
	*) node_arch= ;;
	esac
	if [[ -n $node_arch ]]; then
		log "installing node $NODE_VERSION from the npm registry (node-linux-$node_arch)"
		node_tmp=$(mktemp -d)
		(cd "$node_tmp" && npm pack --silent "node-linux-$node_arch@$NODE_VERSION" >/dev/null && tar -xzf ./*.tgz)
		rm -rf /usr/local/lib/strata-node
		mkdir -p /usr/local/lib/strata-node
		cp -a "$node_tmp/package/." /usr/local/lib/strata-node/
		ln -sfn /usr/local/lib/strata-node/bin/node /usr/local/bin/node
		rm -rf "$node_tmp"
		hash -r
		node_ok || log "warning: node $NODE_VERSION did not install; the E2B JS SDK test will check nothing"
	else
		log "warning: no node-linux package for $(uname -m); the E2B JS SDK test will check nothing"
	fi
fi

log "dependencies ready"
