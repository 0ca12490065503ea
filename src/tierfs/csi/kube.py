"""The pod's index in its JobSet or Indexed Job, read from the Kubernetes API.

kubelet hands a CSI driver only the pod's name, namespace and uid (``podInfoOnMount``);
the indexes that make a rank are labels on the pod, so the plugin reads the pod once at
publish time with its service account (RBAC: ``get`` on ``pods``, nothing else).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import requests
import urllib3

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
JOBSET_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
JOBSET_GLOBAL_REPLICAS = "jobset.sigs.k8s.io/global-replicas"
MAX_POD_BYTES = 4 << 20  # far above any pod the API server stores (etcd keeps objects under 1.5 MiB)
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_NAMESPACE_RE = re.compile(_DNS_LABEL)
_POD_NAME_RE = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")


def check_namespace(namespace: str) -> str:
    """A namespace names a GCS path segment and an API URL: only what Kubernetes allows (a DNS label)."""
    if len(namespace) > 63 or not _NAMESPACE_RE.fullmatch(namespace):
        raise ValueError(f"invalid pod namespace {namespace[:80]!r}: Kubernetes namespaces are DNS labels")
    return namespace


def check_pod_name(name: str) -> str:
    """A pod name goes into an API URL: only what Kubernetes allows (a DNS subdomain)."""
    if len(name) > 253 or not _POD_NAME_RE.fullmatch(name):
        raise ValueError(f"invalid pod name {name[:80]!r}: Kubernetes pod names are DNS subdomains")
    return name


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
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    tags = {}
    for key in ("annotations", "labels"):
        if isinstance(meta.get(key), dict):
            tags.update(meta[key])

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
        """The pod object; names are checked first, so a request only ever reads one pod."""
        if not self.api:
            raise RankUnknown("the plugin has no Kubernetes API to read the pod's labels from")
        try:
            path = f"/api/v1/namespaces/{quote(check_namespace(namespace))}/pods/{quote(check_pod_name(name))}"
        except ValueError as e:
            raise RankUnknown(str(e)) from None
        where = f"pod {namespace}/{name} from {self.api}"
        try:
            with requests.get(self.api.rstrip("/") + path, headers=self.headers, verify=self.verify,
                              timeout=10, stream=True) as reply:
                if reply.status_code != 200:
                    raise RankUnknown(
                        f"reading {where} answered HTTP {reply.status_code}"
                        + (" (does the plugin's service account have get on pods?)" if reply.status_code == 403 else "")
                    )
                body = reply.raw.read(MAX_POD_BYTES + 1, decode_content=True)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            raise RankUnknown(f"cannot read {where}: {e}") from None
        if len(body) > MAX_POD_BYTES:
            raise RankUnknown(f"reading {where} answered more than {MAX_POD_BYTES >> 20} MiB")
        try:
            pod = json.loads(body)
        except ValueError:
            raise RankUnknown(f"reading {where} answered something that is not JSON") from None
        if not isinstance(pod, dict):
            raise RankUnknown(f"reading {where} answered JSON that is not an object")
        return pod
