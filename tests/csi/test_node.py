"""The CSI node plugin over its unix socket: the pod lifecycle, the spec's error codes,
idempotency, ranks, a restart of the plugin, and the garbage-collection rule."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import grpc
import pytest
from tierfs_testing import TIERFS, crash
from tierfs_testing.csi import Mode, publish_request

from tests.conftest import tierfs
from tests.helpers import wait_for
from tierfs.core import mounts
from tierfs.csi import DRIVER_NAME
from tierfs.csi import csi_pb2 as pb

JOB = {"job": "llama", "rank": "0", "capacity": "64M"}


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def registered(plugin, job: str) -> dict:
    return mounts.Registration(plugin.state_dir / "mnt" / job).read()


def daemon_pid(plugin, job: str) -> int:
    return registered(plugin, job)["pid"]


def test_identity_names_the_driver_and_offers_no_controller(plugin):
    info = plugin.call("Identity", "GetPluginInfo", pb.GetPluginInfoRequest())
    assert info.name == DRIVER_NAME and info.vendor_version
    assert list(plugin.call("Identity", "GetPluginCapabilities", pb.GetPluginCapabilitiesRequest()).capabilities) == []
    assert plugin.call("Identity", "Probe", pb.ProbeRequest()).ready.value  # tests/csi/test_health.py: when not
    assert plugin.call("Node", "NodeGetInfo", pb.NodeGetInfoRequest()).node_id == "node-a"
    caps = plugin.call("Node", "NodeGetCapabilities", pb.NodeGetCapabilitiesRequest()).capabilities
    rpc = pb.NodeServiceCapability.RPC
    assert {c.rpc.type for c in caps} == {rpc.GET_VOLUME_STATS, rpc.VOLUME_CONDITION}


def test_publish_write_unpublish_republish_keeps_the_data(plugin):
    first = plugin.target()
    vol = plugin.publish(first, JOB)
    with open(os.path.join(first, "step-1.bin"), "wb") as f:
        f.write(b"weights" * 1000)
    pid = daemon_pid(plugin, "llama")
    plugin.unpublish(vol, first)
    assert mounts.find_mount(first) is None and not os.path.exists(first)

    second = plugin.target()  # the job's next pod
    plugin.publish(second, JOB)
    with open(os.path.join(second, "step-1.bin"), "rb") as f:
        assert f.read() == b"weights" * 1000
    assert daemon_pid(plugin, "llama") == pid, "the job's daemon is reused, not restarted"


def test_volume_stats_report_the_volume_and_its_condition(plugin):
    target = plugin.target()
    vol = plugin.publish(target, JOB)
    with open(os.path.join(target, "f"), "wb") as f:
        f.write(os.urandom(3 << 20))
    reply = plugin.call("Node", "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id=vol, volume_path=target))
    usage = {u.unit: u for u in reply.usage}
    assert usage[pb.VolumeUsage.BYTES].total == 64 << 20
    assert usage[pb.VolumeUsage.BYTES].used >= 3 << 20
    assert usage[pb.VolumeUsage.INODES].used >= 1
    assert reply.volume_condition.abnormal is False

    crash(registered(plugin, "llama"))  # keeper and daemon: the mount is dead
    wait_for(lambda: mounts.is_dead(target), timeout=20, what="the daemon to die")
    reply = plugin.call("Node", "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id=vol, volume_path=target))
    assert reply.volume_condition.abnormal and "does not answer" in reply.volume_condition.message


def test_publish_and_unpublish_are_idempotent(plugin):
    target = plugin.target()
    pod = plugin.new_pod()
    vol = plugin.publish(target, JOB, pod=pod)
    plugin.publish(target, JOB, pod=pod, volume_id=vol)  # kubelet retries: same answer
    assert len([m for m in open("/proc/self/mountinfo") if f" {target} " in m]) == 1

    code, details = code_of(lambda: plugin.publish(plugin.target(), JOB, pod=pod, volume_id=vol))
    assert code == grpc.StatusCode.ALREADY_EXISTS and vol in details
    code, _ = code_of(lambda: plugin.publish(target, JOB, pod=pod, volume_id=vol, readonly=True))
    assert code == grpc.StatusCode.ALREADY_EXISTS

    plugin.unpublish(vol, target)
    plugin.unpublish(vol, target)  # already gone: still OK
    plugin.unpublish("csi-never-published", plugin.target())


@pytest.mark.parametrize(
    "change, what",
    [
        (lambda r: r.ClearField("volume_id"), "volume_id is missing"),
        (lambda r: r.ClearField("target_path"), "target_path is missing"),
        (lambda r: r.ClearField("volume_capability"), "volume_capability is missing"),
        (lambda r: r.volume_capability.block.SetInParent(), "block access"),
        (lambda r: r.volume_capability.access_mode.__setattr__("mode", Mode.MULTI_NODE_MULTI_WRITER), "one node"),
        (lambda r: r.volume_capability.mount.mount_flags.append("noatime"), "mount flags"),
        (lambda r: r.volume_context.__delitem__("job"), "'job' is missing"),
        (lambda r: r.volume_context.__setitem__("job", "../etc"), "invalid job id"),
        (lambda r: r.volume_context.__setitem__("colour", "blue"), "unknown volume attribute 'colour'"),
        (lambda r: r.volume_context.__setitem__("ramdisk", "/etc"), "a host path"),
        (lambda r: r.volume_context.__setitem__("capacity", "lots"), "capacity"),
        (lambda r: r.volume_context.__setitem__("rank", "7"), "invalid rank 7"),
        (lambda r: r.volume_context.__setitem__("peers", "127.0.0.9:7420"), "nodePublishSecretRef"),
        (lambda r: r.volume_context.__setitem__("csi.storage.k8s.io/ephemeral", "false"), "ephemeral"),
    ],
)
def test_bad_publish_requests_are_invalid_arguments(plugin, change, what):
    request = publish_request("csi-bad", plugin.target(), {**plugin.new_pod(), **JOB})
    change(request)
    code, details = code_of(lambda: plugin.call("Node", "NodePublishVolume", request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert what in details
    assert (
        not (plugin.state_dir / "mnt" / "llama").exists()
        or mounts.find_mount(plugin.state_dir / "mnt" / "llama") is None
    )


def test_other_node_calls_answer_with_the_spec_codes(plugin):
    code, _ = code_of(
        lambda: plugin.call(
            "Node", "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id="csi-unknown", volume_path="/nowhere")
        )
    )
    assert code == grpc.StatusCode.NOT_FOUND
    code, _ = code_of(lambda: plugin.call("Node", "NodeGetVolumeStats", pb.NodeGetVolumeStatsRequest(volume_id="x")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = code_of(lambda: plugin.call("Node", "NodeUnpublishVolume", pb.NodeUnpublishVolumeRequest(volume_id="x")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    for method, request in (
        ("NodeStageVolume", pb.NodeStageVolumeRequest(volume_id="x")),
        ("NodeUnstageVolume", pb.NodeUnstageVolumeRequest(volume_id="x")),
        ("NodeExpandVolume", pb.NodeExpandVolumeRequest(volume_id="x")),
    ):
        code, _ = code_of(lambda: plugin.call("Node", method, request))
        assert code == grpc.StatusCode.UNIMPLEMENTED, method


def test_read_only_publish_refuses_writes_while_another_pod_writes(plugin):
    writer, reader = plugin.target(), plugin.target()
    plugin.publish(writer, JOB)
    plugin.publish(reader, JOB, readonly=True)
    with open(os.path.join(writer, "a"), "w") as f:
        f.write("x")
    assert open(os.path.join(reader, "a")).read() == "x"
    with pytest.raises(OSError) as e:
        open(os.path.join(reader, "b"), "w")
    assert e.value.errno == 30  # EROFS


def test_rank_comes_from_the_jobset_index_and_sticks_to_the_node(plugin):
    attrs = {"job": "gpt", "nodes": "4", "capacity": "64M", "coordinator": "trainer-0.gpt:1234"}
    # JobSet of 2 Jobs with 2 pods each: Job 1, completion index 1 -> rank 3.
    pod = plugin.new_pod(
        labels={
            "jobset.sigs.k8s.io/job-global-index": "1",
            "jobset.sigs.k8s.io/global-replicas": "2",
            "batch.kubernetes.io/job-completion-index": "1",
        }
    )
    target = plugin.target()
    vol = plugin.publish(target, attrs, pod=pod)
    assert open(os.path.join(target, "jax-init-info.txt")).read() == "3\ntrainer-0.gpt:1234\n"
    plugin.unpublish(vol, target)

    # The job restarts and another pod index lands here: the node keeps rank 3 and its data.
    pod = plugin.new_pod(
        labels={
            "batch.kubernetes.io/job-completion-index": "0",
            "jobset.sigs.k8s.io/job-global-index": "0",
            "jobset.sigs.k8s.io/global-replicas": "2",
        }
    )
    target = plugin.target()
    plugin.publish(target, attrs, pod=pod)
    assert open(os.path.join(target, "jax-init-info.txt")).read().split()[0] == "3"


def test_a_pod_without_an_index_gets_a_clear_error(plugin):
    code, details = code_of(lambda: plugin.publish(plugin.target(), {"job": "gpt", "nodes": "2"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no Job completion index" in details and "attribute 'rank'" in details


def test_jobs_are_kept_apart_by_namespace_and_settings(plugin):
    plugin.publish(plugin.target(), JOB, pod=plugin.new_pod("team-a"))
    code, details = code_of(lambda: plugin.publish(plugin.target(), JOB, pod=plugin.new_pod("team-b")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "team-a" in details
    code, details = code_of(lambda: plugin.publish(plugin.target(), {**JOB, "keep": "5"}, pod=plugin.new_pod("team-a")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "keep" in details


def test_plugin_restart_keeps_mounts_and_restarts_a_dead_daemon(plugin):
    target = plugin.target()
    vol = plugin.publish(target, JOB)
    with open(os.path.join(target, "ckpt"), "w") as f:
        f.write("committed")
    plugin.stop(signal.SIGKILL)
    assert open(os.path.join(target, "ckpt")).read() == "committed", "the pod's mount outlives the plugin"
    plugin.start()
    assert open(os.path.join(target, "ckpt")).read() == "committed"

    # Daemon and keeper die while the plugin is away: the restarted plugin brings the volume back.
    plugin.stop(signal.SIGKILL)
    crash(registered(plugin, "llama"))
    wait_for(lambda: mounts.is_dead(target), timeout=20, what="the daemon to die")
    plugin.start()
    assert open(os.path.join(target, "ckpt")).read() == "committed"
    plugin.unpublish(vol, target)
    assert mounts.find_mount(target) is None


def test_gc_command_waits_for_the_pods_then_removes_the_job(plugin):
    target = plugin.target()
    vol = plugin.publish(target, JOB)
    open(os.path.join(target, "x"), "w").close()
    gc = [*TIERFS, "csi", "--state-dir", str(plugin.state_dir), "--ramdisk", str(plugin.ramdisk), "--gc", "llama"]
    proc = subprocess.run(gc, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "delete its pods first" in proc.stderr
    plugin.unpublish(vol, target)
    proc = subprocess.run(gc, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert not (plugin.ramdisk / "llama").exists()
    assert mounts.find_mount(plugin.state_dir / "mnt" / "llama") is None
    proc = subprocess.run(gc, capture_output=True, text=True)
    assert proc.returncode == 1 and "no data" in proc.stderr


def test_idle_jobs_are_collected_after_gc_after(plugin_factory):
    plugin = plugin_factory("--gc-after", "1s")
    target = plugin.target()
    vol = plugin.publish(target, JOB)
    open(os.path.join(target, "x"), "w").close()
    assert (plugin.ramdisk / "llama").exists()
    plugin.unpublish(vol, target)
    wait_for(lambda: not (plugin.ramdisk / "llama").exists(), timeout=15, what="the idle job to be collected")
    assert mounts.find_mount(plugin.state_dir / "mnt" / "llama") is None
    assert "unused for 1s" in plugin.log()


def test_cluster_defaults_come_from_the_config_file(plugin_factory, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("capacity: 32M\nkeep-local: 2\n")
    plugin = plugin_factory("--config", str(config))
    target = plugin.target()
    vol = plugin.publish(target, {"job": "llama", "rank": "0"})
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize == 32 << 20
    # An edited ConfigMap applies to the job's next pod, without restarting the plugin.
    plugin.unpublish(vol, target)
    config.write_text("capacity: 48M\n")
    target = plugin.target()
    plugin.publish(target, {"job": "llama", "rank": "0"})
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize == 48 << 20
    config.write_text("colour: blue\n")
    proc = tierfs("csi", "--endpoint", "unix:///tmp/x.sock", "--node-id", "n", "--config", str(config), check=False)
    assert proc.returncode == 1 and "unknown option(s) colour" in proc.stderr


def test_plugin_status_reaches_the_job_daemon(plugin):
    target = plugin.target()
    plugin.publish(target, JOB)
    status = json.loads(tierfs("status", plugin.state_dir / "mnt" / "llama", "--json").stdout)
    assert status["job"] == "llama" and status["rank"] == 0


def test_the_exec_liveness_probe_asks_the_plugin(plugin, shm_dir):
    ok = tierfs("csi", "--probe", "--endpoint", f"unix://{plugin.socket}", check=False)
    assert ok.returncode == 0, ok.stderr
    gone = tierfs("csi", "--probe", "--endpoint", f"unix://{shm_dir('tierfs-none')}/csi.sock", check=False)
    assert gone.returncode == 1 and gone.stderr.count("\n") == 1 and "does not answer" in gone.stderr
