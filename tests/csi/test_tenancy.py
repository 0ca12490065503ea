"""No pod can stall the node, and every pod attribute is under the admin's ceilings.

Real plugin, real daemons, real mounts. A daemon's slow start is a real one: a job whose
peers never answer (a listener that takes connections and says nothing, as a peer whose
process hangs does) waits for them before it mounts, until it declares them down (some
13 s) or its ``restore-wait`` ends. Under one node-wide lock, 20 such starts took the node
for minutes; now the node must go on serving every other job and the liveness probe.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from tierfs_testing import TIERFS
from tierfs_testing.csi import Plugin

from tests.conftest import tierfs
from tests.helpers import wait_for
from tierfs.core import mounts
from tierfs.csi import csi_pb2 as pb

SECRET = {"secret": "a-peer-secret-of-the-job-0123456789"}
WHERE = "ConfigMap tierfs-config"
SLOW_JOBS = 20
SLOW_WAIT = 60  # restore-wait of each slow daemon; it declares its silent peer down and mounts after ~13 s
FAST = 1.0  # seconds the probe and another job's calls may take while the slow ones start
SILENT = r"peer 127\.0\.0\.1:\d+ does not answer yet"  # what a slow job's daemon says once mounted


# -- helpers -------------------------------------------------------------------------------


def with_config(plugin_factory, tmp_path: Path, text: str, *args: str) -> Plugin:
    config = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(text)
    return plugin_factory("--config", str(config), *args)


def refused(plugin: Plugin, attrs: dict[str, str], code=grpc.StatusCode.INVALID_ARGUMENT, **kw) -> str:
    """Publish ``attrs``; assert one line with ``code``, and that nothing was started; the line."""
    target = plugin.target()
    jobs_before = sorted(p.name for p in (plugin.state_dir / "jobs").iterdir())
    with pytest.raises(grpc.RpcError) as e:
        plugin.publish(target, attrs, **kw)
    details = e.value.details()
    assert e.value.code() == code, (e.value.code(), details)
    assert "\n" not in details and "Traceback" not in details, details
    assert not os.path.exists(target), "a refused publish creates nothing"
    assert sorted(p.name for p in (plugin.state_dir / "jobs").iterdir()) == jobs_before
    return details


def mounted(plugin: Plugin, attrs: dict[str, str], **kw) -> tuple[str, str]:
    target = plugin.target()
    volume = plugin.publish(target, attrs, **kw)
    with open(os.path.join(target, "ok"), "w") as f:
        f.write("written")
    return volume, target


def job_options(plugin: Plugin, job: str) -> dict[str, str]:
    return json.loads((plugin.state_dir / "jobs" / f"{job}.json").read_text())["options"]


def timed(call) -> float:
    start = time.monotonic()
    call()
    return time.monotonic() - start


class SilentPeers:
    """Peers that take every connection and never say a word: a daemon waits for them."""

    def __init__(self, count: int):
        self.listeners = []
        self.connections: list[list[socket.socket]] = []
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            self.listeners.append(s)
            self.connections.append([])
        self.threads = [threading.Thread(target=self._accept, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.listeners[i].getsockname()[1]}"

    def reached(self) -> int:
        """How many of the peers some daemon has connected to."""
        return sum(1 for c in self.connections if c)

    def _accept(self, i: int) -> None:
        while True:
            try:
                conn, _ = self.listeners[i].accept()
            except OSError:
                return
            self.connections[i].append(conn)

    def close(self) -> None:
        for s in self.listeners:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes the accept() that close() alone would leave waiting
            except OSError:
                pass
            s.close()
        for t in self.threads:
            t.join(timeout=10)
        for conns in self.connections:
            for c in conns:
                c.close()


def free_ports(count: int) -> list[int]:
    """Distinct ports nobody listens on at 127.0.0.1 right now (held open until all are chosen)."""
    held = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
    ports = [s.getsockname()[1] for s in held]
    for s in held:
        s.close()
    return ports


@contextmanager
def slow_publishes(plugin: Plugin, count: int, wait_s: int = SLOW_WAIT) -> Iterator[list[Future]]:
    """``count`` jobs published at once whose daemons wait ``wait_s`` for silent peers.

    Yields once every daemon is waiting (each has reached its peer); on the way out, even
    after a failure, waits for every publish to end, so that no daemon mounts after the test.
    """
    peers, ports = SilentPeers(count), free_ports(count)
    pool = ThreadPoolExecutor(max_workers=count)
    calls = [
        pool.submit(
            plugin.publish,
            plugin.target(),
            {
                "job": f"slow-{i}",
                "rank": "0",
                "nodes": "2",
                "capacity": "16M",
                "peers": peers.address(i),
                "listen": f":{ports[i]}",
                "restore-wait": f"{wait_s}s",
            },
            secrets=SECRET,
        )
        for i in range(count)
    ]
    try:
        wait_for(
            lambda: peers.reached() + sum(c.done() for c in calls) >= count,
            timeout=60,
            what="every slow daemon to reach its silent peer",
        )
        yield calls
    finally:
        wait(calls, timeout=3 * wait_s + 120)
        pool.shutdown(wait=False)
        peers.close()


# -- GCS needs the job's secret --------------------------------------------------------------


@pytest.mark.expect_log("neither encrypted nor authenticated without the job's secret")
def test_gcs_without_a_secret_is_refused_unless_the_admin_allows_it(plugin_factory, tmp_path, gcs_bucket):
    config = f"gcs: gs://{gcs_bucket}/tierfs\n"
    plugin = with_config(plugin_factory, tmp_path, config)
    details = refused(plugin, {"job": "open", "rank": "0", "capacity": "16M"})
    assert details.startswith(
        f"job open backs up to GCS (gs://{gcs_bucket}/tierfs/default) but its volume has no peer secret"
    ), details
    assert "nodePublishSecretRef" in details and 'allow-unauthenticated-gcs: "true"' in details, details
    mounted(plugin, {"job": "sealed", "rank": "0", "capacity": "16M"}, secrets=SECRET)

    allowing = with_config(plugin_factory, tmp_path, config + 'allow-unauthenticated-gcs: "true"\n')
    _, target = mounted(allowing, {"job": "open", "rank": "0", "capacity": "16M"})
    assert job_options(allowing, "open")["gcs"] == f"gs://{gcs_bucket}/tierfs/default"
    status = json.loads(tierfs("status", allowing.state_dir / "mnt" / "open", "--json").stdout)
    assert status["job"] == "open" and open(os.path.join(target, "ok")).read() == "written"


# -- engine and the tuning attributes --------------------------------------------------------


def test_engine_is_the_admins_unless_allowed(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, "")
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "engine": "pyfuse3"})
    assert details.startswith(
        "volume attribute 'engine' 'pyfuse3' is over the node's ceiling "
        f"allow-pod-engine=false ({WHERE}: pods take the admin's engine=auto)"
    ), details
    mounted(plugin, {"job": "j", "rank": "0", "capacity": "16M", "engine": "auto"})  # the admin's own: fine

    # Allowed to choose the engine, but not the data path: pyfuse3 is the daemon path.
    engines = with_config(plugin_factory, tmp_path, 'allow-pod-engine: "true"\n')
    details = refused(engines, {"job": "j", "rank": "0", "capacity": "16M", "engine": "pyfuse3"})
    assert (
        details.startswith("volume attribute 'engine' 'pyfuse3' serves every byte through the daemon")
        and "allow-pod-data-path=false" in details
    ), details
    mounted(engines, {"job": "j", "rank": "0", "capacity": "16M", "engine": "tierfs"})

    both = with_config(plugin_factory, tmp_path, 'allow-pod-engine: "true"\nallow-pod-data-path: "true"\n')
    mounted(both, {"job": "j", "rank": "0", "capacity": "16M", "engine": "pyfuse3"})
    assert job_options(both, "j")["engine"] == "pyfuse3"


@pytest.mark.parametrize(
    "attrs, config, line",
    [
        (
            {"restore-wait": "11m"},
            "",
            "volume attribute 'restore-wait' '11m' is over the node's ceiling max-restore-wait=10m",
        ),
        (
            {"restore-wait": "45s"},
            "max-restore-wait: 30s\n",
            "volume attribute 'restore-wait' '45s' is over the node's ceiling max-restore-wait=30s",
        ),
        ({"prefetch": "64"}, "", "volume attribute 'prefetch' '64' is over the node's ceiling max-prefetch=32"),
        (
            {"chunk-size": "32M"},
            "",
            "volume attribute 'chunk-size' '32M' is over the node's ceiling max-chunk-size=16M",
        ),
        ({"keep": "11"}, "", "volume attribute 'keep' '11' is over the node's ceiling max-keep=10"),
        (
            {"replicas": "4", "peers": "127.0.0.9:{7420..7424}"},
            "",
            "volume attribute 'replicas' '4' is over the node's ceiling max-replicas=3",
        ),
        (
            {"erasure": "6+4", "peers": "127.0.0.9:{7420..7429}"},
            "",
            "volume attribute 'erasure' (4 parity parts) is over the node's ceiling max-erasure-parity=3",
        ),
        (
            {"peers": "node-{0..4999}.svc:7420"},
            "",
            "volume attribute 'peers' (5000 addresses) is over the node's ceiling max-peers=4096",
        ),
        (
            {"survey-interval": "2s"},
            "",
            "volume attribute 'survey-interval' '2s' is under the node's floor min-survey-interval=10s",
        ),
        (
            {"backup-interval": "5m"},
            "min-backup-interval: 10m\n",
            "volume attribute 'backup-interval' '5m' is under the node's floor min-backup-interval=10m",
        ),
        (
            {"log-level": "debug"},
            "",
            "volume attribute 'log-level' 'debug' is under the node's floor min-log-level=info",
        ),
    ],
)
def test_tuning_past_a_ceiling_is_refused_with_one_line(plugin_factory, tmp_path, attrs, config, line):
    plugin = with_config(plugin_factory, tmp_path, config)
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", **attrs}, secrets=SECRET)
    assert details.startswith(f"{line} ({WHERE}): ask for "), details
    assert details.endswith("or ask the admin to raise the ceiling") or details.endswith("lower the floor")


def test_tuning_within_the_ceilings_mounts_and_unset_values_take_the_ceiling(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, 'max-prefetch: "4"\nmin-log-level: warning\nmax-restore-wait: 30s\n')
    mounted(
        plugin,
        {
            "job": "j",
            "rank": "0",
            "capacity": "16M",
            "restore-wait": "30s",
            "prefetch": "2",
            "keep": "10",
            "survey-interval": "10s",
            "log-level": "error",
        },
    )
    assert job_options(plugin, "j")["prefetch"] == "2" and job_options(plugin, "j")["log-level"] == "error"
    mounted(plugin, {"job": "k", "rank": "0", "capacity": "16M"})  # the daemon's defaults are 8 and info
    assert job_options(plugin, "k")["prefetch"] == "4" and job_options(plugin, "k")["log-level"] == "warning"


# -- no pod stalls the node ------------------------------------------------------------------


@pytest.mark.expect_log(SILENT)
def test_slow_daemon_starts_hold_up_neither_the_probe_nor_other_jobs(plugin_factory, tmp_path):
    plugin = with_config(
        plugin_factory, tmp_path, 'max-jobs-per-node: "32"\nmax-jobs-per-namespace: "32"\nlisten-ports: "1024-65535"\n'
    )
    steady = {"job": "steady", "rank": "0", "capacity": "16M"}
    mounted(plugin, steady)
    with slow_publishes(plugin, SLOW_JOBS) as calls:
        probe = timed(lambda: plugin.call("Identity", "Probe", pb.ProbeRequest()))
        target = plugin.target()
        publish = timed(lambda: plugin.publish(target, steady, volume_id="csi-steady-2"))
        assert open(os.path.join(target, "ok")).read() == "written"  # the job's running daemon, reused
        unpublish = timed(lambda: plugin.unpublish("csi-steady-2", target))
        assert not any(c.done() for c in calls), "a slow start ended before the checks: they prove nothing"
        assert max(probe, publish, unpublish) < FAST, (probe, publish, unpublish)
        # A new job's daemon starts beside the slow ones, not after all of them.
        mounted(plugin, {"job": "late", "rank": "0", "capacity": "16M"})
        assert not all(c.done() for c in calls)
        assert tierfs("csi", "--probe", "--endpoint", f"unix://{plugin.socket}", check=False).returncode == 0
    for c in calls:
        c.result()  # and each slow job mounts in the end
    for i in range(SLOW_JOBS):
        assert mounts.find_mount(plugin.state_dir / "mnt" / f"slow-{i}") is not None


@pytest.mark.expect_log(SILENT)
def test_volume_calls_past_the_limit_are_refused_and_the_probe_answers(plugin_factory, tmp_path):
    """With every volume thread busy, the probe still has threads of its own."""
    plugin = with_config(plugin_factory, tmp_path, 'listen-ports: "1024-65535"\n', "--volume-calls", "2")
    with slow_publishes(plugin, 2, wait_s=8) as calls:
        assert timed(lambda: plugin.call("Identity", "Probe", pb.ProbeRequest())) < FAST
        start = time.monotonic()
        details = refused(plugin, {"job": "third", "rank": "0", "capacity": "16M"}, code=grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - start < FAST and "--volume-calls" in details, details
        assert timed(lambda: plugin.call("Identity", "GetPluginInfo", pb.GetPluginInfoRequest())) < FAST
        assert not any(c.done() for c in calls)
    for c in calls:
        c.result()
    mounted(plugin, {"job": "third", "rank": "0", "capacity": "16M"})  # kubelet's retry, once a thread is free


@pytest.mark.expect_log(SILENT)
def test_a_second_call_on_a_starting_job_is_aborted_and_the_retry_succeeds(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, 'listen-ports: "1024-65535"\n')
    with slow_publishes(plugin, 1, wait_s=10) as calls:
        attrs = {"job": "slow-0", "rank": "0", "nodes": "2", "capacity": "16M"}
        details = refused(plugin, attrs, code=grpc.StatusCode.ABORTED, secrets=SECRET)
        assert details.startswith("job slow-0 on node node-a is busy with another call"), details
        assert not calls[0].done()
    calls[0].result()
    locks = plugin.state_dir / "locks"
    assert (locks.stat().st_mode & 0o777, (locks / "slow-0.lock").stat().st_mode & 0o777) == (0o700, 0o600)


@pytest.mark.expect_log(SILENT)
def test_gc_of_one_job_does_not_wait_for_another_jobs_start(plugin_factory, tmp_path):
    """The per-job locks hold across processes: `tierfs csi --gc` of an idle job is not held
    up by another job's daemon start, and leaves no lock file behind."""
    plugin = with_config(plugin_factory, tmp_path, 'listen-ports: "1024-65535"\n')
    volume, target = mounted(plugin, {"job": "idle", "rank": "0", "capacity": "16M"})
    plugin.unpublish(volume, target)
    gc = [*TIERFS, "csi", "--state-dir", str(plugin.state_dir), "--ramdisk", str(plugin.ramdisk), "--gc", "idle"]
    with slow_publishes(plugin, 1, wait_s=8) as calls:
        proc = subprocess.run(gc, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert not calls[0].done(), "the gc ran after the slow start: it proves nothing"
    calls[0].result()
    assert not (plugin.ramdisk / "idle").exists() and not (plugin.state_dir / "locks" / "idle.lock").exists()
