"""The node's one endpoint, scraped by a real Prometheus: the plugin's series and every job's daemon's.

The plugin serves its own series and asks each of its daemons for theirs at every scrape,
so one PodMonitor target per node shows every job on it; /healthz and /daemons tell an
operator whether the plugin can serve and which daemons are sick.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

from tierfs_testing import free_port

from tests.conftest import tierfs
from tests.csi.test_node import daemon_pid
from tests.helpers import wait_for
from tests.prometheus import promtool_check_metrics

JOBS = {
    "llama": {"job": "llama", "rank": "0", "capacity": "64M"},
    "gemma": {"job": "gemma", "rank": "0", "capacity": "64M"},
}


def get(address: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def commit(plugin, target: str, job: str, step: int) -> None:
    os.makedirs(os.path.join(target, f"ckpt/{step}"))
    with open(os.path.join(target, f"ckpt/{step}/weights"), "wb") as f:
        f.write(job.encode() * 1000)
    tierfs("commit", plugin.state_dir / "mnt" / job / f"ckpt/{step}", "--step", str(step))


def test_one_endpoint_per_node_serves_the_plugin_and_every_daemon(plugin_factory, prometheus):
    address = f"127.0.0.1:{free_port()}"
    plugin = plugin_factory("--metrics", address)
    targets = {job: plugin.target() for job in JOBS}
    for job, attributes in JOBS.items():
        plugin.publish(targets[job], attributes)
    for step, job in enumerate(JOBS, start=1):
        commit(plugin, targets[job], job, step)
    prom = prometheus({"tierfs-csi": [address]})

    code, text = get(address, "/metrics")
    assert code == 200
    promtool_check_metrics(text.decode())
    prom.wait_value('tierfs_plugin_info{node="node-a"}', 1)
    prom.wait_value("tierfs_plugin_volumes", len(JOBS))
    prom.wait_value('tierfs_plugin_daemons{state="serving"}', len(JOBS))
    prom.wait_value('tierfs_plugin_volume_calls_total{call="Node.NodePublishVolume",code="OK"}', len(JOBS))
    for job in JOBS:
        prom.wait_value(f'tierfs_plugin_job_pods{{job="{job}"}}', 1)
    for step, job in enumerate(JOBS, start=1):  # each daemon's own series, with its job
        prom.wait_value(f'tierfs_steps_committed_total{{job="{job}",rank="0"}}', 1)
        prom.wait_value(f'tierfs_newest_step{{job="{job}",rank="0",tier="ram"}}', step)
        assert prom.value(f'tierfs_ram_capacity_bytes{{job="{job}"}}') == 64 << 20
    assert sorted(dict(labels)["job"] for labels in prom.query("tierfs_info")) == sorted(JOBS)

    code, body = get(address, "/healthz")
    assert code == 200 and json.loads(body)["ready"] is True
    code, body = get(address, "/daemons")
    assert code == 200 and {d["job"]: d["state"] for d in json.loads(body)} == dict.fromkeys(JOBS, "serving")

    # A job's daemon hangs: the node's endpoint shows it sick, and still serves the other job.
    hung = daemon_pid(plugin, "gemma")
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_for(
            lambda: (
                {d["job"]: d["state"] for d in json.loads(get(address, "/daemons")[1])}
                == {"llama": "serving", "gemma": "sick"}
            ),
            what="gemma's daemon reported sick",
        )
        prom.wait_value('tierfs_plugin_daemons{state="sick"}', 1)
        prom.wait_value('up{job="tierfs-csi"}', 1)
        assert prom.value('tierfs_steps_committed_total{job="llama",rank="0"}') == 1
        assert get(address, "/healthz")[0] == 200, "one sick job does not make the plugin unready"
    finally:
        os.kill(hung, signal.SIGCONT)
    prom.wait_value('tierfs_plugin_daemons{state="serving"}', len(JOBS))
