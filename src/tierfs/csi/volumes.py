"""The node's tierfs volumes: one daemon per job, bind-mounted into every pod that asks.

A job's daemon outlives its pods. The next pod of the job (a restart after a failure, the
next attempt of a JobSet) finds the RAM tier already mounted, its steps already listed,
and replication and backup still running in between. Everything the plugin knows lives
under its state directory, so a restarted plugin picks up where it was:

    jobs/<job>.json      the job on this node: rank (sticky), namespace, daemon options, idle since
    jobs/<job>.secret    the job's peer secret, to restart its daemon without a pod
    volumes/<id>.json    one published volume: target path, read-only, job, request digest
    mnt/<job>/           the daemon's FUSE mount, the source of every bind mount
    keepers/<key>.sock   where the keeper of a job's mount offers its connection to the next plugin
    logs/<job>.log       the daemon's log
    node.key             this node's random key for request digests

The directories are root-only (0700) and every record and the key are 0600: they name
jobs, namespaces and targets, and the secrets' files are among them. A request digest is
an HMAC under the node's key, so it tells a repeated publish from another one without
letting anyone who reads a record check guesses of the secret offline.

Tenancy: a job id belongs to a namespace. On a node, the first namespace that publishes
the job holds it until the job is collected; across nodes, each namespace backs up under
a GCS prefix of its own (:mod:`tierfs.csi.settings`).

The RAM data of a job is removed only by :meth:`Volumes.collect_idle` (no pod of the job
on this node for ``gc_after``) or :meth:`Volumes.remove_job` (``tierfs csi --gc JOB``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tierfs.config import OPTIONS, env_name
from tierfs.core import linux, mounts
from tierfs.core.atomic import write_atomically
from tierfs.core.errors import UserError
from tierfs.core.parse import check_job_id
from tierfs.csi import kube
from tierfs.csi.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    VolumeError,
)
from tierfs.csi.settings import (
    AUTO,
    POD_NAME,
    POD_NAMESPACE,
    PluginConfig,
    PublishRequest,
    check_daemon_options,
    check_node_ceilings,
    request_namespace,
    volume_options,
)
from tierfs.ramtier.tmpfs import delete_ram_data

log = logging.getLogger("tierfs.csi")

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
KEY_BYTES = 32


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _write_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data), PRIVATE_FILE)


def _same_request(record: dict, req: PublishRequest, digest: str) -> bool:
    if "request" in record:
        return hmac.compare_digest(record["request"], digest)
    return record["target"] == req.target and record["read_only"] == req.read_only  # an older plugin's record


def _alive(path: Path | str) -> bool:
    entry = mounts.find_mount(path)
    return entry is not None and entry.fstype == mounts.FSTYPE and not mounts.is_dead(path)


def _unmount_target(target: str) -> None:
    """Remove our mount from a pod's target path, even a dead or busy one."""
    while (entry := mounts.find_mount(target)) is not None and entry.fstype == mounts.FSTYPE:
        try:
            linux.umount(target, linux.MNT_DETACH if mounts.is_dead(target) else 0)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            linux.umount(target, linux.MNT_DETACH)


class _PodOnce:
    """The publishing pod from the Kubernetes API, read at most once per publish."""

    def __init__(self, client: kube.KubeClient, req: PublishRequest):
        self.client, self.name, self.namespace = client, req.context.get(POD_NAME), req.context.get(POD_NAMESPACE)
        self._pod: dict | None = None

    def __call__(self) -> dict:
        if self._pod is None:
            if not self.name or not self.namespace:
                raise kube.RankUnknown("kubelet passed no pod name (is podInfoOnMount true on the CSIDriver?)")
            try:
                kube.check_pod_name(self.name)
            except ValueError as e:
                raise kube.RankUnknown(str(e)) from None
            self._pod = self.client.pod(self.namespace, self.name)
        return self._pod


