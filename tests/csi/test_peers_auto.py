"""``peers: auto``: the plugin names every pod of the pod's JobSet or Indexed Job as a pattern,
and the daemon it starts finds itself among them."""

from __future__ import annotations

import contextlib
import json
import os
import uuid

import grpc
import pytest
from tierfs_testing import free_port

from tests.conftest import tierfs
from tests.csi.test_node import code_of
from tierfs.csi import kube

# The pods' daemons start one at a time: the first ones warn of peers not up yet.
pytestmark = pytest.mark.expect_log(r"not answer yet")

SECRET = {"secret": "s3cret-s3cret-s3cret"}
HOSTS = "/etc/hosts"


@pytest.fixture
def plugin(plugin_factory, tmp_path):
    """A plugin whose ceilings let volumes listen on any unprivileged port (the tests take free ones)."""
    config = tmp_path / "config.yaml"
    config.write_text('listen-ports: "1024-65535"\n')
    return plugin_factory("--config", str(config))


@contextlib.contextmanager
def hosts_entries(entries: dict[str, str]):
    """Names in /etc/hosts for the test (so no DNS server is asked), removed afterwards.

    The file is replaced atomically both ways: other processes never read half of it.
    """
    marker = f"# tierfs-test-{uuid.uuid4().hex[:8]}"

    def rewrite(lines: list[str]) -> None:
        tmp = f"{HOSTS}.{marker[2:]}"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.chmod(tmp, os.stat(HOSTS).st_mode & 0o7777)
        os.replace(tmp, HOSTS)

    with open(HOSTS) as f:
        rewrite(f.read().splitlines() + [f"{ip} {name} {marker}" for name, ip in entries.items()])
    try:
        yield
    finally:
        with open(HOSTS) as f:
            rewrite([line for line in f.read().splitlines() if not line.endswith(marker)])


def jobset_pod(plugin, jobset: str, job_index: int, pod_index: int, jobs: int = 2) -> dict[str, str]:
    pod = plugin.new_pod(
        labels={
            "jobset.sigs.k8s.io/jobset-name": jobset,
            "jobset.sigs.k8s.io/replicatedjob-name": "slice",
            "jobset.sigs.k8s.io/replicatedjob-replicas": str(jobs),
            "jobset.sigs.k8s.io/global-replicas": str(jobs),
            "jobset.sigs.k8s.io/job-index": str(job_index),
            "jobset.sigs.k8s.io/job-global-index": str(job_index),
            "batch.kubernetes.io/job-completion-index": str(pod_index),
        }
    )
    spec_of(plugin, pod).update(hostname=f"{jobset}-slice-{job_index}-{pod_index}", subdomain=jobset)
    return pod


def job_pod(plugin, job: str, index: int, subdomain: str | None) -> dict[str, str]:
    pod = plugin.new_pod(
        labels={
            "batch.kubernetes.io/job-name": job,
            "job-name": job,
            "batch.kubernetes.io/job-completion-index": str(index),
        }
    )
    spec_of(plugin, pod).update(hostname=f"{job}-{index}", **({"subdomain": subdomain} if subdomain else {}))
    return pod


def spec_of(plugin, pod: dict[str, str]) -> dict:
    """The pod's spec as the fake API server returns it."""
    key = (pod["csi.storage.k8s.io/pod.namespace"], pod["csi.storage.k8s.io/pod.name"])
    return plugin.api.pods[key].setdefault("spec", {})


def job_options(plugin, job: str) -> dict:
    return json.loads((plugin.state_dir / "jobs" / f"{job}.json").read_text())["options"]


def status(plugin, job: str) -> dict:
    return json.loads(tierfs("status", plugin.state_dir / "mnt" / job, "--json").stdout)


def known_peers(plugin, job: str) -> set[str]:
    return {p["address"] for p in status(plugin, job)["peers"]["known"]}


def test_a_jobset_pod_gets_every_pod_of_its_replicated_job_as_peers(plugin):
    jobset, port = f"js{uuid.uuid4().hex[:6]}", free_port("127.0.0.1")
    names = {
        f"{jobset}-slice-{j}-{p}.{jobset}.default.svc": f"127.0.0.{60 + 2 * j + p}" for j in range(2) for p in range(2)
    }
    mine = f"{jobset}-slice-1-0.{jobset}.default.svc"
    names[mine] = "127.0.0.1"  # this node: the plugin's --node-ip
    attrs = {
        "job": jobset,
        "nodes": "4",
        "peers": "auto",
        "listen": f":{port}",
        "capacity": "64M",
        "restore-wait": "1s",
    }
    with hosts_entries(names):
        target = plugin.target()
        plugin.publish(target, attrs, pod=jobset_pod(plugin, jobset, 1, 0), secrets=SECRET)
        assert job_options(plugin, jobset)["peers"] == f"{jobset}-slice-{{0..1}}-{{0..1}}.{jobset}.default.svc:{port}"
        # Rank 2 (Job 1, pod 0); the daemon reached itself under its own name and left it out.
        assert status(plugin, jobset)["rank"] == 2
        assert known_peers(plugin, jobset) == {f"{n}:{port}" for n in names if n != mine}


