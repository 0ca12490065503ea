"""A local multi-node cluster: N real tierfs daemons, one per loopback address.

Node i listens on 127.0.0.(2+i) with its own ramdisk and mountpoint under one tmpfs
directory, and lists every other node as a peer; all share one job and secret. A node can
be killed (-9), have its RAM wiped, and come back on the same address and port, which is
exactly what losing and replacing a machine looks like to the others. Used by the
demo, the benchmarks and the multi-node tests.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.commands.status import fetch
from tierfs.core import mounts
from tierfs.core.keys import new_secret
from tierfs_testing import TIERFS, crash, free_port, unmount_all_beneath


@dataclass
class Node:
    index: int
    host: str
    port: int
    ramdisk: Path
    mountpoint: Path
    pid: int | None = None
    keeper: int | None = None  # the process that holds its FUSE connection and restarts its daemon
    environ: dict[str, str] = field(default_factory=dict)  # its own variables (a GCS endpoint of its own)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


class LocalCluster:
    def __init__(self, base: Path, nodes: int, job: str = "job", **options):
        self.base, self.job, self.options = base, job, options
        self.secret = new_secret()
        self.nodes = []
        for i in range(nodes):
            host = f"127.0.0.{2 + i}"
            node = Node(i, host, free_port(host), base / f"node-{i}" / "ram", base / f"node-{i}" / "mnt")
            node.mountpoint.mkdir(parents=True)
            node.ramdisk.mkdir(parents=True)
            self.nodes.append(node)

    def env(self, i: int | None = None) -> dict:
        """The environment of a command; with ``i``, node i's daemon's (its own ``environ`` added)."""
        own = self.nodes[i].environ if i is not None else {}
        return {**os.environ, **own, "TIERFS_SECRET": self.secret}

    def tierfs(
        self, *args, check: bool = True, timeout: float = 120, node: int | None = None
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [*TIERFS, *map(str, args)], capture_output=True, text=True, env=self.env(node), timeout=timeout
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"tierfs {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def mount_args(self, i: int, rank: int | None = None, **extra) -> list[str]:
        node = self.nodes[i]
        peers = ",".join(n.address for n in self.nodes)  # a node drops its own address
        args = [
            "mount",
            node.mountpoint,
            "--ramdisk",
            node.ramdisk,
            "--job",
            self.job,
            "--rank",
            str(i if rank is None else rank),
            "--nodes",
            str(len(self.nodes)),
            "--listen",
            node.address,
            "--peers",
            peers,
        ]
        for key, value in {**self.options, **extra}.items():
            if value is not None:
                args += [f"--{key.replace('_', '-')}", str(value)]
        return args

    def start(self, i: int, rank: int | None = None, check: bool = True, **extra) -> subprocess.CompletedProcess:
        proc = self.tierfs(*self.mount_args(i, rank, **extra), check=check, node=i)
        if proc.returncode == 0:
            self.refresh(i)
        return proc

    def refresh(self, i: int) -> None:
        """Learn node i's daemon and keeper from its registration (two file reads, no request)."""
        info = mounts.Registration(self.nodes[i].mountpoint).read() or {}
        self.nodes[i].pid, self.nodes[i].keeper = info.get("pid"), info.get("keeper")

    def start_all(self, **extra) -> None:
        """Start every stopped node at once, as a restarted job does, and wait until all are mounted.

        Starting them together matters: each start waits for its peers' answers before it
        chooses the step to restore.
        """
        todo = [i for i, n in enumerate(self.nodes) if n.pid is None]
        procs = {
            i: subprocess.Popen(
                [*TIERFS, *map(str, self.mount_args(i, **extra))],
                env=self.env(i),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in todo
        }
        failures = []
        for i, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                failures.append(f"node {i}: {err.strip()}")
            else:
                self.refresh(i)
        if failures:
            raise AssertionError("; ".join(failures))

    def kill_all(self) -> None:
        for i in range(len(self.nodes)):
            self.kill(i)

    def status(self, i: int) -> dict:
        """Node i's ``tierfs status``, asked over its control socket from this process: polling
        it through the CLI started an interpreter per poll, on the cores the daemons need."""
        return fetch(self.nodes[i].mountpoint)

    def wait_safe(self, i: int, step: int, timeout: float = 60) -> dict:
        """Wait until node i's current version of ``step`` is on a peer and backed up; its state.

        Each commit into a step bumps its version, so both tiers must hold the current one,
        not an earlier commit of the same step.
        """
        deadline = time.monotonic() + timeout
        while True:
            states = {s["step"]: s for s in self.status(i)["steps"]}
            s = states.get(step)
            replicas = (s or {}).get("replicas") or {}
            if s and s["backed_up"] and replicas.get("version") == s["version"] and replicas.get("peers"):
                return s
            assert time.monotonic() < deadline, f"step {step} not replicated and backed up: {states}"
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """The node crashes: kill -9 its keeper and its daemon, wait until both are gone (its mount goes dead)."""
        node = self.nodes[i]
        if node.pid is None:
            return
        crash({"keeper": node.keeper, "pid": node.pid})
        node.pid = node.keeper = None

    def wipe(self, i: int) -> None:
        """The node's RAM is lost: everything of the job on its ramdisk goes."""
        unmount_all_beneath(self.nodes[i].ramdisk / self.job)
        shutil.rmtree(self.nodes[i].ramdisk / self.job, ignore_errors=True)

    def unmount(self, i: int) -> None:
        self.tierfs("unmount", self.nodes[i].mountpoint, check=False)
        self.nodes[i].pid = None

    def close(self) -> None:
        """Unmount every node and stop every daemon this cluster started; remove its files."""
        for node in self.nodes:
            subprocess.run([*TIERFS, "unmount", str(node.mountpoint)], capture_output=True, env=self.env())
            subprocess.run(["umount", "-l", str(node.mountpoint)], capture_output=True)
            if node.pid is not None:
                crash({"keeper": node.keeper, "pid": node.pid})
        unmount_all_beneath(self.base)
        shutil.rmtree(self.base, ignore_errors=True)
