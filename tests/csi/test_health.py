"""Two healths: the plugin's (Identity.Probe: can it serve new volumes?) and each job's
daemon (``daemons_report``: serving or sick, and why). A sick job must not make the
plugin unready; a plugin that cannot publish must say so, and why.

The plugin's own troubles are made without breaking the machine: its state directory
turned read-only by a read-only bind mount over it, a FUSE device path that does not
exist, a lock held by another open file, an executable that is not there.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from tierfs_testing import crash

from tests.conftest import tierfs
from tests.csi.test_node import JOB, registered
from tests.helpers import wait_for
from tierfs.core import mounts
from tierfs.csi import csi_pb2 as pb
from tierfs.csi import health, identity
from tierfs.csi.daemons import Daemon, DaemonState, poll
from tierfs.csi.records import write_json
from tierfs.csi.rpc import stub
from tierfs.csi.settings import PluginConfig

POD_NAME, POD_NAMESPACE, POD_UID = (f"csi.storage.k8s.io/pod.{k}" for k in ("name", "namespace", "uid"))


def ready(plugin) -> bool:
    reply = plugin.call("Identity", "Probe", pb.ProbeRequest())
    assert reply.HasField("ready"), "a plugin that checks says so"
    return reply.ready.value


@pytest.fixture
def config(tmp_path) -> PluginConfig:
    (tmp_path / "state").mkdir()
    return PluginConfig(node_id="node-a", state_dir=tmp_path / "state", ramdisk=tmp_path / "ram")


# -- the plugin's own --------------------------------------------------------------------------


def test_a_sick_job_leaves_the_plugin_ready_and_shows_in_the_report(plugin):
    assert ready(plugin)
    pod, target = plugin.new_pod(), plugin.target()
    plugin.publish(target, JOB, pod=pod)
    view = SimpleNamespace(state_dir=plugin.state_dir)
    identity_of = {"namespace": "default", "name": pod[POD_NAME], "uid": pod[POD_UID]}
    assert health.daemons_report(view) == [
        {"job": "llama", "rank": 0, "pod": identity_of, "pods": [identity_of], "state": "serving", "why": None}
    ]

    crash(registered(plugin, "llama"))  # keeper and daemon: the pod's mount is dead
    wait_for(lambda: mounts.is_dead(target), timeout=20, what="the daemon to die")
    (report,) = health.daemons_report(view)
    assert report["state"] == "sick" and report["pod"] == identity_of
    assert report["why"].startswith("cannot reach the tierfs daemon at "), report["why"]
    assert ready(plugin), "one job's daemon is its job's trouble, not the plugin's"


def test_a_read_only_state_directory_makes_the_plugin_unready_until_it_is_writable(plugin):
    assert ready(plugin)
    state = str(plugin.state_dir)
    subprocess.run(["mount", "--bind", state, state], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", state], check=True)
        assert not ready(plugin)
        # kubelet's two exec probes: alive (no restart, which would not help), not ready.
        endpoint = f"--endpoint=unix://{plugin.socket}"
        assert tierfs("csi", "--probe", endpoint).returncode == 0
        refused = tierfs("csi", "--ready", endpoint, check=False)
        assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0
        assert "cannot serve new volumes" in refused.stderr
        wait_for(
            lambda: (
                f"not ready to serve volumes: the state directory {state} is not writable: "
                "Read-only file system" in plugin.log()
            ),
            timeout=10,
            what="the reason in the plugin's log",
        )
    finally:
        subprocess.run(["umount", state], check=True)
    assert ready(plugin)
    assert tierfs("csi", "--ready", f"--endpoint=unix://{plugin.socket}").returncode == 0
    wait_for(lambda: "ready to serve volumes again" in plugin.log(), timeout=10, what="the recovery in the log")


def test_probe_without_a_fuse_device_is_not_ready_and_logs_why(config, tmp_path, monkeypatch, caplog):
    sock = tmp_path / "identity.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((identity.handler(config),))
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            probe = stub(channel, "Identity", "Probe")
            assert probe(pb.ProbeRequest(), timeout=10).ready.value
            monkeypatch.setattr(health, "FUSE_DEVICE", tmp_path / "no-fuse")
            with caplog.at_level(logging.INFO, logger="tierfs.csi"):
                assert not probe(pb.ProbeRequest(), timeout=10).ready.value
                assert not probe(pb.ProbeRequest(), timeout=10).ready.value
            said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert said == [
                f"not ready to serve volumes: cannot open {tmp_path / 'no-fuse'}: No such file or "
                "directory; no FUSE mount can be made (does the container have it?)"
            ], said
            monkeypatch.undo()
            assert probe(pb.ProbeRequest(), timeout=10).ready.value
    finally:
        server.stop(grace=None)


def test_can_serve_names_what_keeps_the_plugin_from_serving(config, tmp_path):
    assert health.can_serve(config) == (True, health.READY)
    assert not (config.ramdisk).exists(), "the first daemon makes the ramdisk: its absence is no problem"

    gone = replace(config, state_dir=tmp_path / "nowhere")
    assert health.can_serve(gone) == (
        False,
        f"the state directory {tmp_path / 'nowhere'} is not writable: No such file or directory",
    )
    (tmp_path / "ram").write_text("a file")
    ok, why = health.can_serve(config)
    assert not ok and why == f"the ramdisk {config.ramdisk} is not a directory"
    (tmp_path / "ram").unlink()
    ok, why = health.can_serve(replace(config, tierfs=(str(tmp_path / "no-python"), "-m", "tierfs")))
    assert not ok and why.startswith(f"cannot start daemons: {tmp_path / 'no-python'} ")
    ok, why = health.can_serve(config, fuse_device=tmp_path / "no-fuse")
    assert not ok and why.startswith(f"cannot open {tmp_path / 'no-fuse'}: ")

    fd = os.open(config.state_dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)  # a stuck holder of the node lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        ok, why = health.can_serve(config)
        assert not ok and why.startswith(f"the node-wide lock {config.state_dir / 'lock'} stayed taken for "), why
    finally:
        os.close(fd)
    assert health.can_serve(config) == (True, health.READY)


# -- the jobs' daemons -------------------------------------------------------------------------


def test_a_job_whose_daemon_is_not_mounted_is_sick(config):
    for sub in ("jobs", "volumes"):
        (config.state_dir / sub).mkdir()
    write_json(config.state_dir / "jobs" / "gpt.json", {"job": "gpt", "rank": 3, "namespace": "ml", "options": {}})
    write_json(config.state_dir / "volumes" / "v.json", {"job": "gpt", "rank": 3, "target": "/t", "read_only": False})
    (state,) = poll(config)
    assert state.status is None and state.error == f"job gpt is not mounted at {config.state_dir / 'mnt' / 'gpt'}"
    assert state.daemon.pods == () and state.pod is None, "an older plugin's record names no pod"
    assert health.daemons_report(config) == [
        {"job": "gpt", "rank": 3, "pod": None, "pods": [], "state": "sick", "why": state.error}
    ]


@pytest.mark.parametrize(
    "status, why",
    [
        ({"lanes": ["peers", "gcs"], "peers": {"state": "ok"}, "gcs": {"state": "working", "error": None}}, None),
        (
            {"lanes": ["peers", "gcs"], "gcs": {"state": "unavailable", "error": "TierUnavailable: 503"}},
            "its gcs lane is unavailable: TierUnavailable: 503",
        ),
        ({"lanes": ["disk"], "disk": {"state": "failing", "error": None}}, "its disk lane is failing"),
        (
            {
                "lanes": [],
                "restored": {
                    "step": 7,
                    "state": "on demand",
                    "chunks_failing": 2,
                    "error": "chunk x is on no reachable tier",
                },
            },
            "its restore of step 7 is failing: chunk x is on no reachable tier",
        ),
        ({"lanes": [], "restored": {"step": 7, "state": "done", "chunks_failing": 0, "error": None}}, None),
    ],
)
def test_a_lane_in_error_or_a_failing_restore_is_sick(status, why):
    daemon = Daemon("gpt", 0, Path("/nowhere"))
    assert health.sick_because(DaemonState(daemon, status)) == why
