"""The admin's ceilings on what a pod's volume attributes may ask of a node.

A volume's attributes override the ConfigMap's defaults, so without ceilings one pod could
size its RAM tier past the node's memory, start job after job (each kept for --gc-after),
move every byte into the plugin's container, keep the node's CPUs awake, or bind any port
of the node as root. These tests drive the real plugin over its unix socket with real
daemons and mounts: every request over a ceiling is one INVALID_ARGUMENT line naming the
ceiling and the value asked, starts nothing, and a pod cannot lift a ceiling itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from pathlib import Path

import grpc
import pytest
from tierfs_testing import TIERFS
from tierfs_testing.csi import Plugin

from tests.csi.conftest import plugin, plugin_factory, pod_api  # noqa: F401 (fixtures)
from tierfs.csi import csi_pb2 as pb

SECRET = {"secret": "a-peer-secret-of-the-job-0123456789"}
WHERE = "ConfigMap tierfs-config"


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def refused(plugin: Plugin, attrs: dict[str, str], namespace: str = "default", **kw) -> str:
    """Publish ``attrs``; assert one INVALID_ARGUMENT line and that nothing was started; the line."""
    target = plugin.target()
    jobs_before = sorted(p.name for p in (plugin.state_dir / "jobs").iterdir())
    with pytest.raises(grpc.RpcError) as e:
        plugin.publish(target, attrs, pod=plugin.new_pod(namespace), **kw)
    code, details = e.value.code(), e.value.details()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "\n" not in details and "Traceback" not in details
    assert not os.path.exists(target), "a refused publish creates nothing"
    assert sorted(p.name for p in (plugin.state_dir / "jobs").iterdir()) == jobs_before
    plugin.call("Identity", "Probe", pb.ProbeRequest())  # still serving
    return details


def with_config(plugin_factory, tmp_path: Path, text: str) -> Plugin:
    config = tmp_path / f"config-{uuid.uuid4().hex[:6]}.yaml"
    config.write_text(text)
    return plugin_factory("--config", str(config))


def mounted(plugin: Plugin, attrs: dict[str, str], namespace: str = "default", **kw) -> str:
    target = plugin.target()
    plugin.publish(target, attrs, pod=plugin.new_pod(namespace), **kw)
    with open(os.path.join(target, "ok"), "w") as f:
        f.write("written")
    return target


def size_of(target: str) -> int:
    st = os.statvfs(target)
    return st.f_blocks * st.f_frsize


def job_options(plugin: Plugin, job: str) -> dict[str, str]:
    return json.loads((plugin.state_dir / "jobs" / f"{job}.json").read_text())["options"]


def free_port_in(low: int, high: int) -> int:
    """A port of the range nobody listens on at 127.0.0.1 right now."""
    for port in range(low, high + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip(f"every port of {low}-{high} is taken")


# -- capacity ----------------------------------------------------------------------------


def test_capacity_over_max_capacity_is_refused(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, "max-capacity: 64M\n")
    details = refused(plugin, {"job": "big", "rank": "0", "capacity": "4T"})
    assert details.startswith(
        f"volume attribute 'capacity' 4T is over the node's ceiling max-capacity=64M ({WHERE})"
    ), details
    refused(plugin, {"job": "big", "rank": "0", "capacity": "65M"})
    # The ceiling is the admin's: a pod naming it is refused, whatever it asks.
    details = refused(plugin, {"job": "big", "rank": "0", "capacity": "4T", "max-capacity": "8T"})
    assert "unknown volume attribute 'max-capacity'" in details
    assert size_of(mounted(plugin, {"job": "big", "rank": "0", "capacity": "64M"})) == 64 << 20


def test_capacities_on_a_node_add_up_to_at_most_its_share_of_ram(plugin_factory, tmp_path):
    """max-capacity-share bounds one volume, and every job on the node together."""
    plugin = with_config(plugin_factory, tmp_path, "max-capacity-share: 1%\n")
    share_mib = mem_total() // 100 >> 20
    details = refused(plugin, {"job": "a", "rank": "0", "capacity": f"{share_mib + 1}M"})
    assert details.startswith(
        f"volume attribute 'capacity' {share_mib + 1}M is over the node's ceiling max-capacity-share=1% of its "
    ), details
    first = share_mib * 6 // 10
    mounted(plugin, {"job": "a", "rank": "0", "capacity": f"{first}M"})
    details = refused(plugin, {"job": "b", "rank": "0", "capacity": f"{first}M"}, namespace="team-b")
    assert "max-capacity-share=1%" in details and "the node's other jobs hold" in details, details
    details = refused(
        plugin, {"job": "b", "rank": "0", "capacity": f"{first}M", "max-capacity-share": "100%"}, namespace="team-b"
    )
    assert "unknown volume attribute 'max-capacity-share'" in details, details
    mounted(plugin, {"job": "b", "rank": "0", "capacity": f"{share_mib - first}M"}, namespace="team-b")


def test_a_volume_without_capacity_gets_a_bounded_default(plugin_factory, tmp_path):
    # No ceilings set: the node's default share (50% of its RAM) split among the default 8 jobs.
    bare = plugin_factory()
    assert size_of(mounted(bare, {"job": "plain", "rank": "0"})) == (mem_total() // 2 // 8) >> 20 << 20
    assert job_options(bare, "plain")["capacity"] == f"{(mem_total() // 2 // 8) >> 20}M"
    # max-capacity bounds the default too.
    capped = with_config(plugin_factory, tmp_path, "max-capacity: 32M\n")
    assert size_of(mounted(capped, {"job": "plain", "rank": "0"})) == 32 << 20
    # The admin's own default capacity over the admin's ceiling is a start-up error.
    config = tmp_path / "over.yaml"
    config.write_text("capacity: 4T\nmax-capacity: 64G\n")
    proc = subprocess.run(
        [*TIERFS, "csi", "--endpoint", f"unix://{tmp_path}/never.sock", "--node-id", "n", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "capacity 4T is over the node's ceiling max-capacity=64G" in proc.stderr


# -- jobs ---------------------------------------------------------------------------------


def test_jobs_per_namespace_are_bounded(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, "max-jobs-per-namespace: 2\n")
    for job in ("j1", "j2"):
        mounted(plugin, {"job": job, "rank": "0", "capacity": "16M"}, namespace="team-a")
    details = refused(plugin, {"job": "j3", "rank": "0", "capacity": "16M"}, namespace="team-a")
    assert details.startswith(
        "job j3 would make 3 jobs of namespace team-a on node node-a, over the node's "
        f"ceiling max-jobs-per-namespace=2 ({WHERE})"
    ), details
    refused(plugin, {"job": "j3", "rank": "0", "capacity": "16M", "max-jobs-per-namespace": "100"}, namespace="team-a")
    mounted(plugin, {"job": "j1", "rank": "0", "capacity": "16M"}, namespace="team-a")  # a job it holds
    mounted(plugin, {"job": "j3", "rank": "0", "capacity": "16M"}, namespace="team-b")  # another namespace


def test_jobs_per_node_are_bounded_and_a_removed_job_frees_its_place(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, "max-jobs-per-node: 2\n")
    vol_target = {}
    for job, ns in (("j1", "team-a"), ("j2", "team-b")):
        target = plugin.target()
        vol_target[job] = (
            plugin.publish(target, {"job": job, "rank": "0", "capacity": "16M"}, pod=plugin.new_pod(ns)),
            target,
        )
    details = refused(plugin, {"job": "j3", "rank": "0", "capacity": "16M"}, namespace="team-c")
    assert details.startswith(
        f"job j3 would make 3 jobs on node node-a, over the node's ceiling max-jobs-per-node=2 ({WHERE})"
    ), details
    # Unpublished jobs still hold their RAM (kept for --gc-after): they count until removed.
    plugin.unpublish(*vol_target["j1"])
    refused(plugin, {"job": "j3", "rank": "0", "capacity": "16M"}, namespace="team-c")
    gc = [*TIERFS, "csi", "--state-dir", str(plugin.state_dir), "--ramdisk", str(plugin.ramdisk), "--gc", "j1"]
    assert subprocess.run(gc, capture_output=True, text=True).returncode == 0
    mounted(plugin, {"job": "j3", "rank": "0", "capacity": "16M"}, namespace="team-c")


# -- what pods may choose ------------------------------------------------------------------


@pytest.mark.parametrize("key, admins, other", [("data-path", "daemon", "passthrough"), ("wake-cpus", "off", "on")])
def test_data_path_and_wake_cpus_are_the_admins_unless_allowed(plugin_factory, tmp_path, key, admins, other):
    plugin = with_config(plugin_factory, tmp_path, f'{key}: "{admins}"\n')
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", key: other})
    assert details.startswith(
        f"volume attribute '{key}' '{other}' is over the node's ceiling allow-pod-{key}=false ({WHERE}"
    ), details
    refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", key: other, f"allow-pod-{key}": "true"})
    mounted(plugin, {"job": "j", "rank": "0", "capacity": "16M", key: admins})  # repeating the admin's: fine

    allowing = with_config(plugin_factory, tmp_path, f'{key}: "{admins}"\nallow-pod-{key}: "true"\n')
    mounted(allowing, {"job": "j", "rank": "0", "capacity": "16M", key: other})
    assert job_options(allowing, "j")[key] == other


def test_daemon_path_is_refused_when_the_admin_set_nothing(plugin):
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "data-path": "daemon"})
    assert "allow-pod-data-path=false" in details and "data-path=auto" in details, details
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "wake-cpus": "off"})
    assert "allow-pod-wake-cpus=false" in details and "wake-cpus=on" in details, details


# -- listen --------------------------------------------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:7420", "127.0.0.2:7420", "[::]:7420", "localhost:7420"])
def test_listen_addresses_are_the_nodes(plugin, listen):
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "listen": listen}, secrets=SECRET)
    assert details.startswith("volume attribute 'listen' address ") and "listen-hosts" in details, details
    assert "127.0.0.1" in details  # the one it may use: the plugin's --node-ip


@pytest.mark.parametrize("listen", [":80", ":22", "127.0.0.1:1023", ":8080", ":65535"])
def test_listen_ports_outside_the_range_are_refused(plugin, listen):
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "listen": listen}, secrets=SECRET)
    port = listen.rpartition(":")[2]
    assert details.startswith(
        f"volume attribute 'listen' port {port} is outside the node's ceiling listen-ports=7420-7499 ({WHERE})"
    ), details


def test_the_admin_widens_listen_addresses_and_ports(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, 'listen-hosts: "127.0.0.2"\nlisten-ports: "20000-29999"\n')
    refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "listen": ":7420"}, secrets=SECRET)
    refused(
        plugin,
        {"job": "j", "rank": "0", "capacity": "16M", "listen": ":25000", "listen-ports": "1-65535"},
        secrets=SECRET,
    )
    port = free_port_in(20000, 29999)
    mounted(plugin, {"job": "j", "rank": "0", "capacity": "16M", "listen": f"127.0.0.2:{port}"}, secrets=SECRET)
    assert job_options(plugin, "j")["listen"] == f"127.0.0.2:{port}"


# -- the admin's configuration ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, what",
    [
        ("max-capacity: lots\n", "invalid max-capacity 'lots'"),
        ("max-capacity: 10K\n", "invalid max-capacity '10K': use at least 1M"),
        ("max-capacity-share: 50\n", "invalid max-capacity-share '50'"),
        ("max-capacity-share: 150%\n", "invalid max-capacity-share '150%'"),
        ("max-capacity-share: 0%\n", "invalid max-capacity-share '0%'"),
        ("max-jobs-per-node: 0\n", "invalid max-jobs-per-node '0'"),
        ("max-jobs-per-namespace: -1\n", "invalid max-jobs-per-namespace '-1'"),
        ("allow-pod-data-path: maybe\n", "invalid allow-pod-data-path 'maybe'"),
        ("listen-ports: 9000-8000\n", "invalid listen-ports '9000-8000'"),
        ("listen-ports: 80-90\n", "allow-privileged-ports"),
        ("listen-hosts: 'a b'\n", "invalid listen-hosts 'a b'"),
        ("max-capacity: [1G]\n", "single value"),
        ("max-restore-wait: soon\n", "invalid max-restore-wait 'soon'"),
        ("max-chunk-size: 4K\n", "invalid max-chunk-size '4K': use at least 64K"),
        ("max-replicas: 0\n", "invalid max-replicas '0': use at least 1"),
        ("min-log-level: loud\n", "invalid min-log-level 'loud'"),
        ("allow-pod-engine: maybe\n", "invalid allow-pod-engine 'maybe'"),
        ("restore-wait: 20m\n", "the default restore-wait '20m' is over the ceiling max-restore-wait=10m"),
    ],
)
def test_bad_ceilings_refuse_the_plugins_start_with_one_line(tmp_path, text, what):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    proc = subprocess.run(
        [*TIERFS, "csi", "--endpoint", f"unix://{tmp_path}/never.sock", "--node-id", "n", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"tierfs: --config {config}: ") and what in proc.stderr, proc.stderr


def test_privileged_ports_only_when_the_admin_allows_them(plugin_factory, tmp_path):
    plugin = with_config(plugin_factory, tmp_path, 'listen-ports: "1000-1100"\nallow-privileged-ports: "true"\n')
    details = refused(plugin, {"job": "j", "rank": "0", "capacity": "16M", "listen": ":999"}, secrets=SECRET)
    assert "listen-ports=1000-1100" in details


def test_a_request_under_every_ceiling_still_mounts(plugin_factory, tmp_path):
    port = free_port_in(7420, 7499)
    plugin = with_config(
        plugin_factory,
        tmp_path,
        (
            "max-capacity: 64M\nmax-capacity-share: 50%\nmax-jobs-per-node: 2\nmax-jobs-per-namespace: 1\n"
            'data-path: auto\nwake-cpus: "on"\nlisten-ports: "7420-7499"\n'
        ),
    )
    target = mounted(
        plugin,
        {"job": "fits", "rank": "0", "capacity": "64M", "data-path": "auto", "wake-cpus": "on", "listen": f":{port}"},
        secrets=SECRET,
    )
    assert size_of(target) == 64 << 20 and open(os.path.join(target, "ok")).read() == "written"
    assert job_options(plugin, "fits")["listen"] == f"127.0.0.1:{port}"
