"""The pod's index in its JobSet or Indexed Job, read from the Kubernetes API.

kubelet hands a CSI driver only the pod's name, namespace and uid (``podInfoOnMount``);
the indexes that make a rank are labels on the pod, so the plugin reads the pod once at
publish time with its service account (RBAC: ``get`` on ``pods``). The only other calls
post Events on the pods (:mod:`tierfs.csi.events`; ``create`` and ``patch`` on ``events``).

The same labels name every pod of the job (volume attribute ``peers: auto``): JobSet pods
are ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>`` and Indexed Job pods ``<job>-<index>``,
each in the subdomain of the pod spec (a JobSet's defaults to its name), so
:func:`peer_pattern` writes one brace pattern for all of them.
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
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_NAME = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
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


class EventRefused(Exception):
    """The API server did not take an Event (or was not reached); the message says why."""


class EventGone(EventRefused):
    """The Event to update is no longer there (the API server expires Events after an hour)."""


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


class PeersUnknown(Exception):
    """The pod's labels do not name the job's other pods; the message says what is missing."""


def peer_pattern(pod: dict, namespace: str, nodes: int, port: int) -> str:
    """``peers: auto``: a pattern naming every pod of the pod's JobSet (its replicated Job) or Indexed Job.

    Names are qualified with the namespace (``<host>.<subdomain>.<namespace>.svc``): the
    daemons resolve them from the plugin's namespace, not the pod's.
    """
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    labels = {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}
    spec = pod.get("spec") if isinstance(pod, dict) else None
    spec = spec if isinstance(spec, dict) else {}
    hostname, subdomain = spec.get("hostname"), spec.get("subdomain")
    if JOBSET_NAME in labels:
        jobset, rjob = _label(labels, JOBSET_NAME), _label(labels, REPLICATED_JOB_NAME)
        jobs = (
            _count(labels, REPLICATED_JOB_REPLICAS)
            if REPLICATED_JOB_REPLICAS in labels
            else _count(labels, JOBSET_GLOBAL_REPLICAS)
        )
        if nodes % jobs:
            raise PeersUnknown(f"nodes={nodes} is not a multiple of the {jobs} Jobs of replicated job {rjob}")
        mine = f"{jobset}-{rjob}-{_count(labels, JOBSET_JOB_INDEX, 0)}-{_count(labels, JOB_COMPLETION_INDEX, 0)}"
        stem = f"{jobset}-{rjob}-{_range(jobs)}-{_range(nodes // jobs)}"
        subdomain = subdomain or jobset  # JobSet's default: its headless Service has its name
    else:
        key = next((k for k in JOB_NAME_LABELS if k in labels), None)
        if key is None or JOB_COMPLETION_INDEX not in labels:
            raise PeersUnknown(
                "the pod is in neither a JobSet nor an Indexed Job (no jobset-name, "
                "job-name or job-completion-index label)"
            )
        job = _label(labels, key)
        mine = f"{job}-{_count(labels, JOB_COMPLETION_INDEX, 0)}"
        stem = f"{job}-{_range(nodes)}"
        if not subdomain:
            raise PeersUnknown(
                "the pod has no spec.subdomain, so its Job's pods have no DNS names: set "
                "subdomain in the Job's pod template, with a headless Service of that name"
            )
    if not isinstance(subdomain, str) or not _DNS_LABEL_RE.fullmatch(subdomain):
        raise PeersUnknown(f"the pod's subdomain {str(subdomain)[:80]!r} is not a DNS label")
    if hostname is not None and hostname != mine:
        raise PeersUnknown(
            f"the pod's hostname {str(hostname)[:80]!r} is not {mine!r}, the name its indexes "
            "give: the other pods' names cannot be worked out"
        )
    return f"{stem}.{subdomain}.{check_namespace(namespace)}.svc:{port}"


_DNS_LABEL_RE = re.compile(_DNS_LABEL)


def _label(labels: dict[str, str], key: str) -> str:
    value = labels.get(key)
    if value is None:
        raise PeersUnknown(f"the pod has no label {key}")
    if len(value) > 63 or not _DNS_LABEL_RE.fullmatch(value):
        raise PeersUnknown(f"the pod's label {key}={value[:80]!r} is not a DNS label")
    return value


def _count(labels: dict[str, str], key: str, least: int = 1) -> int:
    value = labels.get(key)
    if value is None:
        raise PeersUnknown(f"the pod has no label {key}")
    if not value.isdigit() or int(value) < least or int(value) > 1_000_000:
        raise PeersUnknown(f"the pod's label {key}={value[:40]!r} is not a count")
    return int(value)


def _range(n: int) -> str:
    return "0" if n == 1 else f"{{0..{n - 1}}}"


class KubeClient:
    """A client for the plugin's few calls: GET a pod, post and update Events on pods.
    ``api`` overrides the in-cluster address."""

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
            with requests.get(
                self.api.rstrip("/") + path, headers=self.headers, verify=self.verify, timeout=10, stream=True
            ) as reply:
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

    def post_event(self, namespace: str, event: dict) -> None:
        """Create a core/v1 Event in ``namespace``."""
        self._send("POST", f"/api/v1/namespaces/{quote(check_namespace(namespace))}/events", event, "application/json")

    def patch_event(self, namespace: str, name: str, patch: dict) -> None:
        """Merge ``patch`` into the Event ``name``; :class:`EventGone` if it has expired."""
        path = f"/api/v1/namespaces/{quote(check_namespace(namespace))}/events/{quote(check_pod_name(name))}"
        self._send("PATCH", path, patch, "application/merge-patch+json")

    def _send(self, method: str, path: str, body: dict, content_type: str) -> None:
        if not self.api:
            raise EventRefused("the plugin has no Kubernetes API to post Events to")
        try:
            with requests.request(
                method,
                self.api.rstrip("/") + path,
                data=json.dumps(body).encode(),
                headers={**self.headers, "Content-Type": content_type},
                verify=self.verify,
                timeout=10,
                stream=True,
            ) as reply:
                status = reply.status_code
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as e:
            raise EventRefused(f"cannot reach {self.api}: {e}") from None
        if status == 404 and method == "PATCH":
            raise EventGone(f"{path} is gone")
        if not 200 <= status < 300:
            raise EventRefused(
                f"{method} {path} answered HTTP {status}"
                + (" (does the plugin's service account have create and patch on events?)" if status == 403 else "")
            )
