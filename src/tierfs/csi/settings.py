"""What a volume's daemon runs with: the cluster's settings, then the pod's attributes.

Everything here is decided from the request, the plugin's own configuration and the
ConfigMap alone, before a daemon, a mount or a record exists; so a bad attribute is one
line back to kubelet and nothing to undo. The work of publishing (daemons, bind mounts,
records) is :mod:`tierfs.csi.volumes`.

Tenancy: the bucket and prefix are the cluster's (the ConfigMap), not the pod's, unless
the plugin runs with ``--allow-pod-gcs``; the daemon backs up under
``gs://BUCKET/PREFIX/<namespace>/`` so that the same job id in two namespaces never shares
GCS objects.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tierfs.config import OPTIONS, Config
from tierfs.core.errors import UserError
from tierfs.core.parse import check_job_id, parse_address, parse_size
from tierfs.csi import ceilings, kube, tokens
from tierfs.csi.ceilings import Ceilings, OverCeiling
from tierfs.csi.errors import FailedPrecondition, InvalidArgument

POD_INFO = "csi.storage.k8s.io/"  # keys kubelet adds with podInfoOnMount
EPHEMERAL = POD_INFO + "ephemeral"
POD_NAME, POD_NAMESPACE = POD_INFO + "pod.name", POD_INFO + "pod.namespace"
# Options a pod author must not choose: they name paths on the host.
HOST_OPTIONS = {"ramdisk", "log-file", "secret-file"}
# The node's logs, the same for every daemon: the plugin relays them in its own format (tierfs.csi.logrelay).
PLUGIN_OPTIONS = {"log-format", "log-max-size"}
ATTRIBUTES = sorted(set(OPTIONS) - HOST_OPTIONS - PLUGIN_OPTIONS)
PEER_PORT = 7420  # the peer service's port when a volume names peers but no listen address
AUTO = "auto"  # volume attribute peers: auto: the pods of the pod's JobSet or Indexed Job
MAX_ATTRIBUTE = 64 << 10  # characters in one attribute value (a 1000-node `peers` list fits)
MAX_SECRET = 4096  # characters in the job's peer secret
MAX_CONFIG_BYTES = 1 << 20  # the cluster defaults file (a ConfigMap holds at most 1 MiB)


@dataclass(frozen=True)
class PluginConfig:
    node_id: str
    state_dir: Path
    ramdisk: Path
    node_ip: str | None = None
    config_file: Path | None = None  # cluster-wide volume attribute defaults (YAML)
    kube_api: str | None = None  # None: the in-cluster API server, if any
    gc_after: float = 86400.0  # seconds a job may sit unused on the node before its data goes; 0: never
    allow_pod_gcs: bool = False  # may a volume's `gcs` name a bucket/prefix other than the cluster's?
    tierfs: tuple[str, ...] = (sys.executable, "-m", "tierfs")  # how to run the CLI
    keeper_cgroup: Path | None = None  # a cgroup outside the plugin's container for the keepers
    volume_calls: int = 32  # Node service calls at once; the Identity service has threads of its own
    event_interval: float = 15.0  # seconds between looks at the daemons for the pods' Events
    event_backup_lag: float = 600.0  # seconds a job's GCS backup may fail or lag before its pods hear of it
    log_format: str = "text"  # the plugin's and every daemon's (--log-format)
    metrics: tuple[str, int] | None = None  # HOST:PORT of the node's /metrics, /healthz and /daemons


@dataclass(frozen=True)
class PublishRequest:
    volume_id: str
    target: str
    read_only: bool
    context: dict[str, str]
    secrets: dict[str, str]

    def digest(self, key: bytes) -> str:
        """Identifies the call: a repeat with the same digest is the same publish.

        Keyed with the node's secret key, so the stored digest confirms no guess of the
        peer secret to someone who reads it without the key.
        """
        # Not the service-account token: kubelet sends a fresh one with each republish.
        context = sorted((k, v) for k, v in self.context.items() if k != tokens.TOKENS)
        text = json.dumps([self.target, self.read_only, context, self.secrets.get("secret", "")])
        return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def load_settings(path: Path | None) -> tuple[dict[str, str], Ceilings]:
    """The cluster's settings (a ConfigMap's config.yaml): volume attribute defaults, and the ceilings.

    Read at every publish, so an edited ConfigMap applies to the next pod without a restart.
    """
    if path is None:
        return {}, Ceilings()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read --config {path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise UserError(f"--config {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: it holds a few options")
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as e:
        raise UserError(f"--config {path} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must be a mapping of tierfs mount options to values")
    unknown = sorted(set(map(str, data)) - set(ATTRIBUTES) - set(ceilings.KEYS))
    if unknown:
        raise UserError(
            f"--config {path}: unknown option(s) {', '.join(unknown)}; use {', '.join(ATTRIBUTES)}, "
            f"or a ceiling: {', '.join(ceilings.KEYS)}"
        )
    nested = sorted(str(k) for k, v in data.items() if isinstance(v, (dict, list)))
    if nested:
        raise UserError(f"--config {path}: option(s) {', '.join(nested)} must be a single value, not a list or mapping")
    values = {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in data.items() if v is not None}
    limits = Ceilings.parse({k: v for k, v in values.items() if k in ceilings.KEYS}, f"--config {path}")
    defaults = {k: v for k, v in values.items() if k not in ceilings.KEYS}
    ceilings.check_admin_defaults(defaults, limits, f"--config {path}", ceilings.mem_total())
    return defaults, limits


def request_namespace(req: PublishRequest) -> str:
    """The pod's namespace, which kubelet adds to the volume context (podInfoOnMount)."""
    namespace = req.context.get(POD_NAMESPACE)
    if namespace is None:
        raise InvalidArgument(
            "kubelet passed no pod namespace: set podInfoOnMount: true on the CSIDriver csi.tierfs.dev"
        )
    try:
        return kube.check_namespace(namespace)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def check_value(key: str, value: str) -> None:
    """Attribute values become daemon flags, file contents and log lines: bounded, printable."""
    if len(value) > MAX_ATTRIBUTE:
        raise InvalidArgument(f"volume attribute {key} is {len(value)} characters long: at most {MAX_ATTRIBUTE}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument(f"volume attribute {key}={value[:80]!r} holds a control character")


def volume_options(cfg: PluginConfig, req: PublishRequest, namespace: str) -> tuple[dict[str, str], Ceilings]:
    """The daemon's options: cluster defaults, then the volume's attributes, then the namespace's GCS prefix.

    With them, the cluster's ceilings; those an attribute alone can pass are checked here.
    """
    if req.context.get(EPHEMERAL, "true") != "true":
        raise InvalidArgument("tierfs volumes are ephemeral inline volumes: use a csi volume in the pod spec")
    try:
        options, limits = load_settings(cfg.config_file)
    except UserError as e:
        raise FailedPrecondition(f"the plugin's cluster settings are broken: {e}") from None
    admins = dict(options)
    cluster_gcs = options.get("gcs")
    for key, value in req.context.items():
        if key.startswith(POD_INFO):
            continue
        if key not in ATTRIBUTES:
            raise InvalidArgument(
                f"unknown volume attribute {key[:64]!r}"
                + (" (a host path; set by the plugin)" if key in HOST_OPTIONS else "")
                + (" (the node's logs; set by the plugin)" if key in PLUGIN_OPTIONS else "")
                + f": use {', '.join(ATTRIBUTES)}"
            )
        check_value(key, value)
        options[key] = value
    if (
        "gcs" in req.context
        and not cfg.allow_pod_gcs
        and req.context["gcs"].rstrip("/") != (cluster_gcs or "").rstrip("/")
    ):
        raise InvalidArgument(
            f"volume attribute gcs={req.context['gcs'][:200]!r} is refused: on this cluster the plugin's "
            f"ConfigMap (tierfs-config) chooses the GCS bucket and prefix ({cluster_gcs or 'none'}); remove "
            "the attribute, or ask the cluster admin to run the plugin with --allow-pod-gcs"
        )
    if options.get("gcs"):
        options["gcs"] = f"{options['gcs'].rstrip('/')}/{namespace}"  # gs://B/P/<namespace>/<job>/
    if not options.get("job"):
        raise InvalidArgument("volume attribute 'job' is missing: name the training job the volume belongs to")
    try:
        check_job_id(options["job"])
    except UserError as e:
        raise InvalidArgument(f"volume attribute job: {e}") from None
    listen = options.get("listen", "")
    if listen.startswith(":") or (not listen and options.get("peers")):
        if not cfg.node_ip:
            raise InvalidArgument("the volume needs a peer listen address but the plugin has no --node-ip")
        options["listen"] = f"{cfg.node_ip}:{listen[1:] or PEER_PORT}"
    try:
        for key, daemons_default in (("data-path", Config.data_path), ("wake-cpus", "on")):
            if key in req.context:
                limits.check_choice(key, req.context[key], admins.get(key, daemons_default))
        if "engine" in req.context:
            limits.check_engine(
                req.context["engine"], admins.get("engine", Config.engine), admins.get("data-path", Config.data_path)
            )
        limits.check_attributes(options, set(req.context))
        if options.get("listen"):
            try:
                host, port = parse_address(options["listen"], "volume attribute listen")
            except UserError as e:
                raise InvalidArgument(str(e)) from None
            limits.check_listen(host, port, cfg.node_ip)
        limits.check_gcs_secret(options["job"], options.get("gcs"), req.secrets.get("secret"))
    except OverCeiling as e:
        raise InvalidArgument(str(e)) from None
    if options.get("peers") and not req.secrets.get("secret"):
        raise InvalidArgument(
            "volume attribute 'peers' needs the job's peer secret: reference a Secret with key "
            "'secret' in the volume's nodePublishSecretRef"
        )
    secret = req.secrets.get("secret", "")
    if len(secret) > MAX_SECRET or "\0" in secret:
        raise InvalidArgument(
            f"the job's peer secret (key 'secret' of the nodePublishSecretRef) must be at most {MAX_SECRET} "
            "characters with no NUL byte"
        )
    return options, limits


def check_expanded_peers(limits: Ceilings, options: dict[str, str]) -> None:
    """``peers: auto``, once the plugin named the pods: as many addresses as max-peers allows."""
    try:
        limits.check_attributes(options, {"peers"})
    except OverCeiling as e:
        raise InvalidArgument(str(e)) from None


def settle_capacity(req: PublishRequest, options: dict[str, str], limits: Ceilings) -> str:
    """The volume's capacity, in ``options``; returns who chose it, as refusals name it.

    A volume without ``capacity`` gets the admin's default, or a share of the node's
    ceiling; either way every job on the node runs with a capacity the ceilings count.
    """
    fallback = f"{limits.default_capacity(_memory()) >> 20}M"
    if "capacity" in req.context:
        what = f"volume attribute 'capacity' {options['capacity'][:40]}"
    else:
        what = (
            f"the {'ConfigMap' if 'capacity' in options else 'node'}'s default capacity "
            f"{options.setdefault('capacity', fallback)}"
        )
    try:
        parse_size(options["capacity"], "capacity")
    except UserError as e:
        raise InvalidArgument(f"volume attribute capacity: {e}") from None
    return what


def check_node_ceilings(
    options: dict[str, str],
    what: str,
    limits: Ceilings,
    job: str,
    namespace: str,
    node_id: str,
    others: list[dict],
    new_job: bool,
) -> None:
    """The ceilings that count what the node already holds: its jobs (``others``, their records) and their capacities.

    Called under the node-wide lock, with the claim of the job written before it is
    released, so that two jobs published at once never both fit into the same room.
    """
    memory = _memory()
    fallback = f"{limits.default_capacity(memory) >> 20}M"
    held = 0
    for record in others:  # a record of an older plugin may have no capacity: count the default
        try:
            held += parse_size(record.get("options", {}).get("capacity") or fallback)
        except UserError:
            held += parse_size(fallback)
    try:
        if new_job:
            limits.check_jobs(job, namespace, node_id, {r["job"]: r.get("namespace") for r in others})
        limits.check_capacity(parse_size(options["capacity"], "capacity"), what, memory, held)
    except OverCeiling as e:
        raise InvalidArgument(str(e)) from None


def _memory() -> int:
    try:
        return ceilings.mem_total()
    except UserError as e:
        raise FailedPrecondition(str(e)) from None


def check_daemon_options(
    job: str, staging: Path, ramdisk: Path, options: dict[str, str], secret: str | None, token_file: Path | None = None
) -> None:
    """Refuse bad attributes with the daemon's own message, before any process starts
    (``token_file``: the job's service-account token, as the daemon will be given it)."""
    extra = {"gcs_token_file": token_file} if token_file is not None else {}
    try:
        Config.build(
            mountpoint=staging,
            ramdisk=ramdisk,
            secret=secret,
            **extra,
            **{k.replace("-", "_"): v for k, v in options.items()},
        )
    except UserError as e:
        raise InvalidArgument(f"job {job}: {e}") from None
