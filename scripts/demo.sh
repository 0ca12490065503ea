#!/usr/bin/env bash
# Set everything up, then run the demo: a volume on a RAM tier; a checkpoint written,
# committed by rename and checked; the daemon restarted cleanly and after kill -9; the
# checkpoint is still there, byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

base=$(mktemp -d /dev/shm/tierfs-demo.XXXXXX)
export TIERFS_RAMDISK=$base/ram TIERFS_JOB=demo TIERFS_RANK=0 TIERFS_CAPACITY=2G
mnt=$base/mnt
mkdir -p "$mnt"
tierfs=.venv/bin/tierfs
cleanup() {
    grep -q " $mnt fuse.tierfs " /proc/mounts && $tierfs unmount "$mnt" || true
    rm -rf "$base"
}
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "mount $mnt (RAM tier in $TIERFS_RAMDISK)"
$tierfs mount "$mnt"

step "write checkpoint step 100 (8 shards x 32 MiB) as Orbax does, then commit it by rename"
mkdir "$mnt/100.orbax-checkpoint-tmp"
for i in $(seq 0 7); do
    head -c 32M /dev/urandom > "$mnt/100.orbax-checkpoint-tmp/shard-$i"
done
echo '{"step": 100}' > "$mnt/100.orbax-checkpoint-tmp/_CHECKPOINT_METADATA"
mv "$mnt/100.orbax-checkpoint-tmp" "$mnt/100"
(cd "$mnt/100" && sha256sum * > "$base/sums")
ls -l "$mnt/100"
$tierfs status "$mnt"

step "unmount and mount again: the RAM tier keeps everything"
$tierfs unmount "$mnt"
$tierfs mount "$mnt"
(cd "$mnt/100" && sha256sum --quiet -c "$base/sums") && echo "all shards verified"

step "kill -9 the daemon: the mount goes dead; mount again recovers it"
pid=$($tierfs status "$mnt" --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
kill -9 "$pid"
while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
ls "$mnt" 2>&1 | head -1 || true
$tierfs mount "$mnt"
(cd "$mnt/100" && sha256sum --quiet -c "$base/sums") && echo "all shards verified after the crash"
$tierfs status "$mnt"

step "done"