class Volumes:
    """Publish, unpublish, adopt and collect; callers may be concurrent threads or processes."""

    def __init__(self, cfg: PluginConfig, kube_client: kube.KubeClient | None = None):
        self.cfg = cfg
        self.kube = kube_client or kube.KubeClient(cfg.kube_api)
        self._thread_lock = threading.Lock()
        self.instance = secrets.token_hex(8)  # this plugin process: the keepers it started are its own
        for sub in ("jobs", "volumes", "mnt", "logs", "keepers"):
            (cfg.state_dir / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(cfg.state_dir / sub, PRIVATE_DIR)  # also when an older plugin made it 0755
        with self._locked():
            self._key = self._node_key()
            self._make_records_private()

    def _node_key(self) -> bytes:
        """The node's random key for request digests, made once (root-only)."""
        path = self.cfg.state_dir / "node.key"
        try:
            with open(path, "rb") as f:
                key = bytes.fromhex(f.read(2 * KEY_BYTES + 1).decode("ascii", "replace"))
        except (FileNotFoundError, ValueError):
            key = b""
        if len(key) != KEY_BYTES:
            key = secrets.token_bytes(KEY_BYTES)
            write_atomically(path, key.hex(), PRIVATE_FILE)
        os.chmod(path, PRIVATE_FILE)
        return key

    def _make_records_private(self) -> None:
        """Records an older plugin left: 0600, and no unkeyed digest of a secret in them."""
        for path in [*(self.cfg.state_dir / "jobs").iterdir(), *(self.cfg.state_dir / "volumes").iterdir()]:
            os.chmod(path, PRIVATE_FILE)
            if path.parent.name == "volumes" and path.suffix == ".json":
                record = _read_json(path)
                if record is not None and "fingerprint" in record:
                    del record["fingerprint"]  # kubelet's repeat is then recognised by target alone
                    _write_json(path, record)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One operation at a time on this node: threads of this plugin and ``tierfs csi --gc``."""
        with self._thread_lock, open(self.cfg.state_dir / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    # -- paths and records -------------------------------------------------------------

    def _job_path(self, job: str) -> Path:
        return self.cfg.state_dir / "jobs" / f"{job}.json"

    def _secret_path(self, job: str) -> Path:
        return self.cfg.state_dir / "jobs" / f"{job}.secret"

    def _volume_path(self, volume_id: str) -> Path:
        name = hashlib.sha256(volume_id.encode()).hexdigest()[:32]  # ids are opaque to us
        return self.cfg.state_dir / "volumes" / f"{name}.json"

    def _keeper_socket(self, job: str) -> Path:
        """Short whatever the job id: a unix socket's path has at most 107 bytes."""
        return self.cfg.state_dir / "keepers" / f"{hashlib.sha256(job.encode()).hexdigest()[:16]}.sock"

    def staging(self, job: str) -> Path:
        return self.cfg.state_dir / "mnt" / job

    def volumes(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.cfg.state_dir / "volumes").glob("*.json"))]

    def _volumes_of(self, job: str) -> list[dict]:
        return [v for v in self.volumes() if v["job"] == job]

    # -- publish -----------------------------------------------------------------------

    def publish(self, req: PublishRequest) -> None:
        with self._locked():
            digest = req.digest(self._key)
            record = _read_json(self._volume_path(req.volume_id))
            if record is not None and not _same_request(record, req, digest):
                raise AlreadyExists(
                    f"volume {req.volume_id} is already published at {record['target']} with other "
                    "arguments; unpublish it first"
                )
            if record is not None and _alive(req.target):
                if "request" not in record:  # an older plugin's record: store the keyed digest now
                    _write_json(self._volume_path(req.volume_id), {**record, "request": digest})
                return  # the same call again: done already
            namespace = request_namespace(req)
            options, limits = volume_options(self.cfg, req, namespace)
            job = options["job"]
            self._check_owner(job, namespace)
            others = [r for p in sorted((self.cfg.state_dir / "jobs").glob("*.json"))
                      if (r := _read_json(p)) is not None and r.get("job") != job]
            new_job = _read_json(self._job_path(job)) is None  # a job already held is no new job
            check_node_ceilings(req, options, limits, job, namespace, self.cfg.node_id, others, new_job)
            pod = _PodOnce(self.kube, req)
            rank = self._rank(job, options, pod)
            if options.get("peers", "").strip().lower() == AUTO:
                options["peers"] = self._auto_peers(job, options, pod)
            staging = self._ensure_daemon(job, rank, namespace, options, req.secrets.get("secret"))
            os.makedirs(req.target, exist_ok=True)
            _unmount_target(req.target)  # a dead mount left by a crash, same volume
            linux.bind_mount(str(staging), req.target, read_only=req.read_only)
            _write_json(self._volume_path(req.volume_id), {
                "volume_id": req.volume_id, "target": req.target, "read_only": req.read_only,
                "job": job, "rank": rank, "request": digest, "published": time.time(),
            })
            self._touch_job(job, idle=False)
            log.info("published %s: job %s rank %d at %s%s", req.volume_id, job, rank, req.target,
                     " (read-only)" if req.read_only else "")

    def _check_owner(self, job: str, namespace: str) -> None:
        """A job id on this node belongs to one namespace, from its first pod until the job is collected."""
        held = _read_json(self._job_path(job))
        if held is not None and held.get("namespace") != namespace:
            raise FailedPrecondition(
                f"job {job} on node {self.cfg.node_id} belongs to namespace {held.get('namespace')!r}; "
                "pick another job name"
            )
        if held is None and (self.cfg.ramdisk / job).exists():
            raise FailedPrecondition(
                f"node {self.cfg.node_id} holds RAM data of job {job} that no namespace owns; pick another job "
                f"name, or have the admin delete it with `tierfs csi --gc {job}`"
            )

    def _auto_peers(self, job: str, options: dict[str, str], pod: _PodOnce) -> str:
        """``peers: auto``: every pod of the pod's JobSet or Indexed Job, as one brace pattern."""
        try:
            nodes = int(options.get("nodes", "1"))
            port = int(options["listen"].rpartition(":")[2])
            return kube.peer_pattern(pod(), pod.namespace, nodes, port)
        except (kube.RankUnknown, kube.PeersUnknown, ValueError) as e:
            raise InvalidArgument(
                f"volume attribute peers=auto: cannot name the pods of job {job}: {e}; list the peers "
                "instead (e.g. a pattern like name-{0..15}.service.namespace.svc:7420)"
            ) from None

    def _rank(self, job: str, options: dict[str, str], pod: _PodOnce) -> int:
        """Explicit attribute, else the rank this node already holds for the job, else the pod's index.

        A node keeps its rank for a job (its RAM holds that rank's steps), whatever index
        the next pod scheduled here has; jax-init-info.txt tells the job which it got.
        """
        if "rank" in options:
            try:
                return int(options["rank"])
            except ValueError:
                raise InvalidArgument(f"volume attribute rank={options['rank']!r} is not a number") from None
        held = _read_json(self._job_path(job))
        if held is not None:
            return held["rank"]
        try:
            nodes = int(options.get("nodes", "1"))
            return kube.parse_pod(pod()).rank(nodes)
        except (kube.RankUnknown, ValueError) as e:
            raise InvalidArgument(
                f"cannot work out the rank of job {job} on node {self.cfg.node_id}: {e}; run the pod in an "
                "Indexed Job or a JobSet, or set volume attribute 'rank'"
            ) from None

    def _ensure_daemon(self, job: str, rank: int, namespace: str, options: dict[str, str],
                       secret: str | None) -> Path:
        """Reuse the job's running daemon when it runs with these options; start it otherwise."""
        staging = self.staging(job)
        held = _read_json(self._job_path(job))
        wanted = {**options, "rank": str(rank)}
        check_daemon_options(job, staging, self.cfg.ramdisk, wanted, secret)  # a bad value is the pod's error, whatever runs
        secret_path = self._secret_path(job)
        same_secret = secret_path.exists() and secret_path.read_text() == (secret or "")
        if _alive(staging):
            if held is not None and held["options"] == wanted and same_secret:
                return staging
            others = self._volumes_of(job)
            if others:
                before = held["options"] if held else {}
                changed = sorted(k for k in wanted.keys() | before.keys() if before.get(k) != wanted.get(k))
                raise FailedPrecondition(
                    f"job {job} is mounted on node {self.cfg.node_id} by {len(others)} other pod(s) with other "
                    f"settings ({', '.join(changed) or 'secret'}); give every pod of the job the same attributes"
                )
            mounts.unmount(staging)
        write_atomically(secret_path, secret or "", PRIVATE_FILE)
        # The record (and so the namespace's claim) before the daemon writes any RAM data; idle
        # until the publish completes, so that data of a daemon that failed to start is collected.
        _write_json(self._job_path(job), {"job": job, "rank": rank, "namespace": namespace,
                                          "options": wanted, "idle_since": time.time()})
        self._start_daemon(job, staging, wanted)
        return staging

    def _start_daemon(self, job: str, staging: Path, options: dict[str, str], take_over: bool = False) -> None:
        """Start the job's keeper and daemon; ``take_over``: the live mount of another
        plugin's keeper, whose connection the new keeper takes (the daemon restarts, the
        job's pods see a pause)."""
        if not take_over and mounts.find_mount(staging) is not None:  # dead: its daemon was killed
            linux.umount(str(staging), linux.MNT_DETACH)
        staging.mkdir(parents=True, exist_ok=True)
        args = [*self.cfg.tierfs, "mount", str(staging), "--ramdisk", str(self.cfg.ramdisk),
                "--log-file", str(self.cfg.state_dir / "logs" / f"{job}.log")]
        args += [f"--{key}={value}" for key, value in sorted(options.items())]  # one word each: never a flag
        options_env = {env_name(name) for name in (*OPTIONS, "secret")}
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("TIERFS_") and env_name(k[7:]) in options_env)}
        secret = self._secret_path(job).read_text()
        if secret:
            env["TIERFS_SECRET"] = secret
        env[mounts.KEEPER_SOCKET] = str(self._keeper_socket(job))
        if take_over:
            env[mounts.ADOPT_FROM] = env[mounts.KEEPER_SOCKET]
        if self.cfg.keeper_cgroup is not None:
            env[mounts.KEEPER_CGROUP] = str(self.cfg.keeper_cgroup / job)
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            message = (proc.stderr.strip().splitlines() or ["no message"])[-1]
            raise VolumeError(f"could not start tierfs for job {job}: {message.removeprefix('tierfs: ')}")
        held = _read_json(self._job_path(job))
        if held is not None:
            _write_json(self._job_path(job), {**held, "keeper_of": self.instance})
        log.info("%s tierfs for job %s rank %s at %s", "took over" if take_over else "started", job,
                 options["rank"], staging)

    def _touch_job(self, job: str, idle: bool) -> None:
        held = _read_json(self._job_path(job))
        if held is not None:
            held["idle_since"] = time.time() if idle else None
            _write_json(self._job_path(job), held)

    # -- unpublish and stats -----------------------------------------------------------

    def unpublish(self, volume_id: str, target: str) -> None:
        """Unmount the pod's view; the daemon and its RAM data stay for the job's next pod."""
        with self._locked():
            record = _read_json(self._volume_path(volume_id))
            _unmount_target(target)
            try:
                os.rmdir(target)
            except FileNotFoundError:
                pass
            except OSError as e:
                if e.errno != errno.ENOTEMPTY or record is not None:
                    raise VolumeError(f"cannot remove target {target}: {e.strerror}") from None
            if record is not None:
                self._volume_path(volume_id).unlink()
                if not self._volumes_of(record["job"]):
                    self._touch_job(record["job"], idle=True)
                log.info("unpublished %s from %s", volume_id, target)

    def stats(self, volume_id: str, path: str) -> tuple[os.statvfs_result | None, str | None]:
        """The volume's usage, or None and what is wrong with it."""
        record = _read_json(self._volume_path(volume_id))
        if record is None:
            raise NotFound(f"volume {volume_id} is not published on node {self.cfg.node_id}")
        if os.path.abspath(path) != record["target"]:
            raise NotFound(f"volume {volume_id} is published at {record['target']}, not at {path}")
        try:
            return os.statvfs(path), None
        except OSError as e:
            return None, f"the tierfs daemon of job {record['job']} does not answer ({e.strerror})"

    # -- restart and garbage collection ------------------------------------------------

    def adopt(self) -> None:
        """After a plugin restart: take the live mounts over from the keepers of the plugin
        before (a rollout: they run its build, in its container), restart dead daemons of
        published volumes, mount their targets again."""
        with self._locked():
            for path in sorted((self.cfg.state_dir / "jobs").glob("*.json")):
                held = json.loads(path.read_text())
                staging = self.staging(held["job"])
                if held.get("keeper_of") != self.instance and _alive(staging):
                    try:
                        self._start_daemon(held["job"], staging, held["options"], take_over=True)
                    except VolumeError as e:  # the old keeper serves on
                        log.error("job %s: %s", held["job"], e)
            for record in self.volumes():
                job, target = record["job"], record["target"]
                if _alive(target):
                    continue
                # A dead mount answers stat() with ENOTCONN: only a target with no mount and no
                # directory is one whose pod went while the plugin was away.
                if mounts.find_mount(target) is None and not os.path.isdir(target):
                    self._volume_path(record["volume_id"]).unlink()
                    continue
                held = _read_json(self._job_path(job))
                if held is None:
                    log.error("volume %s: no record of job %s; unpublish and publish it again", record["volume_id"], job)
                    continue
                staging = self.staging(job)
                try:
                    if not _alive(staging):
                        self._start_daemon(job, staging, held["options"])
                    _unmount_target(target)
                    linux.bind_mount(str(staging), target, read_only=record["read_only"])
                    log.info("adopted %s: job %s at %s mounted again", record["volume_id"], job, target)
                except (OSError, VolumeError) as e:
                    log.error("volume %s at %s: %s", record["volume_id"], target, e)
            for path in sorted((self.cfg.state_dir / "jobs").glob("*.json")):
                held = json.loads(path.read_text())
                if not self._volumes_of(held["job"]) and held.get("idle_since") is None:
                    self._touch_job(held["job"], idle=True)

    def collect_idle(self, now: float | None = None) -> list[str]:
        """Remove the jobs no pod has used on this node for ``gc_after``: daemon, RAM data, records."""
        if not self.cfg.gc_after:
            return []
        now = time.time() if now is None else now
        removed = []
        for path in sorted((self.cfg.state_dir / "jobs").glob("*.json")):
            held = json.loads(path.read_text())
            since = held.get("idle_since")
            if since is not None and now - since >= self.cfg.gc_after:
                try:
                    self.remove_job(held["job"])
                    removed.append(held["job"])
                except VolumeError as e:
                    log.warning("not collecting job %s: %s", held["job"], e)
        return removed

    def remove_job(self, job: str) -> None:
        try:
            check_job_id(job)  # it names directories that are about to go
        except UserError as e:
            raise InvalidArgument(str(e)) from None
        with self._locked():
            published = self._volumes_of(job)
            if published:
                raise FailedPrecondition(
                    f"job {job} still has {len(published)} published volume(s) on node "
                    f"{self.cfg.node_id}: delete its pods first"
                )
            held = _read_json(self._job_path(job))
            staging = self.staging(job)
            if mounts.find_mount(staging) is not None:
                try:
                    mounts.unmount(staging)
                except UserError as e:
                    raise VolumeError(str(e)) from None
            if held is None and not (self.cfg.ramdisk / job).exists():
                raise NotFound(f"job {job} has no data on node {self.cfg.node_id}")
            try:  # a rank's tmpfs of its own (--capacity) would keep its data and its directory
                delete_ram_data(self.cfg.ramdisk / job)
            except OSError as e:
                raise VolumeError(f"could not delete the RAM tier of job {job}: {e.strerror}") from None
            for path in (self._job_path(job), self._secret_path(job),
                         self.cfg.state_dir / "logs" / f"{job}.log"):
                path.unlink(missing_ok=True)
            if staging.is_dir():
                staging.rmdir()
            log.info("removed job %s: daemon stopped, RAM data deleted", job)
