#!/bin/bash
# Checkpoint latency of two builds, alternating: a 10 MiB delta (160 files
# of 64 KiB of random bytes, 1.5 s old), five runs each, times from the
# snapshot info. Each run starts its own daemon on a fresh root under /var/tmp.
#
# usage: sudo scripts/bench-capture-workers.sh OLD_BIN_DIR NEW_BIN_DIR   (dirs holding strata, strata-shim)
set -e
run() {
BIN=$1
R=$(mktemp -d /var/tmp/strata-meas-XXXX)
$BIN/strata daemon --root $R/root --socket $R/s.sock --cgroup-parent strata-meas-$$ --warm-pool 0 > $R/log 2>&1 &
D=$!
export STRATA_SOCKET=$R/s.sock
for i in $(seq 50); do [ -S $R/s.sock ] && break; sleep 0.1; done
$BIN/strata image import $IMAGES/busybox --name busybox >/dev/null
ID=$($BIN/strata create --image busybox)
$BIN/strata exec $ID -- sh -c 'mkdir /d; i=0; while [ $i -lt 160 ]; do head -c 65536 /dev/urandom > /d/f$i; i=$((i+1)); done'
sleep 1.5; sync
SNAP=$($BIN/strata checkpoint $ID)
curl -s --unix-socket $R/s.sock http://x/v1/snapshots/$SNAP | python3 -c 'import json,sys; d=json.load(sys.stdin); i=d["info"]; print(sys.argv[1], "total %.1f frozen %.1f blob %.1f worker_cpu %s" % (i["total_ms"], i["frozen_ms"], i["blob_ms"], i.get("worker_cpu_ms")))' $2
$BIN/strata rm $ID
kill $D; wait $D || true
rm -rf $R
}
IMAGES=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/images/out
for k in 1 2 3 4 5; do run "$1" old; run "$2" new; done
