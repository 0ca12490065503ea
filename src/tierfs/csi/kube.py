"""The pod's index in its JobSet or Indexed Job, read from the Kubernetes API.

kubelet hands a CSI driver only the pod's name, namespace and uid (``podInfoOnMount``);
the indexes that make a rank are labels on the pod, so the plugin reads the pod once at
publish time with its service account (RBAC: ``get`` on ``pods``, nothing else).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import requests

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
JOBSET_GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"


class RankUnknown(Exception):
    """The pod carries no index the rank can come from; the message says what to set."""


@dataclass(frozen=True)
class PodIndex:
    completion_index: int | None  # the pod's index inside its Job
    job_index: int | None  # the Job's index across its JobSet
    jobs: int | None  # Jobs in the JobSet

    def rank(self, nodes: int) -> int:
        """One rank per pod: Jobs of a JobSet take consecutive blocks of ``nodes / jobs`` ranks."""
        if self.job_index is None:
            if self.completion_index is None:
                raise RankUnknown("the pod has no Job completion index or JobSet index")
            return self.completion_index
        jobs = self.jobs or 1
        if nodes % jobs:
            raise RankUnknown(f"nodes={nodes} is not a multiple of the JobSet's {jobs} Jobs")
        return self.job_index * (nodes // jobs) + (self.completion_index or 0)


def parse_pod(pod: dict) -> PodIndex:
    meta = pod.get("metadata") or {}
    tags = {**(meta.get("annotations") or {}), **(meta.get("labels") or {})}

    def number(key: str) -> int | None:
        value = tags.get(key)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise RankUnknown(f"the pod's {key} is {value!r}, not a number") from None

    return PodIndex(number(JOB_COMPLETION_INDEX), number(JOBSET_GLOBAL_INDEX), number(JOBSET_GLOBAL_REPLICAS))


class KubeClient:
    """A read-only client for one call: GET a pod. ``api`` overrides the in-cluster address."""

    def __init__(self, api: str | None = None):
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        self.api = api or (f"https://{host}:{port}" if host and port else None)
        self.headers: dict[str, str] = {}
        self.verify: bool | str = True
        if api is None and (SA_DIR / "token").exists():
            self.headers["Authorization"] = "Bearer " + (SA_DIR / "token").read_text().strip()
            self.verify = str(SA_DIR / "ca.crt")

    def pod(self, namespace: str, name: str) -> dict:
        if not self.api:
            raise RankUnknown("the plugin has no Kubernetes API to read the pod's labels from")
        url = f"{self.api.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{name}"
        try:
            reply = requests.get(url, headers=self.headers, verify=self.verify, timeout=10)
        except requests.RequestException as e:
            raise RankUnknown(f"cannot read pod {namespace}/{name} from {self.api}: {e}") from None
        if reply.status_code != 200:
            raise RankUnknown(
                f"reading pod {namespace}/{name} from {self.api} answered HTTP {reply.status_code}"
                + (" (does the plugin's service account have get on pods?)" if reply.status_code == 403 else "")
            )
        return reply.json()
