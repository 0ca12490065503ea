"""One validated configuration object for the daemon and the commands.

Every option (:data:`OPTIONS`, with the other tables of :mod:`tierfs.config.options`)
comes from a command-line flag, a ``-o key=value`` mount option, or the environment
variable ``TIERFS_<NAME>`` (:func:`env_name`); all three end up here and are checked once.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import urllib.parse
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierfs.config.options import DEFAULT_IAM_URL as DEFAULT_IAM_URL
from tierfs.config.options import DEFAULT_STS_URL as DEFAULT_STS_URL
from tierfs.config.options import HOST_ADDRESS_OPTIONS as HOST_ADDRESS_OPTIONS
from tierfs.config.options import HOST_PATH_OPTIONS as HOST_PATH_OPTIONS
from tierfs.config.options import OPTIONS as OPTIONS
from tierfs.config.options import TLS_FILE_OPTIONS as TLS_FILE_OPTIONS
from tierfs.core import chunks, stripes
from tierfs.core.commit import CommitRules, parse_rules
from tierfs.core.errors import UserError
from tierfs.core.keys import ManifestKeys, bucket_seals, manifest_keys, split_secrets
from tierfs.core.logs import DEFAULT_MAX_SIZE, LOG_FORMATS, MIN_MAX_SIZE
from tierfs.core.parse import COORDINATOR_PORT, check_job_id, parse_address, parse_duration, parse_gcs_url, parse_size
from tierfs.discovery.spec import DnsSource, parse_peers

if TYPE_CHECKING:
    from tierfs.core.bucket_seal import ChunkSeal

DEFAULT_RAMDISK = Path("/dev/shm/tierfs")
MAX_TOKEN_FILE = 64 << 10  # a Kubernetes service-account token is ~1 KiB
LOG_LEVELS = ("debug", "info", "warning", "error")


class DataPath(StrEnum):
    """How file bytes travel: str-valued, so flags, status and CSI attributes keep their words."""

    AUTO = "auto"  # passthrough where the kernel allows it, else daemon
    PASSTHROUGH = "passthrough"  # the kernel reads and writes the RAM tier's files itself
    DAEMON = "daemon"  # every byte through the daemon


class Engine(StrEnum):
    """Which FUSE request loop serves the mount: str-valued, as ``--engine`` and status spell it."""

    AUTO = "auto"  # tierfs' own, pyfuse3 where the own one cannot mount
    TIERFS = "tierfs"
    PYFUSE3 = "pyfuse3"  # libfuse: the daemon data path only


def env_name(option: str) -> str:
    """The environment variable of an option: ``data-path`` -> ``TIERFS_DATA_PATH``."""
    return "TIERFS_" + option.upper().replace("-", "_")


def env_value(option: str) -> str | None:
    """The option's value from the environment, or None."""
    return os.environ.get(env_name(option))