def test_an_indexed_job_pod_gets_every_index_in_its_subdomain(plugin):
    job, port = f"ij{uuid.uuid4().hex[:6]}", free_port("127.0.0.1")
    names = {f"{job}-{i}.workers.default.svc": f"127.0.0.{70 + i}" for i in range(3)}
    names[f"{job}-1.workers.default.svc"] = "127.0.0.1"
    attrs = {"job": job, "nodes": "3", "peers": "auto", "listen": f":{port}", "capacity": "64M", "restore-wait": "1s"}
    with hosts_entries(names):
        plugin.publish(plugin.target(), attrs, pod=job_pod(plugin, job, 1, "workers"), secrets=SECRET)
        assert job_options(plugin, job)["peers"] == f"{job}-{{0..2}}.workers.default.svc:{port}"
        assert known_peers(plugin, job) == {f"{job}-{i}.workers.default.svc:{port}" for i in (0, 2)}


@pytest.mark.parametrize(
    "make_pod, message",
    [
        (lambda p: job_pod(p, "ij", 0, None), "the pod has no spec.subdomain"),
        (lambda p: p.new_pod(labels={"batch.kubernetes.io/job-completion-index": "0"}), "neither a JobSet nor"),
        (lambda p: _renamed(p, job_pod(p, "ij", 0, "w")), "the pod's hostname 'other' is not 'ij-0'"),
    ],
)
def test_peers_auto_without_pod_names_is_a_clear_error(plugin, make_pod, message):
    attrs = {"job": "autojob", "nodes": "2", "peers": "auto", "capacity": "64M"}
    code, details = code_of(lambda: plugin.publish(plugin.target(), attrs, pod=make_pod(plugin), secrets=SECRET))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("volume attribute peers=auto: cannot name the pods of job autojob: ")
    assert message in details and "\n" not in details


def _renamed(plugin, pod: dict[str, str]) -> dict[str, str]:
    spec_of(plugin, pod)["hostname"] = "other"
    return pod


# -- the pattern itself -------------------------------------------------------------------


def pod_object(labels: dict[str, str], **spec) -> dict:
    return {"metadata": {"labels": labels}, "spec": spec}


def test_jobset_pattern_defaults_the_subdomain_to_the_jobset_name():
    labels = {
        kube.JOBSET_NAME: "train",
        kube.REPLICATED_JOB_NAME: "w",
        kube.JOBSET_GLOBAL_REPLICAS: "4",
        kube.JOBSET_JOB_INDEX: "3",
        kube.JOB_COMPLETION_INDEX: "7",
    }
    assert kube.peer_pattern(pod_object(labels), "ml", 32, 7420) == "train-w-{0..3}-{0..7}.train.ml.svc:7420"
    one_job = {**labels, kube.REPLICATED_JOB_REPLICAS: "1", kube.JOBSET_JOB_INDEX: "0"}
    assert kube.peer_pattern(pod_object(one_job, subdomain="net"), "ml", 8, 1) == "train-w-0-{0..7}.net.ml.svc:1"


@pytest.mark.parametrize(
    "labels, nodes, message",
    [
        (
            {kube.JOBSET_NAME: "t", kube.REPLICATED_JOB_NAME: "w", kube.JOBSET_GLOBAL_REPLICAS: "3"},
            4,
            "nodes=4 is not a multiple of the 3 Jobs",
        ),
        ({kube.JOBSET_NAME: "t"}, 4, "no label jobset.sigs.k8s.io/replicatedjob-name"),
        ({kube.JOBSET_NAME: "T_T", kube.REPLICATED_JOB_NAME: "w"}, 4, "is not a DNS label"),
        ({kube.JOBSET_NAME: "t", kube.REPLICATED_JOB_NAME: "w", kube.JOBSET_GLOBAL_REPLICAS: "x"}, 4, "is not a count"),
    ],
)
def test_bad_jobset_labels_say_what_is_wrong(labels, nodes, message):
    with pytest.raises(kube.PeersUnknown, match=message):
        kube.peer_pattern(pod_object(labels), "ml", nodes, 7420)
