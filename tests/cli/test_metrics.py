"""``tierfs mount --metrics``: one daemon's endpoint, its series, its goodput, and its control socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tierfs_testing import free_port

from tests.conftest import tierfs
from tests.prometheus import promtool_check_metrics
from tierfs.core import mounts


def samples(address: str) -> dict[tuple, float]:
    """Every sample the endpoint serves: (name, sorted labels without job and rank) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    promtool_check_metrics(text)
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("job", "rank")))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def status(mountpoint) -> dict:
    return json.loads(tierfs("status", mountpoint, "--json").stdout)


def commit_step(mountpoint, step: int, size: int = 1 << 20) -> None:
    d = mountpoint / "ckpt" / str(step)
    d.mkdir(parents=True)
    (d / "weights").write_bytes(os.urandom(size))
    tierfs("commit", d, "--step", str(step))


def test_a_mount_serves_its_series_and_status_names_the_endpoint(volumes):
    address = f"127.0.0.1:{free_port()}"
    v = volumes(job="metered", rank=3, nodes=4, capacity="64M", data_path="daemon", metrics=address)
    for step in (1, 2, 3):
        commit_step(v.mountpoint, step)
        time.sleep(0.05)  # steps a little apart: the interval between them is what goodput measures
    (v.mountpoint / "ckpt" / "1" / "weights").read_bytes()
    got = samples(address)
    s = status(v.mountpoint)
    assert s["metrics"] == f"http://{address}/metrics"
    assert got[("tierfs_steps_committed_total", ())] == 3
    assert got[("tierfs_newest_step", (("tier", "ram"),))] == 3
    assert got[("tierfs_ram_capacity_bytes", ())] == 64 << 20
    assert (
        got[("tierfs_info", (("data_path", "daemon"), ("engine", s["fuse"]["engine"]), ("version", s["version"])))] == 1
    )
    # Every byte crossed the daemon: the request counts and byte counters see them.
    assert got[("tierfs_fuse_written_bytes_total", ())] == 3 << 20
    assert got[("tierfs_fuse_read_bytes_total", ())] >= 1 << 20
    assert got[("tierfs_fuse_request_duration_seconds_count", (("operation", "create"),))] >= 3
    assert got[("tierfs_fuse_request_duration_seconds_count", (("operation", "write"),))] >= 3
    assert (
        got[("tierfs_fuse_request_duration_seconds_bucket", (("le", "+Inf"), ("operation", "write")))]
        == got[("tierfs_fuse_request_duration_seconds_count", (("operation", "write"),))]
    )
    # Goodput from what it saw: three commits give an interval and a write window each.
    g = s["goodput"]
    assert g["interval_s"] is not None and g["interval_s"] > 0
    assert g["cost_s"] is not None and 0 <= g["cost_s"] < 60
    assert got[("tierfs_checkpoint_interval_seconds", ())] == pytest.approx(g["interval_s"], abs=0.01)
    assert s["failures"] == 0 and got[("tierfs_failures_total", ())] == 0


@pytest.mark.expect_log("cannot serve metrics on 127.0.0.1:[0-9]+ .Address already in use")
def test_a_taken_metrics_port_refuses_the_mount_in_one_line(volumes, shm_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        mp = shm_dir("tierfs-mnt-busy")
        proc = tierfs(
            "mount", mp, "--ramdisk", volumes.ramdisk, "--job", "busy", "--metrics", f"127.0.0.1:{port}", check=False
        )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and f"cannot serve metrics on 127.0.0.1:{port}" in proc.stderr
    assert mounts.find_mount(mp) is None


@pytest.mark.parametrize("value", ["10s", "soon"])
def test_a_bad_mtbf_is_refused_in_one_line(volumes, shm_dir, value):
    proc = tierfs("mount", shm_dir("tierfs-mnt-mtbf"), "--ramdisk", volumes.ramdisk, "--mtbf", value, check=False)
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and "mtbf" in proc.stderr


def test_an_asker_that_leaves_early_costs_the_daemon_nothing(volume):
    """A scrape that times out on a slow daemon closes its socket before the answer comes."""
    registration = mounts.Registration(volume.mountpoint)
    pid = registration.read()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(os.fspath(registration.socket_path))
            s.sendall(b'{"op": "metrics"}\n')
    finally:
        os.kill(pid, signal.SIGCONT)
    assert status(volume.mountpoint)["pid"] == pid
    assert registration.read()["pid"] == pid, "the daemon kept serving: no successor was needed"