@dataclass(frozen=True)
class Config:
    """Everything one mount needs; built by :meth:`build`, which validates it."""

    mountpoint: Path
    ramdisk: Path = DEFAULT_RAMDISK
    job: str = "default"
    rank: int = 0
    nodes: int = 1
    capacity: int | None = None  # bytes; None = whatever the ramdisk's filesystem holds
    data_path: DataPath = DataPath.AUTO
    engine: Engine = Engine.AUTO
    wake_cpus: bool = True  # hold a 0 µs CPU wake-up latency request while requests come in bursts
    foreground: bool = False
    log_level: str = "info"
    log_file: Path | None = None
    log_format: str = "text"  # or "json" (tierfs.core.logs)
    log_max_size: int = DEFAULT_MAX_SIZE  # bytes; 0 = the log never rotates
    read_only: bool = False
    start_fresh: bool = False  # start even if the tiers hold a newer complete step than the one chosen
    restore_step: int | None = None  # a rollback: the step every rank restores (tierfs.pipeline.rollback)
    commit_rule: str = "default"
    gcs: str | None = None  # gs://BUCKET/PREFIX
    disk: Path | None = None  # --disk DIR: a local directory tier (DIR/<job>/rank-<N>/)
    backup_interval: float = 0.0  # seconds between backups of the newest step; 0 = every commit
    keep: int = 3  # committed steps kept in GCS and on --disk per rank
    keep_local: int = 1  # newest committed steps kept in RAM (plus any a tier still needs)
    keep_every: int = 0  # milestones: steps divisible by it outlive --keep in GCS and on --disk; 0: none
    keep_for: float = 0.0  # seconds a milestone is kept after its commit; 0: for good
    prefetch: int = 8  # background fetches of a restore at once; 0 = on demand only
    restore_wait: float = 15.0  # how long a start waits for silent peers before choosing a step
    survey_interval: float = 30.0  # seconds between views of the cluster (retention follows them)
    chunk_size: int = chunks.DEFAULT_CHUNK_SIZE
    gc_grace: float = 600.0  # GCS chunks touched this recently are never collected
    listen: tuple[str, int] | None = None  # where the peer service accepts other nodes
    peers: tuple[tuple[str, int], ...] = ()  # fixed addresses, brace patterns expanded
    peer_dns: tuple[DnsSource, ...] = ()  # names the daemon resolves (and re-resolves)
    replicas: int = 1  # peers that hold a copy of each committed step
    erasure: str | None = None  # "D+P": groups of D+P ranks hold each other's steps as erasure-coded parity instead
    secret: bytes | None = field(default=None, repr=False)  # the job's peer secret
    older_secrets: tuple[bytes, ...] = field(default=(), repr=False)  # only verify manifests made under them
    # Peer traffic: TLS 1.3 keyed from the secret, or from these mounted files (all three or none).
    peer_tls: bool = True
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    topology: tuple[tuple[str, str], ...] = ()  # e.g. (("slice", "a"), ("rack", "r3"))
    data_parallel: int = 1  # data-parallel replicas in the job: ranks nodes/D apart hold the same data
    coordinator: str | None = None  # HOST:PORT of the job's rank-0 coordinator, for jax-init-info.txt
    # Set by the job through the multi-tier checkpointing protocol (replicator.yaml):
    peer_ranks: tuple[int, ...] | None = None  # the ranks holding this rank's data; None: from data_parallel
    backup_interval_steps: int = 0  # back up every N-th step at most; 0 = by time (backup_interval)
    # The job's own GCS identity (Workload Identity Federation): none = the node's default credentials.
    gcs_token_file: Path | None = None  # the job's Kubernetes service-account token, kept fresh by kubelet
    gcs_token_audience: str | None = None  # the workload identity provider it is exchanged at
    gcs_sts_url: str = DEFAULT_STS_URL
    gcs_service_account: str | None = None  # a Google service account to impersonate, if any
    gcs_iam_url: str = DEFAULT_IAM_URL
    metrics: tuple[str, int] | None = None  # where /metrics is served
    mtbf: float | None = None  # seconds: the operator's mean time between the job's failures

    @classmethod
    def build(cls, **values: Any) -> Config:
        """Coerce and validate raw values (strings from flags, env or ``-o``; typed ones from code)."""
        v = {k: val for k, val in values.items() if val is not None}
        if "mountpoint" not in v:
            raise UserError("missing MOUNTPOINT: tierfs mount MOUNTPOINT [options]")
        v["mountpoint"] = Path(os.path.abspath(v["mountpoint"]))
        for key in ("ramdisk", "log_file", "gcs_token_file"):
            if key in v:
                v[key] = Path(os.path.abspath(v[key]))
        for key in ("gcs_token_audience", "gcs_sts_url", "gcs_service_account", "gcs_iam_url"):
            if key in v:
                v[key] = str(v[key]).strip()
        if "disk" in v:
            if not str(v["disk"]).strip():
                raise UserError("invalid --disk '': give a local directory, e.g. /mnt/nvme/tierfs")
            v["disk"] = Path(os.path.abspath(v["disk"]))
        for key in ("rank", "nodes", "restore_step"):
            if key in v:
                v[key] = _parse_int(v[key], key.replace("_", "-"))
        for key in ("capacity", "chunk_size", "log_max_size"):
            if key in v:
                v[key] = parse_size(v[key], key.replace("_", "-"))
        for key in ("backup_interval", "gc_grace", "restore_wait", "survey_interval", "keep_for"):
            if key in v:
                v[key] = parse_duration(v[key], key.replace("_", "-"))
        for key in ("keep", "keep_local", "keep_every", "prefetch", "replicas", "data_parallel"):
            if key in v:
                v[key] = _parse_int(v[key], key.replace("_", "-"))
        if "listen" in v:
            v["listen"] = parse_address(v["listen"], "--listen")
        if "metrics" in v:
            v["metrics"] = parse_address(v["metrics"], "--metrics")
        if "mtbf" in v:
            v["mtbf"] = parse_duration(v["mtbf"], "mtbf")
        if "coordinator" in v:
            text = str(v["coordinator"]).strip()
            host, port = parse_address(text if ":" in text else f"{text}:{COORDINATOR_PORT}", "--coordinator")
            v["coordinator"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if "peers" in v:
            peers = v["peers"]
            if isinstance(peers, str):
                spec = parse_peers(peers)
                peers = spec.addresses
                v["peer_dns"] = spec.sources
            v["peers"] = tuple(p for p in peers if p != v.get("listen"))  # a node is not its own peer
        if "topology" in v and isinstance(v["topology"], str):
            v["topology"] = _parse_labels(v["topology"])
        if v.get("erasure") is not None:
            if "replicas" in v:
                raise UserError("--erasure and --replicas exclude each other: parity replaces the replicas")
            v["erasure"] = str(v["erasure"]).strip()
        secret_file = v.pop("secret_file", None)
        if secret_file is not None:
            try:
                v["secret"] = Path(secret_file).read_bytes()
            except OSError as e:
                raise UserError(f"cannot read --secret-file {secret_file}: {e.strerror}") from None
        if isinstance(v.get("secret"), str):
            v["secret"] = v["secret"].encode()
        if isinstance(v.get("secret"), bytes) and "older_secrets" not in v:
            v["secret"], v["older_secrets"] = split_secrets(v["secret"])
            v["secret"] = v["secret"] or None
        for key in ("log_level", "log_format", "data_path", "engine"):
            if key in v:
                v[key] = str(v[key]).strip().lower()
        for key, choice in (("data_path", DataPath), ("engine", Engine)):
            if v.get(key) in set(choice):  # anything else stays a string, refused by _validate
                v[key] = choice(v[key])
        _parse_peer_tls(v)
        _parse_switch(v, "wake_cpus", "on (the default) or off")
        cfg = cls(**v)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        check_job_id(self.job)
        if self.nodes < 1:
            raise UserError(f"invalid --nodes {self.nodes}: a job has at least 1 node")
        if not 0 <= self.rank < self.nodes:
            raise UserError(
                f"invalid rank {self.rank}: it must be in 0..{self.nodes - 1} for a job of "
                f"{self.nodes} node(s); set --nodes or pick another --rank"
            )
        if self.restore_step is not None and self.restore_step < 0:
            raise UserError(f"invalid --restore-step {self.restore_step}: a step number is 0 or more")
        if self.capacity is not None and self.capacity < 1 << 20:
            raise UserError(f"capacity {self.capacity} bytes is too small: use at least 1M")
        if self.keep < 1:
            raise UserError(f"invalid --keep {self.keep}: keep at least 1 step in GCS")
        if self.keep_local < 1:
            raise UserError(f"invalid --keep-local {self.keep_local}: keep at least 1 step in RAM")
        if self.keep_every < 0 or self.keep_for < 0:
            raise UserError("invalid --keep-every or --keep-for: use 0 (none, for good) or more")
        if self.keep_for and not self.keep_every:
            raise UserError(f"--keep-for {self.keep_for:g}s needs --keep-every: it says how long milestones are kept")
        if self.mtbf is not None and self.mtbf < 60:
            raise UserError(f"invalid --mtbf {self.mtbf:g}s: a job fails at most every minute or so; use e.g. 6h")
        if self.survey_interval < 1:
            raise UserError(f"invalid --survey-interval {self.survey_interval:g}s: use at least 1s")
        if not 0 <= self.prefetch <= 256:
            raise UserError(f"invalid --prefetch {self.prefetch}: use 0 (on demand only) to 256")
        # The bounds every reader of a chunk (GCS frames, peer bodies, manifests) holds to.
        if not chunks.MIN_CHUNK_SIZE <= self.chunk_size <= chunks.MAX_CHUNK_SIZE or self.chunk_size % 4096:
            raise UserError(
                f"invalid --chunk-size {self.chunk_size}: use a multiple of 4K between "
                f"{chunks.MIN_CHUNK_SIZE >> 10}K and {chunks.MAX_CHUNK_SIZE >> 20}M"
            )
        parse_rules(self.commit_rule)  # a bad rule is a start-up error, not a later surprise
        if (self.peers or self.peer_dns or self.listen) and not self.secret:
            raise UserError("the peer service needs the job's secret: set TIERFS_SECRET or --secret-file")
        if any(len(s) < 16 for s in (self.secret or b"x" * 16, *self.older_secrets)):
            raise UserError("the job secret is too short: use at least 16 characters (tierfs secret makes a good one)")
        _check_peer_tls(self)
        if self.peers and not self.peer_dns and not 1 <= self.replicas <= len(self.peers):
            raise UserError(f"invalid --replicas {self.replicas}: between 1 and the {len(self.peers)} peer(s) given")
        if self.peer_dns and self.replicas < 1:
            raise UserError(f"invalid --replicas {self.replicas}: at least 1")
        _check_erasure(self)
        if self.data_parallel < 1 or self.nodes % self.data_parallel:
            raise UserError(f"invalid --data-parallel {self.data_parallel}: it must divide --nodes {self.nodes}")
        if self.gcs is not None:
            parse_gcs_url(self.gcs)
        _check_gcs_identity(self)
        if not isinstance(self.data_path, DataPath):
            raise UserError(f"invalid --data-path {self.data_path!r}: use auto, passthrough or daemon")
        if not isinstance(self.engine, Engine):
            raise UserError(f"invalid --engine {self.engine!r}: use auto, tierfs or pyfuse3")
        if self.engine == Engine.PYFUSE3 and self.data_path == DataPath.PASSTHROUGH:
            raise UserError("--engine pyfuse3 cannot pass files through: use --data-path daemon or auto")
        if self.log_level not in LOG_LEVELS:
            raise UserError(f"invalid log level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        if self.log_format not in LOG_FORMATS:
            raise UserError(f"invalid --log-format {self.log_format!r}: use text or json")
        if 0 < self.log_max_size < MIN_MAX_SIZE:
            raise UserError(
                f"invalid --log-max-size {self.log_max_size}: use 0 (never rotate) or at least {MIN_MAX_SIZE >> 10}K"
            )

    @property
    def rules(self) -> CommitRules:
        return CommitRules(parse_rules(self.commit_rule))

    @property
    def manifest_keys(self) -> ManifestKeys | None:
        """The keys that seal and check this job's manifests: its secret and the older ones."""
        return manifest_keys(self.job, self.secret, self.older_secrets)

    @property
    def bucket_seals(self) -> tuple[ChunkSeal, ...]:
        """The seals of this job's chunks in buckets: its secret's, then the older ones'; none without one."""
        return bucket_seals(self.job, self.secret, self.older_secrets)

    @property
    def erasure_shape(self) -> stripes.Group | None:
        """The D+P of ``--erasure``, or None: the peers then keep ``--replicas`` copies."""
        return stripes.parse_shape(self.erasure) if self.erasure is not None else None

    @property
    def rank_dir(self) -> Path:
        """This (job, rank)'s own directory on the RAM tier."""
        return self.ramdisk / self.job / f"rank-{self.rank}"


_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
_TLS_FILES = ("tls_cert", "tls_key", "tls_ca")


def _parse_switch(v: dict[str, Any], key: str, choices: str) -> None:
    """An on/off option, in place in the raw values."""
    if key in v and not isinstance(v[key], bool):
        text = str(v[key]).strip().lower()
        if text not in _ON + _OFF:
            raise UserError(f"invalid --{key.replace('_', '-')} {v[key]!r}: use {choices}")
        v[key] = text in _ON


def _parse_peer_tls(v: dict[str, Any]) -> None:
    _parse_switch(v, "peer_tls", "on (the default: encrypted) or off (in clear, for a network you trust)")
    for key in _TLS_FILES:
        if key in v:
            v[key] = Path(os.path.abspath(v[key]))


def _check_erasure(cfg: Config) -> None:
    """``--erasure D+P``: a shape a group can have, among enough ranks, with peers to send parity to."""
    if cfg.erasure is None:
        return
    try:
        shape = stripes.parse_shape(cfg.erasure)
    except stripes.BadGroup as e:
        why = str(e).removeprefix(f"--erasure {cfg.erasure!r}: ")
        raise UserError(f"invalid --erasure {cfg.erasure!r}: {why}") from None
    if cfg.nodes < shape.size:
        raise UserError(
            f"invalid --erasure {cfg.erasure}: a group has {shape.size} ranks and the job has {cfg.nodes} (--nodes)"
        )
    if not cfg.listen or not (cfg.peers or cfg.peer_dns):
        raise UserError(f"--erasure {cfg.erasure} needs the peer service: give --listen and --peers")


def _check_peer_tls(cfg: Config) -> None:
    given = [key for key in _TLS_FILES if getattr(cfg, key) is not None]
    if not given:
        return
    if not cfg.peer_tls:
        raise UserError("--tls-cert, --tls-key and --tls-ca need --peer-tls on: drop them, or --peer-tls off")
    if len(given) < len(_TLS_FILES):
        raise UserError(
            "--tls-cert, --tls-key and --tls-ca go together: give all three, or none to key TLS from the job's secret"
        )
    for key in _TLS_FILES:  # whether they hold PEM is checked where TLS is set up (tierfs.peers.tls)
        try:
            with open(getattr(cfg, key), "rb"):
                pass
        except OSError as e:
            raise UserError(f"cannot read --{key.replace('_', '-')} {getattr(cfg, key)}: {e.strerror}") from None


def _check_gcs_identity(cfg: Config) -> None:
    """The job's own GCS identity: a readable token file and an audience go together; the rest needs them."""
    if cfg.gcs_token_file is None:
        for key, unset in (
            ("gcs_token_audience", None),
            ("gcs_service_account", None),
            ("gcs_sts_url", DEFAULT_STS_URL),
            ("gcs_iam_url", DEFAULT_IAM_URL),
        ):
            if getattr(cfg, key) != unset:
                raise UserError(
                    f"--{key.replace('_', '-')} needs --gcs-token-file, the job's Kubernetes "
                    "service-account token: give both, or neither to use the node's credentials"
                )
        return
    read_token_file(cfg.gcs_token_file)
    audience = cfg.gcs_token_audience
    if not audience:
        raise UserError(
            "--gcs-token-file needs --gcs-token-audience: the workload identity provider to exchange "
            "the token at, e.g. identitynamespace:PROJECT.svc.id.goog:https://container.googleapis.com/"
            "v1/projects/PROJECT/locations/LOCATION/clusters/CLUSTER"
        )
    if (
        not audience.startswith(("//iam.googleapis.com/", "identitynamespace:"))
        or len(audience) > 1024
        or re.search(r"\s", audience)
    ):
        raise UserError(
            f"invalid --gcs-token-audience {audience[:200]!r}: use //iam.googleapis.com/projects/NUM/"
            "locations/global/workloadIdentityPools/POOL/providers/PROVIDER or identitynamespace:"
            "PROJECT.svc.id.goog:https://container.googleapis.com/v1/projects/P/locations/L/clusters/C"
        )
    _check_endpoint(cfg.gcs_sts_url, "gcs-sts-url")
    _check_endpoint(cfg.gcs_iam_url, "gcs-iam-url")
    account = cfg.gcs_service_account
    if account is not None and not re.fullmatch(r"[A-Za-z0-9._-]{1,100}@[A-Za-z0-9.-]{1,200}\.[A-Za-z]{2,}", account):
        raise UserError(
            f"invalid --gcs-service-account {account[:200]!r}: give the service account's email, "
            "e.g. NAME@PROJECT.iam.gserviceaccount.com"
        )


def _check_endpoint(url: str, flag: str) -> None:
    """The job's token goes there: HTTPS, or plain HTTP only to this host (a stand-in in tests)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        host, parts = None, None
    local = host in ("127.0.0.1", "localhost", "::1")
    if (
        parts is None
        or not host
        or re.search(r"\s", url)
        or len(url) > 1024
        or not (parts.scheme == "https" or (parts.scheme == "http" and local))
    ):
        raise UserError(f"invalid --{flag} {url[:200]!r}: use an https:// URL (http:// only to 127.0.0.1)")


def read_token_file(path: Path) -> str:
    """The token ``path`` holds now (kubelet refreshes it, so it is read anew each time), or a UserError.

    The file must be a regular file, not a symbolic link, at most :data:`MAX_TOKEN_FILE` bytes,
    owned by root or this user, and writable by nobody else: whoever can write it chooses the
    identity the job's backups run as.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise UserError(f"cannot read --gcs-token-file {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"invalid --gcs-token-file {path}: not a regular file")
        if st.st_uid not in (0, os.geteuid()):
            raise UserError(f"invalid --gcs-token-file {path}: owned by uid {st.st_uid}, not root")
        if st.st_mode & 0o022:
            raise UserError(f"invalid --gcs-token-file {path}: writable by group or others (chmod go-w)")
        data = b""
        while len(data) <= MAX_TOKEN_FILE and (part := os.read(fd, MAX_TOKEN_FILE + 1 - len(data))):
            data += part
    except OSError as e:
        raise UserError(f"cannot read --gcs-token-file {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE:
        raise UserError(f"invalid --gcs-token-file {path}: larger than {MAX_TOKEN_FILE >> 10} KiB, not a token")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        token = ""
    if not token or re.search(r"\s", token):
        raise UserError(f"invalid --gcs-token-file {path}: it holds no token (one line of ASCII, a JWT)")
    return token


def _parse_labels(text: str) -> tuple[tuple[str, str], ...]:
    labels = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"invalid --topology label {item!r}: use key=value,... e.g. slice=a,rack=r3")
        labels.append((key, value))
    return tuple(labels)


def _parse_int(value: Any, name: str) -> int:  # a raw value of any type: int() says if it is a number
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(f"invalid {name} {value!r}: expected a whole number") from None
