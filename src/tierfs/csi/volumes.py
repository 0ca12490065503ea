"""The node's tierfs volumes: one daemon per job, bind-mounted into every pod that asks.

A job's daemon outlives its pods. The next pod of the job (a restart after a failure, the
next attempt of a JobSet) finds the RAM tier already mounted, its steps already listed,
and replication and backup still running in between. Everything the plugin knows lives
under its state directory, so a restarted plugin picks up where it was:

    jobs/<job>.json      the job on this node: rank (sticky), namespace, daemon options, idle since
    jobs/<job>.secret    the job's peer secret, to restart its daemon without a pod
    tokens/<job>.token   the pod's service-account token, the job's GCS identity (:mod:`tierfs.csi.tokens`)
    volumes/<id>.json    one published volume: target path, read-only, job, request digest, pod
    mnt/<job>/           the daemon's FUSE mount, the source of every bind mount
    keepers/<key>.sock   where the keeper of a job's mount offers its connection to the next plugin
    logs/<job>.log       the daemon's log
    locks/<job>.lock     the job's lock (:mod:`tierfs.csi.locks`); ``lock`` is the node-wide one
    node.key             this node's random key for request digests

The directories are root-only (0700) and every record and the key are 0600: they name
jobs, namespaces and targets, and the secrets' files are among them. A request digest is
an HMAC under the node's key, so it tells a repeated publish from another one without
letting anyone who reads a record check guesses of the secret offline.

Tenancy: a job id belongs to a namespace. On a node, the first namespace that publishes
the job holds it until the job is collected; across nodes, each namespace backs up under
a GCS prefix of its own (:mod:`tierfs.csi.settings`).

Calls on different jobs run side by side: each works under its job's lock, and takes the
node-wide lock only to count jobs and capacities against the ceilings and claim its place.
A call that finds its job busy for ``JOB_WAIT`` answers ABORTED and kubelet retries, so
calls stuck behind one job's slow daemon start never pile up on the plugin's threads.

The RAM data of a job is removed only by :meth:`Volumes.collect_idle` (no pod of the job
on this node for ``gc_after``) or :meth:`Volumes.remove_job` (``tierfs csi --gc JOB``).
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tierfs.core import linux, mounts
from tierfs.core.atomic import write_atomically
from tierfs.core.errors import UserError
from tierfs.core.parse import check_job_id
from tierfs.csi import kube
from tierfs.csi.errors import Aborted, AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, VolumeError
from tierfs.csi.launch import start_daemon
from tierfs.csi.locks import Busy
from tierfs.csi.records import PRIVATE_FILE, StateDir, pod_of
from tierfs.csi.records import alive as _alive
from tierfs.csi.records import read_json as _read_json
from tierfs.csi.records import write_json as _write_json
from tierfs.csi.settings import (
    AUTO,
    POD_NAME,
    POD_NAMESPACE,
    PluginConfig,
    PublishRequest,
    check_daemon_options,
    check_expanded_peers,
    check_node_ceilings,
    request_namespace,
    settle_capacity,
    volume_options,
)
from tierfs.csi.tokens import pod_token, write_token
from tierfs.ramtier.tmpfs import delete_ram_data

log = logging.getLogger("tierfs.csi")

JOB_WAIT = 5.0  # seconds a kubelet call waits for another call on the same job before ABORTED


def _same_request(record: dict, req: PublishRequest, digest: str) -> bool:
    if "request" in record:
        return hmac.compare_digest(record["request"], digest)
    return record["target"] == req.target and record["read_only"] == req.read_only  # an older plugin's record


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
        self._pod: tuple[dict, str] | None = None

    def __call__(self) -> dict:
        return self.read()[0]

    def read(self) -> tuple[dict, str]:
        """The pod, and the namespace it was read from."""
        if self._pod is None:
            if not self.name or not self.namespace:
                raise kube.RankUnknown("kubelet passed no pod name (is podInfoOnMount true on the CSIDriver?)")
            try:
                kube.check_pod_name(self.name)
            except ValueError as e:
                raise kube.RankUnknown(str(e)) from None
            self._pod = self.client.pod(self.namespace, self.name), self.namespace
        return self._pod


class Volumes(StateDir):
    """Publish, unpublish, adopt and collect; callers may be concurrent threads or processes."""

    def __init__(self, cfg: PluginConfig, kube_client: kube.KubeClient | None = None):
        super().__init__(cfg.state_dir)
        self.cfg = cfg
        self.kube = kube_client or kube.KubeClient(cfg.kube_api)
        self.instance = secrets.token_hex(8)  # this plugin process: the keepers it started are its own

    @contextmanager
    def _working_on(self, job: str) -> Iterator[None]:
        """The job's lock for a kubelet call: ABORTED (kubelet retries) if another call keeps it ``JOB_WAIT``."""
        with ExitStack() as stack:
            try:
                stack.enter_context(self.locks.job(job, JOB_WAIT))
            except Busy:
                raise Aborted(
                    f"job {job} on node {self.cfg.node_id} is busy with another call (its daemon may "
                    "be starting): kubelet retries"
                ) from None
            yield

    # -- publish -----------------------------------------------------------------------

    def publish(self, req: PublishRequest) -> None:
        """Check, claim the job's place on the node, start or reuse its daemon, bind-mount it."""
        digest = req.digest(self._key)
        token = pod_token(req.context)
        if self._published(req, digest, locked=False, token=token):
            return  # the same call again (a republish: with a fresh token): done already
        namespace = request_namespace(req)
        options, limits = volume_options(self.cfg, req, namespace)
        job = options["job"]
        what = settle_capacity(req, options, limits)
        with self._working_on(job):
            if self._published(req, digest, locked=True, token=token):
                return
            if token is not None and options.get("gcs-token-audience"):  # the admin set up the job's identity
                write_token(self._token_path(job), token)
            self._check_owner(job, namespace)
            pod = _PodOnce(self.kube, req)
            rank = self._rank(job, options, pod)
            if options.get("peers", "").strip().lower() == AUTO:
                options["peers"] = self._auto_peers(job, options, pod)
                check_expanded_peers(limits, options)
            secret = req.secrets.get("secret")
            wanted, start = self._plan_daemon(job, rank, options, secret)
            with self.locks.node():  # bookkeeping only: count the node's jobs and claim this one's place
                others = [r for r in self._jobs() if r.get("job") != job]
                new_job = _read_json(self._job_path(job)) is None  # a job already held is no new job
                check_node_ceilings(options, what, limits, job, namespace, self.cfg.node_id, others, new_job)
                if start:  # idle until the publish completes: a daemon that fails to start is collected
                    _write_json(
                        self._job_path(job),
                        {
                            "job": job,
                            "rank": rank,
                            "namespace": namespace,
                            "options": wanted,
                            "idle_since": time.time(),
                        },
                    )
            if start:
                self._launch(job, wanted, secret)
            os.makedirs(req.target, exist_ok=True)
            _unmount_target(req.target)  # a dead mount left by a crash, same volume
            linux.bind_mount(str(self.staging(job)), req.target, read_only=req.read_only)
            _write_json(
                self._volume_path(req.volume_id),
                {
                    "volume_id": req.volume_id,
                    "target": req.target,
                    "read_only": req.read_only,
                    "job": job,
                    "rank": rank,
                    "request": digest,
                    "published": time.time(),
                    "pod": pod_of(req.context),
                },
            )
            self._touch_job(job, idle=False)
            log.info(
                "published %s: job %s rank %d at %s%s",
                req.volume_id,
                job,
                rank,
                req.target,
                " (read-only)" if req.read_only else "",
            )

    def _published(self, req: PublishRequest, digest: str, locked: bool, token: str | None = None) -> bool:
        """Whether this very call is done already (kubelet repeats calls, and republishes to
        hand over a fresh ``token``, which then replaces the job's); ALREADY_EXISTS for
        another call with the same volume id. Without the job's lock, only reads (and the
        token file, replaced whole)."""
        record = _read_json(self._volume_path(req.volume_id))
        if record is None:
            return False
        if not _same_request(record, req, digest):
            raise AlreadyExists(
                f"volume {req.volume_id} is already published at {record['target']} with other "
                "arguments; unpublish it first"
            )
        if not _alive(req.target) or ("request" not in record and not locked):
            return False
        if "request" not in record:  # an older plugin's record: store the keyed digest now
            _write_json(self._volume_path(req.volume_id), {**record, "request": digest})
        if token is not None and self._token_path(record["job"]).exists():
            write_token(self._token_path(record["job"]), token)
        return True

    def _token_path(self, job: str) -> Path:
        return self.cfg.state_dir / "tokens" / f"{job}.token"

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
            return kube.peer_pattern(*pod.read(), nodes, port)
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

    def _plan_daemon(
        self, job: str, rank: int, options: dict[str, str], secret: str | None
    ) -> tuple[dict[str, str], bool]:
        """The daemon's options, and whether it must start: the job's running daemon is reused
        when it runs with them; one with other settings is replaced only if no pod uses it."""
        staging, held = self.staging(job), _read_json(self._job_path(job))
        wanted = {**options, "rank": str(rank)}
        token = self._token_path(job) if wanted.get("gcs-token-audience") and self._token_path(job).exists() else None
        check_daemon_options(job, staging, self.cfg.ramdisk, wanted, secret, token)  # a bad value is the pod's error
        if not _alive(staging):
            return wanted, True
        secret_path = self._secret_path(job)
        same_secret = secret_path.exists() and secret_path.read_text() == (secret or "")
        if held is not None and held["options"] == wanted and same_secret:
            return wanted, False
        others = self._volumes_of(job)
        if others:
            before = held["options"] if held else {}
            changed = sorted(k for k in wanted.keys() | before.keys() if before.get(k) != wanted.get(k))
            raise FailedPrecondition(
                f"job {job} is mounted on node {self.cfg.node_id} by {len(others)} other pod(s) with other "
                f"settings ({', '.join(changed) or 'secret'}); give every pod of the job the same attributes"
            )
        return wanted, True

    def _launch(self, job: str, options: dict[str, str], secret: str | None) -> None:
        """(Re)start the job's daemon; its record (the claim) is written already."""
        staging = self.staging(job)
        if _alive(staging):  # a daemon with other settings, which no pod uses
            mounts.unmount(staging)
        write_atomically(self._secret_path(job), secret or "", PRIVATE_FILE)
        self._start_daemon(job, staging, options)

    def _start_daemon(self, job: str, staging: Path, options: dict[str, str], take_over: bool = False) -> None:
        """Start the job's keeper and daemon; ``take_over``: the live mount of another
        plugin's keeper, whose connection the new keeper takes (the daemon restarts, the
        job's pods see a pause)."""
        if not take_over and mounts.find_mount(staging) is not None:  # dead: its daemon was killed
            linux.umount(str(staging), linux.MNT_DETACH)
        staging.mkdir(parents=True, exist_ok=True)
        token = self._token_path(job)
        start_daemon(
            self.cfg,
            job,
            staging,
            options,
            secret=self._secret_path(job).read_text(),
            keeper_socket=self._keeper_socket(job),
            token=token if options.get("gcs-token-audience") and token.exists() else None,  # the job's GCS identity
            take_over=take_over,
        )
        held = _read_json(self._job_path(job))
        if held is not None:
            _write_json(self._job_path(job), {**held, "keeper_of": self.instance})
        log.info(
            "%s tierfs for job %s rank %s at %s", "took over" if take_over else "started", job, options["rank"], staging
        )

    # -- unpublish and stats -----------------------------------------------------------

    def unpublish(self, volume_id: str, target: str) -> None:
        """Unmount the pod's view; the daemon and its RAM data stay for the job's next pod."""
        record = _read_json(self._volume_path(volume_id))
        if record is None:  # never published, or gone already: only the target to clear
            self._clear_target(target, published=False)
            return
        with self._working_on(record["job"]):
            record = _read_json(self._volume_path(volume_id))
            self._clear_target(target, published=record is not None)
            if record is not None:
                self._volume_path(volume_id).unlink()
                if not self._volumes_of(record["job"]):
                    self._touch_job(record["job"], idle=True)
                log.info("unpublished %s from %s", volume_id, target)

    @staticmethod
    def _clear_target(target: str, published: bool) -> None:
        """Unmount and remove the target; a directory with files in it is kubelet's, unless ours."""
        _unmount_target(target)
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.ENOTEMPTY or published:
                raise VolumeError(f"cannot remove target {target}: {e.strerror}") from None

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
        published volumes, mount their targets again; one job at a time, under its lock."""
        jobs = {r["job"] for r in self._jobs()} | {r["job"] for r in self.volumes()}
        for job in sorted(jobs):
            with self.locks.job(job):
                self._adopt_job(job)

    def _adopt_job(self, job: str) -> None:
        held = _read_json(self._job_path(job))
        staging = self.staging(job)
        if held is not None and held.get("keeper_of") != self.instance and _alive(staging):
            try:
                self._start_daemon(job, staging, held["options"], take_over=True)
            except VolumeError as e:  # the old keeper serves on
                log.error("job %s: %s", job, e)
        for record in self._volumes_of(job):
            target = record["target"]
            if _alive(target):
                continue
            # A dead mount answers stat() with ENOTCONN: only a target with no mount and no
            # directory is one whose pod went while the plugin was away.
            if mounts.find_mount(target) is None and not os.path.isdir(target):
                self._volume_path(record["volume_id"]).unlink()
                continue
            if held is None:
                log.error("volume %s: no record of job %s; unpublish and publish it again", record["volume_id"], job)
                continue
            try:
                if not _alive(staging):
                    self._start_daemon(job, staging, held["options"])
                _unmount_target(target)
                linux.bind_mount(str(staging), target, read_only=record["read_only"])
                log.info("adopted %s: job %s at %s mounted again", record["volume_id"], job, target)
            except (OSError, VolumeError) as e:
                log.error("volume %s at %s: %s", record["volume_id"], target, e)
        held = _read_json(self._job_path(job))
        if held is not None and not self._volumes_of(job) and held.get("idle_since") is None:
            self._touch_job(job, idle=True)

    def collect_idle(self, now: float | None = None) -> list[str]:
        """Remove the jobs no pod has used on this node for ``gc_after``: daemon, RAM data, records."""
        if not self.cfg.gc_after:
            return []
        now = time.time() if now is None else now
        removed = []
        for held in self._jobs():
            since = held.get("idle_since")
            if since is not None and now - since >= self.cfg.gc_after:
                try:
                    if self._collect(held["job"], now):
                        removed.append(held["job"])
                except VolumeError as e:
                    log.warning("not collecting job %s: %s", held["job"], e)
        return removed

    def _collect(self, job: str, now: float) -> bool:
        """Remove an idle job, unless a call is working on it or a pod took it up meanwhile (next round)."""
        try:
            with self.locks.job(job, wait=0):
                since = (_read_json(self._job_path(job)) or {}).get("idle_since")
                if since is None or now - since < self.cfg.gc_after:
                    return False
                self._remove_job(job)
                return True
        except Busy:
            return False

    def remove_job(self, job: str) -> None:
        """``tierfs csi --gc JOB``: stop the job's daemon, delete its RAM data and records, once no pod uses it."""
        try:
            check_job_id(job)  # it names directories that are about to go
        except UserError as e:
            raise InvalidArgument(str(e)) from None
        with self.locks.job(job):
            self._remove_job(job)

    def _remove_job(self, job: str) -> None:
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
        logs = self.cfg.state_dir / "logs"
        for path in (
            self._job_path(job),
            self._secret_path(job),
            self._token_path(job),
            logs / f"{job}.log",
            *logs.glob(f"{job}.log.[0-9]"),
        ):  # and its rotated parts
            path.unlink(missing_ok=True)
        if staging.is_dir():
            staging.rmdir()
        self.locks.forget(job)
        log.info("removed job %s: daemon stopped, RAM data deleted", job)
