#!/usr/bin/env bash
# Build libfuse's C example file system `passthrough_hp` (Debian trixie's fuse3 3.17 source,
# which negotiates kernel passthrough) and print the path of the binary. It is the yardstick
# for what a FUSE daemon written in C gets on this kernel and machine:
#
#   hp=$(scripts/libfuse_reference.sh)
#   mkdir -p /dev/shm/hp-src /tmp/hp && "$hp" /dev/shm/hp-src /tmp/hp
#   .venv/bin/python scripts/bench_io.py --files-only --data-paths passthrough --reference hp=/tmp/hp
#   umount /tmp/hp
#
# Needs root (apt) and the package registries; built once into $TIERFS_REFERENCE_DIR
# (default ~/.cache/tierfs/libfuse-reference). Progress goes to stderr, the path to stdout.
set -euo pipefail

dir=${TIERFS_REFERENCE_DIR:-$HOME/.cache/tierfs/libfuse-reference}
version=3.17.2
binary=$dir/fuse3-$version/build/example/passthrough_hp
if [[ -x $binary ]]; then
    echo "$binary"
    exit 0
fi
say() { echo "libfuse_reference: $*" >&2; }
if [[ $(id -u) != 0 ]]; then
    say "error: run as root (it installs a compiler with apt)"
    exit 1
fi

mkdir -p "$dir"
cd "$dir"
if ! grep -rqs '^deb-src .*trixie' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    say "adding Debian trixie's source packages to apt (/etc/apt/sources.list.d/tierfs-deb-src.list)"
    echo "deb-src http://deb.debian.org/debian trixie main" > /etc/apt/sources.list.d/tierfs-deb-src.list
fi
say "installing g++ and pkg-config, fetching fuse3's source"
apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ pkg-config >&2
apt-get source -qq "fuse3=$version*" >&2 || apt-get source -qq fuse3 >&2
if [[ ! -d fuse3-$version ]]; then
    say "error: apt fetched a fuse3 other than $version: $(ls -d fuse3-*/ 2>/dev/null | tr '\n' ' ')"
    exit 1
fi

say "building passthrough_hp (meson and ninja in $dir/venv)"
python3 -m venv venv
venv/bin/pip install -q meson ninja >&2
cd "fuse3-$version"
PATH=$dir/venv/bin:$PATH meson setup build -Dexamples=true -Dutils=false -Dtests=false >&2
PATH=$dir/venv/bin:$PATH ninja -C build example/passthrough_hp >&2
echo "$binary"
