"""The mount daemon: one process per mountpoint, serving one (job, rank); the composition root.

It builds the parts of a mount, wires each to the few others it needs (constructor
arguments and callbacks, in :meth:`Daemon.__init__` and :meth:`Daemon.start`), and runs
them in one trio nursery (:meth:`Daemon.serve`). No part is handed the daemon itself: the
RAM tier's pieces, the FUSE operations, the tiers (:func:`tierfs.daemon.tiers.node_tiers`),
the restore planner, the job's coordination, the replicator, the cluster's tasks
(:mod:`tierfs.daemon.cluster`) and the multi-tier checkpointing node each get what they use.
What is not a part lives beside it: the start-up checks (:mod:`tierfs.daemon.startup`), the
status report (:mod:`tierfs.daemon.status`), and the process around a daemon, which the
keeper runs (:func:`tierfs.daemon.process.run`).

Start-up order matters: everything that can fail with a user error (ramdisk, lock,
capacity, mountpoint, the step to restore) is settled before the kernel mount exists, so a
failed start never leaves a mount behind; readiness is reported only once the mount
answers. The peer service starts before the restore is planned, so nodes that start
together can see each other's holdings while they choose the step.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TypeVar

import trio

from tierfs.config import Config, DataPath
from tierfs.core import linux, mounts
from tierfs.core.atomic import read_state
from tierfs.core.errors import UserError
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.core.parse import format_size
from tierfs.daemon import cluster, control, host, startup, status
from tierfs.daemon import steps as job_steps
from tierfs.daemon.cluster import ClusterWatch
from tierfs.daemon.connection import Connection, Engine
from tierfs.daemon.erasure import erasure_group
from tierfs.daemon.metrics import Telemetry
from tierfs.daemon.tiers import node_tiers
from tierfs.discovery.directory import unanswered
from tierfs.fs import Operations
from tierfs.fs.engine import make_engine
from tierfs.mtc.multitier import MultiTier
from tierfs.mtc.protocol import MtcNode
from tierfs.peers.claim import Identity
from tierfs.peers.network import PeerNetwork
from tierfs.pipeline.coordinating import NodeCoordination
from tierfs.pipeline.planning import RestorePlanner
from tierfs.pipeline.replicator import Replicator
from tierfs.pipeline.restore import Restore
from tierfs.pipeline.survey import ClusterView
from tierfs.ramtier import RankDir, SpaceAccount
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.steps import Steps
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.replicas import ReplicaStore
from tierfs.tiers.base import NodeTiers
from tierfs.tiers.local import LocalTier, OwnSteps

log = logging.getLogger("tierfs")

SPILL_AT = 0.75  # RAM is short past this share of the capacity: steps on --disk may leave it
T = TypeVar("T")


def _built(part: T | None) -> T:
    """A part :meth:`Daemon.start` builds, where only a started daemon asks for it."""
    if part is None:
        raise RuntimeError("the daemon has not been started")
    return part


class _VolumeEvents:
    """What the mount tells the checkpoint machinery (:class:`tierfs.fs.hooks.Events`): the RAM
    tier's steps hear of every file, and the multi-tier checkpointing node (``mtc``, once
    started) of its own protocol's files and renames."""

    def __init__(self, steps: Steps):
        self.steps = steps
        self.mtc: MtcNode | None = None

    def file_done(self, path: str) -> None:
        self.steps.file_done(path)
        if self.mtc is not None:
            self.mtc.file_done(path)

    def dir_renamed(self, path: str) -> None:
        if self.mtc is None or not self.mtc.owns_rename(path):
            self.steps.dir_renamed(path)


