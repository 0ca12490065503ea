"""Tenancy of the CSI node plugin: what a pod can reach of other namespaces' jobs, and of the node.

The plugin runs as root, holds the cluster's GCS credentials and mounts into pods, so
everything a pod puts in its volume's attributes is hostile input. These tests drive the
real plugin over its unix socket (as kubelet does), with real daemons, real bind mounts
and the real GCS emulator; the only stand-in is the Kubernetes API (tests/csi/conftest.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierfs_testing.csi import Plugin, publish_request

from tests.conftest import tierfs
from tests.csi.conftest import plugin, plugin_factory, pod_api  # noqa: F401 (fixtures)
from tests.helpers import wait_for
from tierfs.core import linux, mounts
from tierfs.csi import csi_pb2 as pb
from tierfs.csi.settings import ATTRIBUTES, POD_INFO
from tierfs.ramtier import tmpfs

JOB = {"job": "llama", "rank": "0", "capacity": "64M"}
SECRET = "a-peer-secret-of-the-job-0123456789"


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


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


def gcs_names(bucket: str, prefix: str = "") -> list[str]:
    client = storage.Client(credentials=AnonymousCredentials(), project="test")
    return sorted(b.name for b in client.list_blobs(bucket, prefix=prefix))


def backed_up(bucket: str, prefix: str) -> bool:
    """A committed manifest under ``prefix``, and no upload half done."""
    names = gcs_names(bucket, prefix)
    return any("/manifests/" in n and n.endswith(".json") for n in names) and not any(
        n.endswith(".pending") for n in names
    )


def with_config(plugin_factory, tmp_path: Path, text: str, *args: str) -> Plugin:
    config = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(text)
    return plugin_factory("--config", str(config), *args)


# -- GCS: a job id is bound to its namespace across nodes ---------------------------------


@pytest.mark.expect_log(
    "WARNING tierfs: GCS objects in .* are neither encrypted nor authenticated"
)  # volumes without a Secret
def test_backups_of_one_namespace_are_out_of_reach_of_another(plugin_factory, gcs_bucket, tmp_path):
    """Namespace B names job A on a node that never ran A: it neither reads nor collects A's backups."""
    defaults = (
        f"gcs: gs://{gcs_bucket}/tierfs\nbackup-interval: '0'\nkeep: '1'\nrestore-wait: 1s\n"
        'allow-unauthenticated-gcs: "true"\n'
    )
    node_a = with_config(plugin_factory, tmp_path, defaults)
    target = node_a.target()
    node_a.publish(target, JOB, pod=node_a.new_pod("team-a"))
    with open(os.path.join(target, "weights.pt"), "wb") as f:  # a closed *.pt commits
        f.write(b"team a's weights" * 1000)
    wait_for(lambda: backed_up(gcs_bucket, "tierfs/"), timeout=60, what="A's backup")
    names = gcs_names(gcs_bucket)
    assert names and all(n.startswith("tierfs/team-a/llama/") for n in names), names

    node_b = with_config(plugin_factory, tmp_path, defaults)  # a fresh node
    # Naming A's prefix outright is refused.
    code, details = code_of(
        lambda: node_b.publish(
            node_b.target(), {**JOB, "gcs": f"gs://{gcs_bucket}/tierfs/team-a"}, pod=node_b.new_pod("team-b")
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "\n" not in details
    assert "gcs" in details and "ConfigMap" in details
    # With the cluster's bucket, B's job lives under B's namespace: nothing of A's shows.
    mine = node_b.target()
    node_b.publish(mine, JOB, pod=node_b.new_pod("team-b"))
    assert "weights.pt" not in os.listdir(mine)
    for step in range(3):  # B commits and its retention (keep 1) collects its own old steps
        with open(os.path.join(mine, f"b-{step}.pt"), "wb") as f:
            f.write(os.urandom(1 << 16))
    wait_for(lambda: backed_up(gcs_bucket, "tierfs/team-b/"), timeout=60, what="B's backup")
    time.sleep(2)
    assert [n for n in gcs_names(gcs_bucket) if not n.startswith("tierfs/team-b/")] == names


@pytest.mark.expect_log(
    "WARNING tierfs: GCS objects in .* are neither encrypted nor authenticated"
)  # volumes without a Secret
def test_pods_do_not_choose_buckets_unless_the_admin_lets_them(plugin_factory, gcs_bucket, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, "backup-interval: '0'\n")  # the cluster sets no bucket
    code, details = code_of(lambda: plugin.publish(plugin.target(), {**JOB, "gcs": f"gs://{gcs_bucket}/mine"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "\n" not in details and "gcs" in details
    assert not list(plugin.ramdisk.glob("*")), "nothing started for a refused volume"

    same = with_config(
        plugin_factory, tmp_path, f"gcs: gs://{gcs_bucket}/tierfs\nallow-unauthenticated-gcs: \"true\"\n"
    )
    same.publish(same.target(), {**JOB, "gcs": f"gs://{gcs_bucket}/tierfs/"})  # the cluster's own: fine
    assert (
        json.loads((same.state_dir / "jobs" / "llama.json").read_text())["options"]["gcs"]
        == f"gs://{gcs_bucket}/tierfs/default"
    )

    allowed = with_config(
        plugin_factory, tmp_path, "backup-interval: '0'\nallow-unauthenticated-gcs: \"true\"\n", "--allow-pod-gcs"
    )
    target = allowed.target()
    allowed.publish(target, {**JOB, "gcs": f"gs://{gcs_bucket}/theirs"}, pod=allowed.new_pod("team-c"))
    with open(os.path.join(target, "w.pt"), "wb") as f:
        f.write(b"c")
    wait_for(lambda: gcs_names(gcs_bucket, "theirs/"), timeout=60, what="C's backup")
    assert all(n.startswith("theirs/team-c/llama/") for n in gcs_names(gcs_bucket, "theirs/"))


def test_the_pod_namespace_is_required_and_checked(plugin):
    pod = plugin.new_pod()
    del pod["csi.storage.k8s.io/pod.namespace"]
    code, details = code_of(lambda: plugin.publish(plugin.target(), JOB, pod=pod))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "podInfoOnMount" in details
    for bad in ("../x", "a/b", "Team-A", "", "x" * 64):
        code, details = code_of(lambda: plugin.publish(plugin.target(), JOB, pod=plugin.new_pod(bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace" in details, (bad, details)
    assert not list(plugin.ramdisk.glob("*"))


def test_a_hostile_pod_name_never_reaches_the_api_server(plugin, pod_api):
    pod = plugin.new_pod()
    pod["csi.storage.k8s.io/pod.name"] = "../../../apis/x"
    code, details = code_of(lambda: plugin.publish(plugin.target(), {"job": "gpt", "nodes": "2"}, pod=pod))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "pod name" in details
    assert all(re.fullmatch(r"/api/v1/namespaces/[a-z0-9-]+/pods/[a-z0-9.-]+", p) for p in pod_api.requests), (
        pod_api.requests
    )


def test_ram_data_no_namespace_owns_is_not_handed_out(plugin):
    """A job's RAM data left on the node with no record of its namespace goes to nobody."""
    left = plugin.ramdisk / "orphan" / "rank-0" / "tree"
    left.mkdir(parents=True)
    (left / "secret.txt").write_text("someone else's")
    target = plugin.target()
    code, details = code_of(lambda: plugin.publish(target, {**JOB, "job": "orphan"}, pod=plugin.new_pod("team-b")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "--gc orphan" in details
    assert mounts.find_mount(target) is None


def test_oversized_input_from_the_cluster_gets_one_line(plugin, tmp_path):
    """The ConfigMap and the API server's answer are read with a cap, like everything else."""
    endpoint = f"unix://{tmp_path}/never.sock"
    config = tmp_path / "config.yaml"
    for text, what in (
        ("capacity: 64M\n" + "#" * (1 << 20), "larger than 1 MiB"),
        ("capacity: [64M, 1G]\n", "single value"),
    ):
        config.write_text(text)
        proc = tierfs("csi", "--endpoint", endpoint, "--node-id", "n", "--config", str(config), check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and what in proc.stderr, proc.stderr
    pod = plugin.new_pod(labels={"batch.kubernetes.io/job-completion-index": "0", "pad": "x" * (5 << 20)})
    code, details = code_of(lambda: plugin.publish(plugin.target(), {"job": "gpt", "nodes": "1"}, pod=pod))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more than 4 MiB" in details
    plugin.call("Identity", "Probe", pb.ProbeRequest())


@pytest.mark.parametrize("secret", ["s" * 5000, "sixteen-chars-and\x00a-nul"])
def test_a_hostile_peer_secret_gets_one_line(plugin, secret):
    target = plugin.target()
    code, details = code_of(lambda: plugin.publish(target, JOB, secrets={"secret": secret}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "nodePublishSecretRef" in details and "\n" not in details
    assert not os.path.exists(target) and not list(plugin.ramdisk.glob("*"))


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


# -- the plugin's records -----------------------------------------------------------------


def test_records_are_root_only_and_hold_nothing_to_check_a_guess_against(plugin):
    target = plugin.target()
    pod = plugin.new_pod()
    vol = plugin.publish(target, JOB, pod=pod, secrets={"secret": SECRET})
    for sub in ("jobs", "volumes", "logs", "mnt"):
        assert stat.S_IMODE((plugin.state_dir / sub).stat().st_mode) == 0o700, sub
    records = [*(plugin.state_dir / "volumes").iterdir(), *(plugin.state_dir / "jobs").iterdir()]
    assert records
    for path in records:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    # No unkeyed digest of the secret (alone or inside the request) is stored anywhere.
    text = "".join(p.read_text() for p in (plugin.state_dir / "volumes").iterdir())
    digests = {getattr(hashlib, name)(SECRET.encode()).hexdigest() for name in ("sha256", "sha1", "md5", "sha512")}
    context = {**pod, **JOB}
    old = json.dumps([target, False, sorted(context.items()), hashlib.sha256(SECRET.encode()).hexdigest()])
    digests.add(hashlib.sha256(old.encode()).hexdigest())
    assert not any(d in text for d in digests)
    # The record still tells a repeat from a different call.
    plugin.publish(target, JOB, pod=pod, volume_id=vol, secrets={"secret": SECRET})
    code, _ = code_of(
        lambda: plugin.publish(target, JOB, pod=pod, volume_id=vol, secrets={"secret": SECRET + "-other"})
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS


def test_records_of_an_older_plugin_are_made_private_at_start(plugin):
    target = plugin.target()
    pod = plugin.new_pod()
    vol = plugin.publish(target, JOB, pod=pod)
    plugin.stop()
    volumes = plugin.state_dir / "volumes"
    (record,) = volumes.iterdir()
    data = json.loads(record.read_text())
    data.pop("request", None)
    data["fingerprint"] = hashlib.sha256(b"what an older plugin stored").hexdigest()
    record.write_text(json.dumps(data))
    os.chmod(record, 0o644)
    os.chmod(volumes, 0o755)
    plugin.start()
    assert stat.S_IMODE(volumes.stat().st_mode) == 0o700 and stat.S_IMODE(record.stat().st_mode) == 0o600
    assert "fingerprint" not in record.read_text()
    plugin.publish(target, JOB, pod=pod, volume_id=vol)  # kubelet's repeat is still the same call


# -- fuzzing the volume attributes --------------------------------------------------------

HOSTILE = st.sampled_from(
    [
        "",
        " ",
        "0",
        "-1",
        "1e999",
        "9" * 5000,
        "../../etc",
        "/etc/passwd",
        "--ramdisk=/etc",
        "-o",
        "a\nb",
        "a\x00b",
        "gs://other-bucket/x",
        "gs://",
        "127.0.0.1:1",
        "0:0",
        ":1",
        "x" * 70000,
        "true",
        "default",
        "💥",
        "\u202e",
        "dir:**",
        "file:*.pt,marker:../../x",
        "slice=a,rack",
        "=",
        "%s%n",
        "${HOME}",
        "$(reboot)",
    ]
)
VALUES = st.one_of(HOSTILE, st.text(max_size=40))
POD_KEYS = [POD_INFO + k for k in ("pod.name", "pod.namespace", "pod.uid", "ephemeral", "serviceAccount.name")]


@pytest.fixture
def holder(plugin_factory):
    """A plugin serving one pod of job ``fuzz`` in namespace ``team-a`` throughout."""
    plugin = plugin_factory()
    target = plugin.target()
    plugin.publish(target, {"job": "fuzz", "rank": "0", "capacity": "64M"}, pod=plugin.new_pod("team-a"))
    with open(os.path.join(target, "kept"), "w") as f:
        f.write("still here")
    return plugin, target


def _still_serving(plugin: Plugin, target: str) -> None:
    """The plugin answers, the held volume still serves its file, and nothing strays outside the plugin's dirs."""
    plugin.call("Identity", "Probe", pb.ProbeRequest())
    assert open(os.path.join(target, "kept")).read() == "still here"
    assert {p.name for p in plugin.base.iterdir()} <= {"state", "ram", "pods", "csi.sock", "plugin.log"}
    assert {p.name for p in plugin.state_dir.iterdir()} <= {
        "jobs",
        "volumes",
        "mnt",
        "logs",
        "keepers",
        "lock",
        "locks",
        "tokens",
        "node.key",
    }
    for mount in mounts.mount_table():
        point = mount.mountpoint
        if point.startswith(str(plugin.base)):
            if (mount.fstype, mount.source) == ("tmpfs", tmpfs.SOURCE):  # a rank's own (capacity)
                assert point.startswith(str(plugin.ramdisk) + "/"), point
                continue
            assert point.startswith((str(plugin.state_dir / "mnt") + "/", str(plugin.base / "pods") + "/")), point


def _publish_fuzzed(plugin: Plugin, context: dict[str, str]) -> None:
    target = plugin.target()
    request = publish_request(f"csi-{uuid.uuid4().hex}", target, context)
    try:
        plugin.call("Node", "NodePublishVolume", request)
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), (
            e.code(),
            e.details(),
            context,
        )
        assert "\n" not in e.details() and len(e.details()) <= 1024 and "Traceback" not in e.details()
        assert not os.path.exists(target), "a refused publish creates nothing"
    else:  # the fuzz found a valid volume: it must be a proper nosuid,nodev mount
        assert {"nosuid", "nodev"} <= mount_options(target)
        plugin.unpublish(request.volume_id, target)


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@FUZZ
@given(
    extra=st.dictionaries(
        st.text(min_size=0, max_size=30).filter(lambda k: k not in ATTRIBUTES and not k.startswith(POD_INFO)),
        VALUES,
        min_size=1,
        max_size=4,
    )
)
def test_fuzzed_unknown_attributes_are_invalid_arguments(holder, extra):
    plugin, target = holder
    context = {**plugin.new_pod("team-a"), "job": "fuzz", "rank": "0", "capacity": "64M", **extra}
    code, details = code_of(
        lambda: plugin.call("Node", "NodePublishVolume", publish_request("csi-fuzz", plugin.target(), context))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "unknown volume attribute" in details
    assert "\n" not in details and len(details) <= 1024
    _still_serving(plugin, target)


@FUZZ
@given(
    attrs=st.dictionaries(
        st.sampled_from([*ATTRIBUTES, *POD_KEYS, "ramdisk", "log-file", "secret-file"]), VALUES, min_size=1, max_size=4
    )
)
def test_fuzzed_attribute_values_get_one_clear_line(holder, attrs):
    plugin, target = holder
    _publish_fuzzed(plugin, {**plugin.new_pod("team-a"), "job": "fuzz", "rank": "0", "capacity": "64M", **attrs})
    _still_serving(plugin, target)
