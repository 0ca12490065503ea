#!/usr/bin/env bash
# Install everything tierfs needs on a Debian/Ubuntu host, idempotently:
# fuse3 and its headers, a virtualenv in .venv with tierfs, its test tools and its test
# scaffolding (testing/, editable), and /usr/local/bin/tierfs (mount.fuse3 looks there for
# `mount -t fuse.tierfs`).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
    echo "setup: run as root (FUSE mounts with allow_other and apt need it)" >&2
    exit 1
fi

need=()
command -v fusermount3 >/dev/null || need+=(fuse3)
command -v pkg-config >/dev/null || need+=(pkg-config)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev)
command -v fio >/dev/null || need+=(fio)
command -v nft >/dev/null || need+=(nftables)  # the fault-schedule tests cut nodes off the network
command -v gcc >/dev/null || need+=(gcc)
command -v setfacl >/dev/null || need+=(acl)  # the ACL conformance tests set ACLs as users would
command -v promtool >/dev/null || need+=(prometheus)  # the monitoring tests scrape real daemons with it
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
    || need+=(python3-dev)
if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
extras=test,frameworks,bench
stamp=.venv/.installed-$(echo "$extras" | cat - pyproject.toml testing/pyproject.toml | sha256sum | cut -c1-16)
if [ ! -e "$stamp" ]; then
    .venv/bin/pip install -q --disable-pip-version-check -e ".[$extras]"
    # The test scaffolding (tierfs_testing: local cluster, GCS emulator, CSI stand-ins, the
    # coordination simulator), a distribution of its own so that the tierfs wheel never has it.
    .venv/bin/pip install -q --disable-pip-version-check -e ./testing
    touch "$stamp"
fi
# Bytecode, as a non-editable install has it: with PYTHONDONTWRITEBYTECODE set (CI images often
# do) every tierfs command and daemon would otherwise compile its modules again on each start.
.venv/bin/python -m compileall -q src/tierfs testing/tierfs_testing >/dev/null
ln -sfn "$PWD/.venv/bin/tierfs" /usr/local/bin/tierfs
