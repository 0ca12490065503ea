"""Tenancy of the CSI node plugin: what a pod can reach of other namespaces' jobs, and of the node.

The plugin runs as root, holds the cluster's GCS credentials and mounts into pods, so
everything a pod puts in its volume's attributes is hostile input. These tests drive the
real plugin over its unix socket (as kubelet does), with real daemons, real bind mounts
and the real GCS emulator; the only stand-in is the Kubernetes API (tests/csi/conftest.py).
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.csi.conftest import plugin, plugin_factory, pod_api  # noqa: F401 (fixtures)
from tierfs import linux

JOB = {"job": "llama", "rank": "0", "capacity": "64M"}


def mount_options(path: str | Path) -> set[str]:
    """The per-mount options (mountinfo's sixth field) of the topmost mount at ``path``."""
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(path):
                found = set(fields[5].split(","))
    assert found is not None, f"nothing is mounted at {path}"
    return found


# -- bind mounts into pods ----------------------------------------------------------------

def test_bind_mounts_into_pods_are_nosuid_and_nodev(plugin):
    writer, reader = plugin.target(), plugin.target()
    plugin.publish(writer, JOB)
    plugin.publish(reader, JOB, readonly=True)
    assert {"rw", "nosuid", "nodev"} <= mount_options(writer)
    assert {"ro", "nosuid", "nodev"} <= mount_options(reader)
    assert "noexec" not in mount_options(writer)  # decided: see docs/kubernetes.md


@pytest.mark.parametrize("read_only", [False, True])
def test_bind_mount_adds_nosuid_nodev_and_keeps_the_source_noexec(small_tmpfs, shm_dir, read_only):
    source = small_tmpfs(1 << 20)  # mounted suid,dev: a bind of it must still be nosuid,nodev
    os.mknod(source / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    target = shm_dir("tierfs-bind")
    linux.bind_mount(str(source), str(target), read_only=read_only)
    try:
        assert {"ro" if read_only else "rw", "nosuid", "nodev"} <= mount_options(target)
        with pytest.raises(PermissionError):
            open(target / "null", "wb")  # nodev: a device node on the volume opens nothing
    finally:
        linux.umount(str(target), linux.MNT_DETACH)
    subprocess.run(["mount", "-o", "remount,noexec", str(source)], check=True)
    linux.bind_mount(str(source), str(target), read_only=read_only)
    try:
        assert {"nosuid", "nodev", "noexec"} <= mount_options(target)
    finally:
        linux.umount(str(target), linux.MNT_DETACH)
