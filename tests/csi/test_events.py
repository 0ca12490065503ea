"""Kubernetes Events on the training pod: a real plugin and real daemons post them to a
stand-in API server that takes Events as the real one does (POST creates, PATCH merges).

The restore is a real one from GCS (the fake-gcs-server emulator): a step is committed and
backed up, the job's RAM data removed (``tierfs csi --gc``), and the job's next pod
published, whose fresh daemon restores the step. A failing backup is the emulator stopped
under a mounted job. Repeats and the API server's own failures are driven in-process, on a
clock of the test's own, since their windows are minutes long.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from tierfs_testing import TIERFS
from tierfs_testing.csi import PodApi
from tierfs_testing.gcs_emulator import GcsEmulator

from tests.helpers import wait_for, write_orbax_step
from tierfs.commands.status import fetch
from tierfs.csi import events, kube
from tierfs.csi.daemons import Daemon, DaemonState
from tierfs.csi.settings import PluginConfig

SECRET = {"secret": "a-peer-secret-of-the-job-0123456789"}
JOB = {"job": "llama", "rank": "0", "capacity": "64M"}
POD_NAME, POD_NAMESPACE, POD_UID = (f"csi.storage.k8s.io/pod.{k}" for k in ("name", "namespace", "uid"))
BACKUP_DELAYED = r"gcs: step \d+ delayed, retrying"


class EventApi(PodApi):
    """The pod stand-in, taking Events too; ``refusing`` answers every Event write with 503."""

    def __init__(self):
        super().__init__()
        self.events: dict[tuple[str, str], dict] = {}
        self.writes: list[tuple[str, str]] = []  # (method, path) of every Event write, in order
        self.refusing = False
        self._lock = threading.Lock()
        api = self

        def reply(h, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            h.send_response(code)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)

        def write(h, method: str) -> None:
            body = json.loads(h.rfile.read(int(h.headers["Content-Length"])))
            parts = h.path.strip("/").split("/")  # api v1 namespaces NS events [NAME]
            with api._lock:
                api.writes.append((method, h.path))
                if api.refusing or parts[4:5] != ["events"]:
                    return reply(h, 503, {"kind": "Status", "code": 503})
                if method == "POST":
                    key = (parts[3], body["metadata"]["name"])
                    if key in api.events or body["metadata"]["namespace"] != parts[3]:
                        return reply(h, 409, {"kind": "Status", "code": 409})
                    api.events[key] = body
                    return reply(h, 201, body)
                assert h.headers["Content-Type"] == "application/merge-patch+json"
                event = api.events.get((parts[3], parts[5]))
                if event is None:
                    return reply(h, 404, {"kind": "Status", "code": 404})
                event.update(body)
                return reply(h, 200, event)

        handler = self.server.RequestHandlerClass
        handler.do_POST = lambda h: write(h, "POST")
        handler.do_PATCH = lambda h: write(h, "PATCH")

    def on(self, pod: dict[str, str], reason: str) -> list[dict]:
        """The Events of ``reason`` on the pod kubelet described with ``pod`` (its volume context)."""
        with self._lock:
            return [
                e
                for e in self.events.values()
                if e["reason"] == reason
                and e["involvedObject"]["name"] == pod[POD_NAME]
                and e["involvedObject"]["namespace"] == pod[POD_NAMESPACE]
            ]


@pytest.fixture
def pod_api():
    api = EventApi()
    yield api
    api.close()


def with_gcs(plugin_factory, tmp_path: Path, bucket: str, *args: str):
    config = tmp_path / "config.yaml"
    config.write_text(f"gcs: gs://{bucket}/tierfs\n")
    return plugin_factory("--config", str(config), "--event-interval", "0.2", *args)


def backed_up(plugin, step: int) -> bool:
    status = fetch(plugin.state_dir / "mnt" / "llama")
    return any(s["step"] == step and s["backed_up"] for s in status["steps"])


def one_event(api: EventApi, pod: dict[str, str], reason: str, timeout: float = 60) -> dict:
    found = wait_for(lambda: api.on(pod, reason), timeout=timeout, what=f"a {reason} Event on the pod")
    assert len(found) == 1, found
    return found[0]


def test_a_restore_from_gcs_is_told_to_the_pod_it_was_for(plugin_factory, tmp_path, gcs_bucket, pod_api):
    plugin = with_gcs(plugin_factory, tmp_path, gcs_bucket)
    first, target = plugin.new_pod(), plugin.target()
    volume = plugin.publish(target, JOB, pod=first, secrets=SECRET)
    write_orbax_step(Path(target), 10, {"shard": os.urandom(1 << 20), "meta.json": b"{}"})
    wait_for(lambda: backed_up(plugin, 10), timeout=60, what="step 10 in GCS")
    plugin.unpublish(volume, target)
    gc = subprocess.run(
        [*TIERFS, "csi", "--state-dir", str(plugin.state_dir), "--ramdisk", str(plugin.ramdisk), "--gc", "llama"],
        capture_output=True,
        text=True,
    )
    assert gc.returncode == 0, gc.stderr

    second = plugin.new_pod()  # the job's next pod: a fresh daemon, an empty RAM tier
    plugin.publish(plugin.target(), JOB, pod=second, secrets=SECRET)
    event = one_event(pod_api, second, "TierfsRestored")
    assert event["type"] == "Normal" and event["count"] == 1
    assert event["message"].startswith("restored step 10 from gcs in "), event["message"]
    assert event["message"].endswith(f" s ({(1 << 20) + 2} bytes)"), event["message"]
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "default",
        "name": second[POD_NAME],
        "uid": second[POD_UID],
    }
    assert event["source"] == {"component": "tierfs-csi", "host": "node-a"}
    assert event["metadata"]["namespace"] == "default" and event["firstTimestamp"] == event["lastTimestamp"]
    assert pod_api.on(first, "TierfsRestored") == [], "the first pod restored nothing"
    record = json.loads(next((plugin.state_dir / "volumes").glob("*.json")).read_text())
    assert record["pod"] == {"namespace": "default", "name": second[POD_NAME], "uid": second[POD_UID]}


@pytest.mark.expect_log(BACKUP_DELAYED)
def test_a_backup_failing_past_the_threshold_warns_the_pod(plugin_factory, tmp_path, pod_api, monkeypatch):
    with GcsEmulator(tmp_path / "gcs") as emulator:  # of this test alone: it is stopped under the job
        for name, value in emulator.environ().items():
            monkeypatch.setenv(name, value)
        emulator.make_bucket("tierfs-events")
        plugin = with_gcs(plugin_factory, tmp_path, "tierfs-events", "--event-backup-lag", "1s")
        pod, target = plugin.new_pod(), plugin.target()
        plugin.publish(target, JOB, pod=pod, secrets=SECRET)
        emulator.stop()
        write_orbax_step(Path(target), 1, {"shard": os.urandom(1 << 20)})
        event = one_event(pod_api, pod, "TierfsBackupFailing")
    assert event["type"] == "Warning"
    message = event["message"]
    assert message.startswith("the GCS backup of job llama rank 0 (gs://tierfs-events/tierfs/default) is "), message
    assert ("s behind (lane " in message or "is failing for " in message) and "\n" not in message, message


def test_a_nearly_full_ram_tier_warns_the_pod(plugin_factory, pod_api):
    plugin = plugin_factory("--event-interval", "0.2")
    pod, target = plugin.new_pod(), plugin.target()
    plugin.publish(target, {**JOB, "capacity": "16M"}, pod=pod)
    with open(os.path.join(target, "weights"), "wb") as f:
        f.write(os.urandom(15 << 20))
    event = one_event(pod_api, pod, "TierfsCapacityNearlyFull")
    assert event["type"] == "Warning" and "job llama rank 0 is 9" in event["message"], event["message"]


def test_a_refused_start_is_told_to_the_pod_once(plugin, pod_api):
    plugin.publish(plugin.target(), JOB, pod=plugin.new_pod("team-a"))
    other = plugin.new_pod("team-b")
    for _ in range(3):  # kubelet retries a refused publish
        with pytest.raises(grpc.RpcError) as e:
            plugin.publish(plugin.target(), JOB, pod=other)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    event = one_event(pod_api, other, "TierfsStartRefused")
    assert event["type"] == "Warning" and event["count"] == 1
    assert event["message"] == f"tierfs refused the volume: {e.value.details()}"
    assert event["involvedObject"]["namespace"] == event["metadata"]["namespace"] == "team-b"

    # Refusals are posted in order: once a later pod has its Event, the retries above are done with.
    later = plugin.new_pod("team-b")
    with pytest.raises(grpc.RpcError):
        plugin.publish(plugin.target(), JOB, pod=later)
    one_event(pod_api, later, "TierfsStartRefused")
    assert pod_api.on(other, "TierfsStartRefused") == [event] and event["count"] == 1


# -- in-process: repeats, failures, the thread ----------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def pod_context(name: str = "trainer-0", namespace: str = "default") -> dict[str, str]:
    return {POD_NAME: name, POD_NAMESPACE: namespace, POD_UID: "0b7c6c6e-8d0e-4b6f-9d59-3c0d2d1b5a10"}


def test_repeats_are_folded_into_one_event_at_most_every_ten_minutes(pod_api):
    clock, pod = Clock(), {"namespace": "default", "name": "trainer-0", "uid": "u-1"}
    recorder = events.Recorder(kube.KubeClient(pod_api.url), "node-a", clock)
    before = dict(events.POSTED)
    assert recorder.emit(pod, events.CAPACITY_NEARLY_FULL, "90% full")
    clock.now += events.REPEAT_AFTER - 1
    assert recorder.emit(pod, events.CAPACITY_NEARLY_FULL, "95% full")  # folded: nothing sent
    assert [m for m, _ in pod_api.writes] == ["POST"]
    clock.now += 1
    assert recorder.emit(pod, events.CAPACITY_NEARLY_FULL, "97%\nfull")
    assert [m for m, _ in pod_api.writes] == ["POST", "PATCH"]
    (event,) = pod_api.events.values()
    assert event["count"] == 2 and event["message"] == "97% full" and event["lastTimestamp"] != event["firstTimestamp"]
    assert events.POSTED[events.CAPACITY_NEARLY_FULL] == before[events.CAPACITY_NEARLY_FULL] + 2

    assert recorder.emit(pod, events.RESTORED, "restored step 1 from gcs in 1.0 s (1 bytes)")  # another reason
    pod_api.events.clear()  # the API server expired them
    clock.now += events.REPEAT_AFTER
    assert recorder.emit(pod, events.CAPACITY_NEARLY_FULL, "99% full")
    assert [m for m, _ in pod_api.writes] == ["POST", "PATCH", "POST", "PATCH", "POST"]
    assert [e["count"] for e in pod_api.events.values()] == [1]


def test_an_api_server_that_refuses_is_logged_once_a_minute_and_never_raises(pod_api, caplog):
    clock = Clock()
    recorder = events.Recorder(kube.KubeClient(pod_api.url), "node-a", clock)
    pod_api.refusing = True
    with caplog.at_level(logging.DEBUG, logger="tierfs.csi"):
        for i in range(5):
            assert not recorder.emit({"namespace": "default", "name": f"trainer-{i}"}, events.START_REFUSED, "no")
            clock.now += 20
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "HTTP 503" in warnings[0] and "(2 more not posted" in warnings[1], warnings
    pod_api.refusing = False
    assert recorder.emit({"namespace": "default", "name": "trainer-0"}, events.START_REFUSED, "no")
    unreachable = events.Recorder(kube.KubeClient("http://127.0.0.1:9"), "node-a", clock)
    assert not unreachable.emit({"namespace": "default", "name": "trainer-0"}, events.START_REFUSED, "no")


def test_the_watcher_posts_from_its_own_thread_and_stop_joins_it(pod_api, tmp_path):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "volumes").mkdir()
    cfg = PluginConfig(node_id="node-a", state_dir=tmp_path, ramdisk=tmp_path / "ram", event_interval=0.05)
    watcher = events.EventWatcher(type("V", (), {"state_dir": tmp_path})(), cfg, kube.KubeClient(pod_api.url))
    watcher.start()
    try:
        watcher.refused(pod_context(), "volume attribute capacity: invalid size")
        watcher.refused({POD_NAME: "../x", POD_NAMESPACE: "default"}, "ignored: no valid pod")
        (event,) = wait_for(lambda: list(pod_api.events.values()), timeout=10, what="the refusal's Event")
        assert event["reason"] == "TierfsStartRefused"
        assert event["message"] == "tierfs refused the volume: volume attribute capacity: invalid size"
    finally:
        watcher.stop()
    assert not any(t.name == "csi-events" for t in threading.enumerate())
    watcher.stop()  # twice: nothing left to stop


def test_backup_lag_counts_beyond_the_backup_interval(pod_api, tmp_path):
    cfg = PluginConfig(node_id="node-a", state_dir=tmp_path, ramdisk=tmp_path / "ram", event_backup_lag=60)
    watcher = events.EventWatcher(type("V", (), {"state_dir": tmp_path})(), cfg, kube.KubeClient(pod_api.url))
    daemon = Daemon("llama", 0, tmp_path / "mnt" / "llama", ({"namespace": "default", "name": "trainer-0"},))

    def look(state: str, lag: float, interval: float = 0.0) -> list[dict]:
        lane = {"state": state, "error": None, "lag_s": lag, "backup_interval_s": interval, "url": "gs://b/p"}
        watcher.check([DaemonState(daemon, {"gcs": lane, "tiers": {"ram": {"used": 0, "capacity": 1}}})])
        return [e for e in pod_api.events.values() if e["reason"] == "TierfsBackupFailing"]

    assert look("working", 3000, interval=3600) == [], "a backup every hour lags by up to an hour"
    assert look("idle", 59) == []
    (event,) = look("working", 61)
    assert "is 61 s behind (lane working)" in event["message"], event["message"]
