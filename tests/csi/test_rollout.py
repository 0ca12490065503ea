"""A rollout or a crash of the plugin's container never reaches a pod's open files.

Containers are stood in for by cgroups (v2): a plugin runs in a cgroup of its own, and its
container's end is ``cgroup.kill``, which ends every process in it at once, as a container
runtime does. Keepers live in the ``--keeper-cgroup`` outside it. A pod is a process in a
mount namespace of its own, private propagation, with the target bind-mounted as kubelet
does it; it holds files open and opens new ones throughout.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from tierfs_testing.csi import Plugin

from tests.fuse.users import PYTHON
from tests.helpers import wait_for
from tierfs.core import mounts

JOB = {"job": "llama", "rank": "0", "capacity": "64M"}
POD = r"""
import os, sys, time
root, stop = sys.argv[1], sys.argv[2]
held = os.open(os.path.join(root, "held.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
reader = os.open(os.path.join(root, "held.log"), os.O_RDONLY)
written = b""
i = 0
while not os.path.exists(stop):
    line = b"%08d\n" % i
    os.write(held, line)
    written += line
    if os.pread(reader, len(written) + 1, 0) != written:
        sys.exit(f"held file differs after line {i}")
    path = os.path.join(root, f"new-{i}")
    with open(path, "wb") as f:
        f.write(line * 100)
    with open(path, "rb") as f:
        if f.read() != line * 100:
            sys.exit(f"new file {i} differs")
    os.unlink(path)
    print(i, flush=True)
    i += 1
    time.sleep(0.005)
"""


def cgroup2_root() -> Path | None:
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if fields[2] == "cgroup2" and os.access(fields[1], os.W_OK):
                return Path(fields[1])
    return None


class Containers:
    """cgroups standing in for containers; every process in them ended and each removed at the end."""

    def __init__(self, root: Path):
        self.root = root / f"tierfs-test-{uuid.uuid4().hex[:8]}"
        self.root.mkdir()

    def new(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(exist_ok=True)
        return path

    def kill(self, cgroup: Path) -> None:
        """What a container's end does to the processes in it."""
        for sub in sorted(cgroup.rglob("cgroup.kill"), key=lambda p: -len(p.parts)):
            sub.write_text("1")
        wait_for(
            lambda: not any(p.read_text().strip() for p in cgroup.rglob("cgroup.procs")),
            timeout=30,
            what=f"every process of {cgroup.name} to end",
        )

    def close(self) -> None:
        self.kill(self.root)
        for sub in sorted(self.root.rglob("*/"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                sub.rmdir()
        self.root.rmdir()


@pytest.fixture
def containers():
    root = cgroup2_root()
    if root is None:
        pytest.skip("needs a writable cgroup v2 hierarchy to stand in for containers")
    c = Containers(root)
    try:
        yield c
    finally:
        c.close()


def start_in(plugin: Plugin, cgroup: Path) -> None:
    """Start the plugin as a container's process: in ``cgroup``, listening on a fresh socket."""
    plugin.socket.unlink(missing_ok=True)
    plugin.preexec = lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    plugin.start()


def keepers_of(plugin: Plugin) -> set[int]:
    return {(mounts.Registration(p).read() or {}).get("keeper") for p in (plugin.state_dir / "mnt").iterdir()}


@pytest.mark.root
@pytest.mark.expect_log(r"tierfs.keeper: the daemon of .* (was killed|exited)")
def test_rollouts_and_container_crashes_never_reach_a_pods_open_files(shm_dir, pod_api, containers):
    keepers = containers.new("keepers")
    base = shm_dir("tierfs-csi")
    os.chmod(base, 0o755)
    old = Plugin(base, pod_api, ("--keeper-cgroup", str(keepers)))
    new = Plugin(base, pod_api, ("--keeper-cgroup", str(keepers)))
    stop = shm_dir("tierfs-pod") / "stop"
    pod = None
    try:
        start_in(old, containers.new("plugin-1"))
        target = old.target()
        old.publish(target, JOB)
        first_keeper = keepers_of(old)
        pod = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", PYTHON, "-c", POD, target, str(stop)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def goes_on(loops: int = 20) -> None:
            for _ in range(loops):
                assert pod.stdout.readline(), f"the pod failed: {pod.stderr.read()}"

        goes_on()
        # Rollout (maxSurge): the new plugin starts beside the old one and takes every mount over.
        start_in(new, containers.new("plugin-2"))
        assert keepers_of(new).isdisjoint(first_keeper), new.log()
        goes_on()
        containers.kill(containers.root / "plugin-1")  # then the old pod goes
        goes_on()
        # A crash of the plugin's container: the keepers live outside it.
        second_keeper = keepers_of(new)
        containers.kill(containers.root / "plugin-2")
        goes_on()
        assert keepers_of(new) == second_keeper and all(mounts.process_alive(k) for k in second_keeper)
        # Its replacement takes the mounts over as at a rollout, and serves the pod's next calls.
        new.proc = None
        start_in(new, containers.new("plugin-3"))
        goes_on()
        assert keepers_of(new).isdisjoint(second_keeper)
        stop.touch()
        out, err = pod.communicate(timeout=60)
        assert pod.returncode == 0, err
    finally:
        if pod is not None:
            pod.kill()
            pod.wait()
        new.cleanup()
        old.cleanup()