class Daemon:
    """One mount: the RAM tier, the FUSE engine, the tiers, and the tasks that run them."""

    def __init__(self, cfg: Config, connection: Connection | None = None):
        self.cfg = cfg
        self.connection = connection or Connection()
        self.started = time.time()
        self.rank = RankDir(cfg.rank_dir)
        self.registration = mounts.Registration(cfg.mountpoint)
        self.space = SpaceAccount(cfg.capacity, self.rank.tree)
        self.ops: Operations | None = None
        self.engine: Engine | None = None  # serves self.ops: tierfs.fs.session or pyfuse3 (tierfs.fs.engine)
        self.data_path: DataPath | None = None  # chosen at start
        self.snapshots = Snapshots(
            self.rank.path, self.rank.tree, self._unlinked, lambda st: self.space.update(st)
        )  # the account may be replaced at start
        self.steps = Steps(self.snapshots, cfg.rules, self._writing_inodes)
        self.events = _VolumeEvents(self.steps)  # the operations' (start); the MTC node's files too, once started
        self.identity = Identity.create(cfg.ramdisk)  # who serves this rank, in the peer service's info
        self.network: PeerNetwork | None = (
            PeerNetwork(cfg, identity=self.identity) if cfg.peers or cfg.peer_dns else None
        )
        self.replica_store: ReplicaStore | None = None  # with a peer service (start)
        self.erasure: ErasureMember | None = None  # with --erasure: this node in its group (start)
        self.local = LocalTier(
            None,
            OwnSteps(
                cfg.rank,
                steps=lambda: sorted(self.steps.states),
                find=self.find,
                manifest=self._own_manifest,
                restore_step=self._restore_step,
                report=lambda: status.ram(self.rank, self.space, bounded=self.cfg.capacity is not None),
            ),
        )
        self.tiers = NodeTiers([self.local])  # every tier of this node, cheapest first; the rest at start
        self.view = ClusterView(cfg.nodes, self.tiers, self.local)
        self.coordinating = (
            NodeCoordination(cfg, self.network, self.steps, self.tiers, self._replicas, self._restore_step)
            if cfg.listen and self.network is not None
            else None
        )
        self.planner = RestorePlanner(
            cfg,
            rank=self.rank,
            steps=self.steps,
            snapshots=self.snapshots,
            space=self.space,
            tiers=self.tiers,
            local=self.local,
            view=self.view,
            coordinating=self.coordinating,
            started=self.started,
        )
        self.multitier = MultiTier(
            cfg,
            self.rank,
            self.steps,
            self.planner,
            self.view,
            restore=lambda: self.restore,
            reconfigure=self._reconfigure,
        )
        self.mtc: MtcNode | None = None  # the job's multi-tier checkpointing files, unless read-only (start)
        self.replicator: Replicator | None = None
        self.telemetry: Telemetry | None = None  # its endpoint is bound at start: a taken port is a user error
        self.watch: ClusterWatch | None = None  # follows the peers and the job's newest steps (start)
        self.restore: Restore | None = None
        self.mounted = False
        self.ready = False
        self._warnings: list[str] = []
        self._signalled = False
        self.handing_over = False  # stopped serving for a successor (tierfs upgrade)

    def start(self) -> None:
        """Validate and claim the rank; raises UserError, with nothing mounted yet."""
        cfg = self.cfg
        host.raise_fd_limit()
        linux.keep_heap_memory()
        # Modes of the job's files arrive from the kernel with the caller's umask applied, so
        # the daemon's own umask is 0 and everything it creates for itself passes an explicit,
        # root-only mode (tierfs.core.atomic); RankDir and Registration check what is already there.
        os.umask(0)
        self.registration.prepare()
        self.rank.prepare_home()
        self.data_path, kernel_bound = startup.data_path(cfg, self.rank.path)  # may give it a tmpfs of its own
        if kernel_bound:  # the kernel enforces the capacity; the account follows that file system
            self.space = self.planner.space = SpaceAccount(None, self.rank.tree)
        self.rank.prepare()
        self.rank.claim(cfg.mountpoint)
        if not self.rank.is_tmpfs():
            log.warning("%s is not on tmpfs: data is not held in RAM", self.rank.tree)
        self.steps.load()
        _ = cfg.manifest_keys  # stretch the secret once, before any peer or manifest needs its keys
        if cfg.listen:
            host.check_listen(cfg.listen)
            self.replica_store = self.local.store = ReplicaStore(
                self.rank.state_dir("replicas"),
                job=cfg.job,
                space=self.space,
                local=self.local.own,
                keep_from=self.retention_floor,
            )
        self.tiers.replace(
            node_tiers(  # the parts built above read it
                cfg,
                self.local,
                self.network,
                keep_from=self.retention_floor,
                warn=self._warn,
                restorable_without_gcs=bool(self.steps.states) or self.network is not None or cfg.disk is not None,
            )
        )
        if cfg.erasure is not None and self.network is not None:
            self.erasure, group = erasure_group(
                cfg, self.rank, self.steps, self.network, self._own_manifest, self.space
            )
            self.tiers.add([group])
        # Snapshots and what a restore set aside pin RAM too.
        self.space.scan(self.rank.tree, self.snapshots.root, *[p for p in [self.rank.path / "aside"] if p.exists()])
        if self.replica_store is not None:
            self.replica_store.load()  # accounts the replicas it holds
        startup.check_capacity(cfg, self.space, self.rank.tree)
        if self.connection.taken is None:  # a successor's mount is live: it must not touch it
            mounts.prepare_mountpoint(cfg.mountpoint)
        ops = self.ops = Operations(self.rank.tree, self.space, self.snapshots, self.events)
        self.engine = make_engine(ops, self.data_path, cfg.engine, cfg.wake_cpus)
        self.connection.keep_record(self.engine, ops, self.rank, self.data_path == DataPath.PASSTHROUGH)
        telemetry = self.telemetry = Telemetry(
            cfg,
            self._status,
            lambda: getattr(self.engine, "times", None),
            self.rank.path / "goodput.json",
            self.started,
        )
        replicator = self.replicator = Replicator(
            cfg,
            self.steps,
            self.tiers,
            lambda: ops.last_write,
            self.retention_floor if self._beyond_ram() or self.network else None,
            self._ram_short,
            telemetry.meters,
            # its group rebuilds a lost member's step from the others' RAM: the newest it encoded stays there
            encoded=self.erasure.newest_encoded if self.erasure is not None else None,
        )
        self.watch = ClusterWatch(
            lambda: self.cfg.survey_interval,  # of the configuration in force
            self.view,
            self.tiers,
            replicator,
            network=self.network,
            coordinating=self.coordinating,
            replica_store=self.replica_store,
        )
        if not cfg.read_only:
            self.mtc = self.events.mtc = self.multitier.start()
            replicator.dropped = self.mtc.forget

    def _beyond_ram(self) -> bool:
        """Whether this node has a tier besides its RAM: something to restore from and put steps on."""
        return any(t is not self.local for t in self.tiers)

    def _reconfigure(self, cfg: Config) -> None:
        """The job changed its shape (its replicator.yaml): every part follows the new configuration."""
        self.cfg = cfg
        for part in (self.planner, self.view, self.coordinating, self.network, self.replicator):
            if part is not None:
                part.reconfigure(cfg)

    def retention_floor(self) -> int | None:
        """The newest step every rank holds somewhere, never past one this node holds complete:
        retention on every tier keeps it and newer ones (:func:`tierfs.daemon.cluster.retention_floor`)."""
        return cluster.retention_floor(self.coordinating, self.view, self.steps, self.tiers, self.cfg.rank)

    def _warn(self, message: str) -> None:
        log.warning("%s", message)
        self._warnings.append(message)

    # -- what the tiers ask of the RAM tier -----------------------------------------------

    def find(self, h: str) -> tuple[str, int, int] | None:
        """This node's own copy of chunk ``h``: in a committed step, or written by the running restore."""
        found = self.replicator.find_local(h) if self.replicator is not None else None
        if found is None and self.restore is not None:
            found = self.restore.location(h)
        return found

    def _own_manifest(self, step: int) -> bytes | None:
        """The manifest built for a committed step's first copy on a tier, if one was built."""
        try:
            return read_state(self.snapshots.step_dir(step) / "manifest.json", MAX_MANIFEST)
        except (OSError, UserError):
            return None

    def _restore_step(self) -> int | None:
        return self.planner.announced_step()

    def _replicas(self) -> list[tuple[int, int]]:
        """The (rank, step) manifests this node keeps for others."""
        held = self.replica_store.manifests() if self.replica_store is not None else []
        return held + (self.erasure.claims() if self.erasure is not None else [])

    def _ram_short(self) -> bool:
        """Whether the volume uses more than SPILL_AT of its RAM (its tmpfs, where the kernel keeps count)."""
        used = self.space.used
        if not self.space.bounded:
            st = os.statvfs(self.rank.tree)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return used > self.space.capacity * SPILL_AT

    def _peer_info(self) -> dict:
        return cluster.peer_info(self.cfg, self.space, self.steps, self._restore_step(), self.identity)

    def _unlinked(self, st: os.stat_result) -> None:
        if self.ops is not None:
            self.ops.tree.link_removed(st)
        elif st.st_nlink <= 1:
            self.space.drop(st.st_ino)

    def _writing_inodes(self) -> set[int]:
        return self.ops.writing_inodes() if self.ops is not None else set()

    # -- running ----------------------------------------------------------------------

    def _mount(self) -> None:
        """Mount, or take the live mount over (a successor); register it, and say so."""
        cfg, engine = self.cfg, self._engine()
        handles = self.connection.resume(engine, _built(self.ops), str(cfg.mountpoint))
        if handles is None:
            self.engine = self.connection.mount(engine, cfg)  # pyfuse3 where the own engine cannot mount
        self.mounted = True
        self._register()
        if handles is not None:
            log.info(
                "took over %s from the daemon before: %d open handles",
                cfg.mountpoint,
                handles,
                extra={"event": "took_over"},
            )
            return
        log.info(
            "mounted %s: job %s rank %d on %s (%s used)",
            cfg.mountpoint,
            cfg.job,
            cfg.rank,
            self.rank.tree,
            format_size(self.space.used),
            extra={"event": "mounted"},
        )

    def _engine(self) -> Engine:
        """The engine serving the mount: the one start() made, or pyfuse3 in its place (Connection.mount)."""
        if self.engine is None:  # not _built(): mypy would infer its type as the join of the union, object
            raise RuntimeError("the daemon has not been started")
        return self.engine

    def _register(self) -> None:
        cfg = self.cfg
        keeper = self.connection.keeper
        self.registration.write(
            {
                "pid": os.getpid(),
                **({"keeper": keeper} if keeper else {}),
                "mountpoint": str(cfg.mountpoint),
                "job": cfg.job,
                "rank": cfg.rank,
                "rank_dir": str(self.rank.path),
                "log": str(self.registration.log_path),
            }
        )

    async def serve(self, ready_fd: int | None = None) -> None:
        failure: Exception | None = None
        telemetry, watch = _built(self.telemetry), _built(self.watch)
        telemetry.started()
        async with trio.open_nursery() as nursery:
            if listen := self.cfg.listen:  # its replica store was built at start
                peers = (self.cfg, listen, _built(self.replica_store), self._peer_info, self.coordinating)
                await nursery.start(cluster.serve_peers, *peers, self.erasure)
            try:
                if self.network is not None:  # resolves the peers; refuses a rank another node serves
                    await self.network.join(nursery)
                    watch.follow_peers()
                if self.erasure is not None:
                    nursery.start_soon(self.erasure.run)
                if self.coordinating is not None:
                    await self.coordinating.join(nursery)
                if self._beyond_ram() or self.cfg.restore_step is not None:  # a rollback of RAM alone too
                    self.restore = await self.planner.plan()
                    if self.restore is not None:
                        _built(self.ops).hooks.restoring = self.restore
                        self.restore.on_finish = telemetry.restored
                if self.coordinating is not None:
                    self.coordinating.settled(nursery)
                self._mount()
            except Exception as e:  # noqa: BLE001 (raised below, outside the nursery: one error, not a group)
                failure = e
                nursery.cancel_scope.cancel()
            else:
                await self._run_mounted(nursery, ready_fd)
        if failure is not None:
            raise failure

    async def _run_mounted(self, nursery: trio.Nursery, ready_fd: int | None) -> None:
        nursery.start_soon(self._watch_signals)
        if self.connection.fd is not None:
            nursery.start_soon(self.connection.watch_keeper, str(self.cfg.mountpoint), self._register)
        nursery.start_soon(_built(self.replicator).run)
        if self.mtc is not None:
            nursery.start_soon(self.mtc.run)
        if self._beyond_ram() or self.network:
            nursery.start_soon(_built(self.watch).run)
        if self.restore is not None:
            await nursery.start(self.restore.run)
        answers = control.Answers(
            self._status,
            self._commit,
            _built(self.telemetry).exposition,
            lambda: job_steps.answer(self.cfg, self.view, self.steps),
        )
        await nursery.start(control.serve, self.registration.socket_path, answers)
        nursery.start_soon(self._fuse_main, nursery.cancel_scope)
        # The first request through the mount completes the kernel's INIT handshake,
        # which resets the read-ahead; set it after, and only then call the mount ready.
        # A successor's connection had its INIT long ago: the read-ahead set then stands.
        await trio.to_thread.run_sync(os.stat, self.cfg.mountpoint)
        if self.connection.taken is None:
            host.set_read_ahead(self.cfg.mountpoint)
        for warning in unanswered([name.removeprefix("peer ") for name in self.planner.missing]):
            self._warn(warning)
        self.ready = True
        host.report(ready_fd, "\n".join(["ok", *(f"warning: {w}" for w in self._warnings)]))
        if self.restore is not None:
            self.restore.mounted.set()

    def _status(self, settle: bool = True) -> dict:
        known = status.cluster(self.coordinating, self.view, self.planner, self.retention_floor)
        return status.report(
            self.cfg,
            started=self.started,
            ops=_built(self.ops),
            engine=self._engine(),
            steps=self.steps,
            local=self.local,
            tiers=self.tiers,
            replicator=_built(self.replicator),
            network=self.network,
            restore=self.restore,
            mtc=self.mtc,
            cluster=known,
            connection=self.connection.report(),
            telemetry=self.telemetry,
            settle=settle,
        )

    def _commit(self, path: str, step: int | None) -> dict:
        """``tierfs commit``: what was written before the command is part of the step."""
        _built(self.ops).writes_done()
        return control.commit(self.steps, path, step)

    async def _fuse_main(self, cancel_scope: trio.CancelScope) -> None:
        with _built(self.ops).writes:  # the write-behind worker lives as long as the request loop
            await self._engine().run()
        cancel_scope.cancel()

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    if self.connection.record is None:
                        log.warning(
                            "cannot hand %s over: the pyfuse3 engine keeps its own connection", self.cfg.mountpoint
                        )
                        continue
                    log.info("handing %s over to a successor", self.cfg.mountpoint)
                    self.handing_over = True
                else:
                    log.info("signal %d: unmounting", signum)
                    self._signalled = True
                self._engine().terminate()

    def stop(self) -> None:
        if self.mounted:
            # After a kernel-side unmount (umount, fusermount -u) there is nothing to unmount.
            self._engine().close(unmount=self._signalled)
            if not self.handing_over:  # only ours once mounted: a busy mountpoint is someone else's
                self.registration.remove()
        for part in (self.ops, self.connection.record, self.telemetry):  # None where the start failed first
            if part is not None:
                part.close()
        self.rank.release()
        log.info("stopped", extra={"event": "stopped"})
