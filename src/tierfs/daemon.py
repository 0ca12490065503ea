"""The mount daemon: one process per mountpoint, serving one (job, rank).

Start-up order matters: everything that can fail with a user error (ramdisk, lock,
capacity, mountpoint, the step to restore) is settled before the kernel mount exists, so a
failed start never leaves a mount behind; readiness is reported only once the mount
answers. The peer service starts before the restore is planned, so nodes that start
together can see each other's holdings while they choose the step.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import shutil
import socket
import sys
import time
from dataclasses import asdict, replace

import trio

from tierfs import control, linux, mounts
from tierfs.atomic import UnsafeFile, read_state
from tierfs.cluster import ClusterView, LocalHoldings
from tierfs.config import Config, format_size
from tierfs.errors import UserError
from tierfs.fs import Operations
from tierfs.fs.engine import choose_data_path, make_engine
from tierfs.manifest import MAX_BYTES as MAX_MANIFEST, Manifest, ManifestError
from tierfs.ramtier import RankDir, SpaceAccount
from tierfs.ramtier.tmpfs import own_tmpfs
from tierfs.ramtier.snapshots import Snapshots
from tierfs.peers import server as peer_server
from tierfs.peers.network import PeerNetwork
from tierfs.peers.store import ReplicaStore
from tierfs.replicator import Replicator
from tierfs.fetch import ChunkSources, peer_address
from tierfs.mtc import REPLICATOR, MtcNode, ReplicatorSpec, SpecError
from tierfs.restore import Restore, fetch_manifest, link_into_tree, restoring_steps, set_aside
from tierfs.steps import Steps

log = logging.getLogger("tierfs")

READ_AHEAD_KB = 1024  # the kernel's default of 128 KiB halves sequential read speed


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank = RankDir(cfg.rank_dir)
        self.registration = mounts.Registration(cfg.mountpoint)
        self.space = SpaceAccount(cfg.capacity, self.rank.tree)
        self.ops: Operations | None = None
        self.engine = None  # serves self.ops: tierfs.fs.session or pyfuse3 (tierfs.fs.engine)
        self.data_path = "daemon"
        self.snapshots = Snapshots(self.rank.path, self.rank.tree, self._unlinked,
                                   lambda st: self.space.update(st))  # the account may be replaced at start
        self.steps = Steps(self.snapshots, cfg.rules, self._writing_inodes)
        self.gcs = None
        self.peers: PeerNetwork | None = PeerNetwork(cfg) if cfg.peers else None
        self.replica_store: ReplicaStore | None = None
        self.replicator: Replicator | None = None
        self.view = ClusterView(cfg.nodes, self.peers, None, self._local_holdings)
        self.restore: Restore | None = None
        self.restore_step: int | None = None  # the step chosen at start, announced to peers
        self.mtc: MtcNode | None = None
        self.mounted = False
        self.ready = False
        self._warnings: list[str] = []
        self.started = time.time()
        self._signalled = False

    def start(self) -> None:
        """Validate and claim the rank; raises UserError, with nothing mounted yet."""
        cfg = self.cfg
        _raise_fd_limit()
        linux.keep_heap_memory()
        # Modes of the job's files arrive from the kernel with the caller's umask applied, so
        # the daemon's own umask is 0 and everything it creates for itself passes an explicit,
        # root-only mode (tierfs.atomic); RankDir and Registration check what is already there.
        os.umask(0)
        self.registration.prepare()
        self.rank.prepare_home()
        self._choose_data_path()  # may put the rank's home on a tmpfs of its own
        self.rank.prepare()
        self.rank.claim(cfg.mountpoint)
        if not self.rank.is_tmpfs():
            log.warning("%s is not on tmpfs: data is not held in RAM", self.rank.tree)
        self.steps.load()
        if cfg.listen:
            _check_listen(cfg.listen)
            self.replica_store = ReplicaStore(
                self.rank.state_dir("replicas"), job=cfg.job, space=self.space, local=self,
                keep_from=self.view.retention_floor,
            )
        if cfg.gcs:
            self._open_gcs()
        # Snapshots and what a restore set aside pin RAM too.
        self.space.scan(self.rank.tree, self.snapshots.root, *[p for p in [self.rank.path / "aside"] if p.exists()])
        if self.replica_store is not None:
            self.replica_store.load()  # accounts the replicas it holds
        if cfg.capacity is not None and self.space.used > cfg.capacity:
            raise UserError(
                f"capacity {format_size(cfg.capacity)} is below the {format_size(self.space.used)} "
                f"already stored in {self.rank.tree}: raise --capacity or remove files"
            )
        mounts.prepare_mountpoint(cfg.mountpoint)
        self.ops = Operations(self.rank.tree, self.space, self.snapshots, self)
        self.engine = make_engine(self.ops, self.data_path)
        self.replicator = Replicator(cfg, self.steps, self.gcs, self.peers, lambda: self.ops.last_write,
                                     self.view.retention_floor if self.gcs or self.peers else None)
        if not cfg.read_only:
            self._start_mtc()

    def _choose_data_path(self) -> None:
        """Passthrough where the kernel allows it; with a capacity, on a tmpfs of that size."""
        cfg = self.cfg
        try:
            self.data_path, why = choose_data_path(cfg.data_path)
        except ValueError as e:
            raise UserError(f"--data-path passthrough is impossible here: {e}; "
                            "use --data-path auto or daemon") from None
        if self.data_path == "passthrough" and cfg.capacity is not None:
            if own_tmpfs(self.rank.path, cfg.capacity):
                # The kernel enforces the capacity; the account follows that file system.
                self.space = SpaceAccount(None, self.rank.tree)
            elif cfg.data_path == "passthrough":
                raise UserError(f"{self.rank.path} holds data outside a tmpfs of its own, so --capacity "
                                "cannot bind passthrough writes: use --data-path daemon, or move the data")
            else:
                self.data_path = "daemon"
                why = (f"{self.rank.path} already holds data outside a tmpfs of its own, "
                       "so --capacity is enforced by the daemon")
        if why is None:
            log.info("data path: passthrough (the kernel reads and writes the RAM tier directly)")
        else:
            log.info("data path: daemon (%s)", why)

    def _start_mtc(self) -> None:
        cfg = self.cfg
        self.mtc = MtcNode(self.rank.tree, self.rank.path / "mtc.json", cfg.mountpoint, cfg.rank,
                           cfg.coordinator, self._apply_spec, self._restore_target)
        spec = self.mtc.prepare()
        if spec is not None:  # what the job said before this daemon started still holds
            try:
                self._apply_spec(spec)
            except SpecError as e:
                log.warning("the job's earlier %s no longer applies: %s", REPLICATOR, e)
                self.mtc.spec = None
        self.replicator.dropped = self.mtc.forget

    # -- what the mount reports (Operations' events) ---------------------------------------

    def file_done(self, path: str) -> None:
        self.steps.file_done(path)
        if self.mtc is not None:
            self.mtc.file_done(path)

    def dir_renamed(self, path: str) -> None:
        if self.mtc is None or not self.mtc.owns_rename(path):
            self.steps.dir_renamed(path)

    def _mount(self) -> None:
        cfg = self.cfg
        try:
            self.engine.mount(str(cfg.mountpoint), cfg.job, cfg.read_only)
        except OSError as e:
            raise UserError(f"could not mount {cfg.mountpoint}: {e.strerror or e} (see the log)") from None
        self.mounted = True
        self.registration.write(
            {
                "pid": os.getpid(),
                "mountpoint": str(cfg.mountpoint),
                "job": cfg.job,
                "rank": cfg.rank,
                "rank_dir": str(self.rank.path),
                "log": str(self.registration.log_path),
            }
        )
        log.info(
            "mounted %s: job %s rank %d on %s (%s used)",
            cfg.mountpoint, cfg.job, cfg.rank, self.rank.tree, format_size(self.space.used),
        )

    def _open_gcs(self) -> None:
        """Reach the bucket: a missing one is a start-up error, an unreachable one only delays."""
        from tierfs.tiers.gcs_store import GcsStore, GcsUnavailable  # slow import: only when used

        cfg = self.cfg
        self.gcs = self.view.gcs = GcsStore(cfg.gcs, cfg.job)
        try:
            self.gcs.check()
        except GcsUnavailable as e:
            if not self.steps.states and not self.peers:
                raise UserError(f"cannot reach {cfg.gcs} to restore rank {cfg.rank} ({e}): "
                                "check the network or STORAGE_EMULATOR_HOST, or mount without --gcs") from None
            self._warn(f"GCS {cfg.gcs} is unreachable ({e}): backups wait until it answers")

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self._warnings.append(message)

    def find(self, h: str) -> tuple[str, int, int] | None:
        """This node's own committed copy of chunk ``h``, for the replica store (twins)."""
        return self.replicator.find_local(h) if self.replicator is not None else None

    def _peer_info(self) -> dict:
        return {"rank": self.cfg.rank, "topology": [list(t) for t in self.cfg.topology],
                "data_parallel": self.cfg.data_parallel,
                "free": max(0, self.space.capacity - self.space.used),
                "steps": sorted(self.steps.states), "restore_step": self._announced_step()}

    # -- the cluster and restore -------------------------------------------------------------

    def _local_holdings(self) -> LocalHoldings:
        replicas = self.replica_store.manifests() if self.replica_store is not None else []
        return LocalHoldings(self.cfg.rank, sorted(self.steps.states), replicas, self._announced_step())

    def _announced_step(self) -> int | None:
        """The step chosen at start, until the job commits a newer one (then it has moved on)."""
        chosen = self.restore_step
        if chosen is None or any(s.step > chosen and s.committed_at > self.started
                                 for s in self.steps.states.values()):
            return None
        return chosen

    async def _plan_restore(self) -> None:
        """Choose the step the whole job restores, and present this rank's files of it."""
        cfg = self.cfg
        survey = await self.view.survey(wait=cfg.restore_wait if self.peers else 0.0)
        step = self.restore_step = survey.choose(cfg.rank)
        for unfinished in restoring_steps(self.steps):
            if unfinished != step:
                self._abandon_restore(unfinished)
        if step is None:
            log.info("no tier holds a step complete for every rank of %s: starting from what is here", cfg.job)
            return
        for newer in sorted(s for s in self.steps.states if s > step):
            for root in self.steps.states[newer].roots:  # other ranks cannot restore it: hide it
                set_aside(self.rank, root, f"step {newer} is not complete on every rank; restoring step {step}")
        if step in self.steps.states:
            for root in self.steps.states[step].roots:
                link_into_tree(self.rank, self.snapshots.step_tree(step), root,
                               f"it is in the way of step {step}", keep=True)
            log.info("step %d, the newest complete for every rank, is here already", step)
            return
        tiers = [t for t in survey.tiers(cfg.rank, step) if t != "local"]
        if not tiers:
            log.info("rank %d has nothing in step %d: nothing to restore", cfg.rank, step)
            return
        manifest, origin = await fetch_manifest(cfg, step, tiers, self.peers, self.gcs)
        needed = manifest.total_bytes - self._already_restored(step)
        if cfg.capacity is not None and self.space.used + needed > cfg.capacity:
            raise UserError(
                f"step {step} of rank {cfg.rank} needs {format_size(needed)} more, but only "
                f"{format_size(max(0, cfg.capacity - self.space.used))} of --capacity {format_size(cfg.capacity)} "
                "is free: raise the capacity"
            )
        holders = sorted(origin.peers, key=lambda name: -survey.closeness(name, cfg.topology))
        sources = ChunkSources(self.peers, [peer_address(name) for name in holders],
                               self.gcs if origin.in_gcs else None, self.replicator.find_local)
        self.restore = Restore(cfg, self.rank, self.steps, self.space, manifest, sources, origin)
        self.restore.prepare()
        self.ops.restoring = self.restore

    def _apply_spec(self, spec: ReplicatorSpec) -> list[str]:
        """Follow the job's replicator.yaml: its shape drives placement, dedup and backups."""
        cfg, warnings = self.cfg, []
        if spec.node_rank != cfg.rank:
            raise SpecError(f"'node-rank' is {spec.node_rank} but this volume holds rank {cfg.rank}'s data "
                            "(tierfs --rank): give the pod the volume of its rank")
        if spec.job_name != cfg.job:
            warnings.append(f"job-name {spec.job_name!r} differs from the volume's job {cfg.job!r}; "
                            f"its data stays under {cfg.job!r}")
        if spec.backup_interval_steps is not None:
            interval = {"backup_interval": 0.0, "backup_interval_steps": spec.backup_interval_steps}
        else:
            interval = {"backup_interval": spec.backup_interval_s, "backup_interval_steps": 0}
        try:
            new = replace(cfg, nodes=spec.nodes, data_parallel=spec.data_parallelism,
                                      peer_ranks=spec.peer_ranks, **interval)
            new._validate()
        except UserError as e:
            raise SpecError(str(e)) from None
        if cfg.gcs is None:
            warnings.append("this volume has no --gcs: nothing is backed up, whatever the interval")
        self.cfg = new
        self.view.nodes = new.nodes
        if self.peers is not None:
            self.peers.cfg = new
        self.replicator.reconfigure(new)
        return warnings

    async def _restore_target(self) -> tuple[int, str] | None:
        """The step the job should take, and its root in the volume."""
        step = self._announced_step()
        if step is None and self.steps.states:
            # The job moved on since this daemon started: the newest step every rank can restore.
            survey = await self.view.survey(wait=self.cfg.restore_wait if self.peers else 0.0)
            step = survey.choose(self.cfg.rank)
        if step is None:
            return None
        if self.restore is not None and self.restore.step == step:
            roots = self.restore.manifest.roots
        elif step in self.steps.states:
            roots = self.steps.states[step].roots
        else:
            raise SpecError(f"step {step}, the newest every rank can restore, is not on this node; "
                            "restart the volume (tierfs mount) to restore it")
        return step, (str(step) if str(step) in roots else sorted(roots)[0])

    def _already_restored(self, step: int) -> int:
        """Bytes of ``step`` a previous, interrupted restore already wrote."""
        tree = self.snapshots.step_tree(step)
        return sum(os.lstat(os.path.join(d, f)).st_blocks * 512
                   for d, _, files in os.walk(tree) for f in files) if tree.exists() else 0

    def _abandon_restore(self, step: int) -> None:
        """An interrupted restore of a step no longer chosen: take its placeholders away.

        Its manifest says what to take out of the volume, so it is read like every state
        file: at most a manifest's size, never through a link, and only if the daemon wrote
        it (UnsafeFile, a one-line refusal, otherwise).
        """
        path = self.snapshots.step_dir(step) / "manifest.json"
        try:
            roots = Manifest.from_json(read_state(path, MAX_MANIFEST)).roots
        except UnsafeFile as e:
            raise UnsafeFile(f"unsafe ramdisk: {e}") from None
        except (OSError, ManifestError) as e:
            log.warning("the unfinished restore of step %d has no usable manifest (%s): "
                        "nothing of it is taken out of the volume", step, e)
            roots = []
        for root in roots:
            set_aside(self.rank, root, f"the restore of step {step} was abandoned")
        trash = self.snapshots.drop(step)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        log.warning("abandoned the unfinished restore of step %d", step)

    async def _watch_cluster(self) -> None:
        """Keep the view of the newest complete step fresh: retention on every tier depends on it."""
        while True:
            await trio.sleep(self.cfg.survey_interval)
            try:
                await self.view.survey()
            except Exception as e:  # a survey is advisory; the next one may work
                log.warning("cluster survey failed: %s", e)
                continue
            self.replicator.retain_local()
            if self.replica_store is not None:
                self.replica_store.retain()

    def _unlinked(self, st: os.stat_result) -> None:
        if self.ops is not None:
            self.ops.link_removed(st)
        elif st.st_nlink <= 1:
            self.space.drop(st.st_ino)

    def _writing_inodes(self) -> set[int]:
        return self.ops.writing_inodes() if self.ops is not None else set()

    async def serve(self, ready_fd: int | None = None) -> None:
        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            if self.cfg.listen:
                await nursery.start(self._serve_peers)
            try:
                if self.gcs or self.peers:
                    await self._plan_restore()
                self._mount()
            except Exception as e:  # raised below, outside the nursery: one error, not a group
                failure = e
                nursery.cancel_scope.cancel()
            else:
                await self._run_mounted(nursery, ready_fd)
        if failure is not None:
            raise failure

    async def _run_mounted(self, nursery: trio.Nursery, ready_fd: int | None) -> None:
        nursery.start_soon(self._watch_signals)
        nursery.start_soon(self.replicator.run)
        if self.mtc is not None:
            nursery.start_soon(self.mtc.run)
        if self.gcs or self.peers:
            nursery.start_soon(self._watch_cluster)
        if self.restore is not None:
            await nursery.start(self.restore.run)
        await nursery.start(control.serve, self.registration.socket_path, self._control)
        nursery.start_soon(self._fuse_main, nursery.cancel_scope)
        # The first request through the mount completes the kernel's INIT handshake,
        # which resets the read-ahead; set it after, and only then call the mount ready.
        await trio.to_thread.run_sync(os.stat, self.cfg.mountpoint)
        _set_read_ahead(self.cfg.mountpoint)
        if self.view.last is not None:
            for name in self.view.last.missing:
                self._warn(f"peer {name} does not answer yet; replication uses the others and retries it")
        elif self.peers is not None:
            reachable = {p.address for p in await self.peers.discover()}
            for address in self.cfg.peers:
                if address not in reachable:
                    self._warn(f"peer {address[0]}:{address[1]} does not answer yet; "
                               "replication uses the others and retries it")
        self.ready = True
        _report(ready_fd, "\n".join(["ok", *(f"warning: {w}" for w in self._warnings)]))
        if self.restore is not None:
            self.restore.mounted.set()

    async def _serve_peers(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await peer_server.serve(self.cfg.listen, job=self.cfg.job, secret=self.cfg.secret,
                                store=self.replica_store, info=self._peer_info, task_status=task_status,
                                tls=peer_server.tls.for_config(self.cfg))

    async def _fuse_main(self, cancel_scope: trio.CancelScope) -> None:
        with self.ops.writes:  # the write-behind worker lives as long as the request loop
            await self.engine.run()
        cancel_scope.cancel()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %d: unmounting", signum)
                self._signalled = True
                self.engine.terminate()

    async def _control(self, request: dict) -> dict:
        op = request.get("op")
        if op == "status":
            return self.status()
        if op == "commit":
            return self._commit(request["path"], request.get("step"))
        raise ValueError(f"unknown request {op!r}")

    def _commit(self, path: str, step: int | None) -> dict:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{path!r} is not a path inside the volume")
        self.ops.writes_done()  # what was written before the command is part of the step
        state = self.steps.commit(path.strip("/"), step)
        if state is None:
            raise ValueError(f"{path} does not exist in the volume")
        return {"step": state.step, "roots": state.roots, "version": state.version}

    def status(self) -> dict:
        cfg, ops = self.cfg, self.ops
        ops.writes_done()  # what is written now is what is used
        return {
            "mountpoint": str(cfg.mountpoint),
            "pid": os.getpid(),
            "job": cfg.job,
            "rank": cfg.rank,
            "nodes": cfg.nodes,
            "uptime_s": round(time.time() - self.started, 1),
            "tiers": {
                "ram": {
                    "path": str(self.rank.tree),
                    "tmpfs": self.rank.is_tmpfs(),
                    "capacity": self.space.capacity,
                    "capacity_bounded": cfg.capacity is not None,
                    "used": self.space.used,
                }
            },
            "fuse": {"engine": self.engine.name, "data_path": self.engine.data_path,
                     "inodes": len(ops.inodes), **ops.counters},
            "commit_rules": [str(r) for r in self.steps.rules.rules],
            "steps": [
                {**asdict(s), "backed_up": s.backed_up}
                for s in sorted(self.steps.states.values(), key=lambda s: s.step)
            ],
            "restored": self.restore.status() if self.restore is not None else None,
            "mtc": self.mtc.status() if self.mtc is not None else None,
            "cluster": {**self.view.last.summary(), "restore_step": self.restore_step,
                        "retention_floor": self.view.retention_floor()} if self.view.last else None,
            **{tier: None for tier in ("gcs", "peers")},
            **self.replicator.status(),
            "replicas_held": self.replica_store.stats() if self.replica_store is not None else None,
        }

    def stop(self) -> None:
        if self.mounted:
            # After a kernel-side unmount (umount, fusermount -u) there is nothing to unmount.
            self.engine.close(unmount=self._signalled)
            self.registration.remove()  # only ours once mounted: a busy mountpoint is someone else's
        if self.ops is not None:
            self.ops.close()
        self.rank.release()
        log.info("stopped")


def run(cfg: Config, ready_fd: int | None = None) -> int:
    """Run a daemon in this process until unmounted; report readiness on ``ready_fd``."""
    _setup_logging(cfg)
    daemon = Daemon(cfg)
    try:
        daemon.start()
        trio.run(daemon.serve, ready_fd)
    except UserError as e:
        if daemon.ready:
            raise
        _report(ready_fd, f"error: {e}")
        if ready_fd is None:
            raise
        log.error("%s", e)
        return 1
    except Exception as e:
        if daemon.ready:
            raise
        log.exception("start-up failed")
        _report(ready_fd, f"error: daemon failed to start: {e} (log: {daemon.registration.log_path})")
        if ready_fd is None:
            raise UserError(f"daemon failed to start: {e}") from None
        return 1
    finally:
        daemon.stop()
    return 0


def _report(fd: int | None, message: str) -> None:
    if fd is not None:
        try:
            os.write(fd, message.encode() + b"\n")
            os.close(fd)
        except OSError:
            pass


def _setup_logging(cfg: Config) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=cfg.log_level.upper(),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )


def _raise_fd_limit() -> None:
    """One O_PATH descriptor per inode the kernel caches: allow as many as the host does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _check_listen(address: tuple[str, int]) -> None:
    """Fail before mounting if the peer service could not listen (the server binds it later)."""
    try:
        with socket.create_server(address, reuse_port=False) as _:
            pass
    except OSError as e:
        raise UserError(f"cannot listen on {address[0]}:{address[1]} for peers "
                        f"({e.strerror or e}): pick a free --listen address") from None


def _set_read_ahead(mountpoint) -> None:
    # Never stat() the mountpoint here: the request would wait for this very daemon.
    entry = mounts.find_mount(mountpoint)
    try:
        if entry is None:
            raise OSError("not in the mount table")
        minor = entry.minor
        with open(f"/sys/class/bdi/0:{minor}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as e:  # not fatal: only slower reads
        log.warning("could not raise read-ahead of %s: %s", mountpoint, e)
