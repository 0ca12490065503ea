"""The node side of GKE Multi-Tier Checkpointing's file protocol.

Orbax (``initialize_multi_tier_checkpointing``, ``ReplicatorCheckpointManager``), MaxText
(``enable_multi_tier_checkpointing``) and the PyTorch resiliency library talk to "the
replicator" through files at the root of the local checkpoint directory, which is the
volume's root here:

``jax-init-info.txt``      node -> job: ``<rank>\\n<coordinator host:port>\\n``
``replicator.yaml``        job -> node: the job's shape; acknowledged by deleting it
``replicator.errors``      node -> job: problems the job logs
``replicator.failed``      node -> job: a problem the job raises on
``replicator.prerestore``  node -> job: ``restore-step: N``, or ``{}``
``<job>-s<S>-n<R>-w0.restore``  node -> job: the step to restore, or a zero-byte file with
                           S = 0 when there is nothing

The job renames the ``.restore`` entry onto ``<S>``, so ``<S>`` must not exist meanwhile.
GKE's replicator makes the entry a symlink to a copy elsewhere; here the step is restored
in place (lazily, like any restore), so its directory itself is renamed to the entry and
the job's rename gives it back its name. Neither rename is a new checkpoint.

This module holds the rules; the daemon owns the timing: it hands over ``replicator.yaml``
as soon as the job closes or renames it into place, and applies what it says.

``replicator.yaml`` is written by whoever runs in the pod, and read by root: it is read
without following a symbolic link, at most :data:`~tierfs.mtc.spec.MAX_SPEC_BYTES` of it,
and parsed (:mod:`tierfs.mtc.spec`) in a worker thread, so the mount answers meanwhile.
Whatever the file holds, the answer is one line in ``replicator.failed`` and the daemon
goes on serving.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from pathlib import Path

import trio

from tierfs.core.atomic import UnsafeFile, read_small, read_state, temporary_name, write_atomically
from tierfs.mtc.spec import MAX_SPEC_BYTES, REPLICATOR, NextStart, ReplicatorSpec, SpecError, parse_spec
from tierfs.ramtier import beneath

log = logging.getLogger(__name__)

JAX_INIT_INFO = "jax-init-info.txt"
ERRORS = "replicator.errors"
FAILED = "replicator.failed"
PRERESTORE = "replicator.prerestore"
RESTORE_ENTRY = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")


def restore_entry_name(job: str, step: int, rank: int) -> str:
    return f"{job}-s{step}-n{rank}-w0.restore"


def restore_entry_step(name: str) -> int | None:
    m = RESTORE_ENTRY.fullmatch(name)
    return int(m.group(1)) if m else None


def jax_init_info(rank: int, coordinator: str) -> str:
    return f"{rank}\n{coordinator}\n"


def prerestore(step: int | None) -> str:
    return "{}\n" if step is None else f"restore-step: {step}\n"


class MtcNode:
    """The protocol's node side for one volume.

    Before the mount exists it clears what an earlier pod left (answers, markers) and
    writes ``jax-init-info.txt``. Once mounted it reads, checks and answers each
    ``replicator.yaml``, through the mount like any client (so the kernel's caches stay
    true), from a task of the daemon's nursery. The accepted spec is kept in the rank's
    directory: a restarted daemon keeps following it.
    """

    def __init__(
        self,
        tree: Path,
        state_path: Path,
        mountpoint: Path,
        rank: int,
        coordinator: str | None,
        apply: Callable[[ReplicatorSpec], list[str]],
        restore_target: Callable[[], Awaitable[tuple[int, str] | None]],
    ):
        self.tree, self.state_path, self.mountpoint = tree, state_path, mountpoint
        self.rank, self.coordinator = rank, coordinator
        self._apply, self._restore_target = apply, restore_target
        self.spec: ReplicatorSpec | None = None
        self.last_error: str | None = None
        self._wake = trio.Event()
        self._doomed: list[str] = []  # step roots retention dropped, to delete from the volume
        self._presented: tuple[str, str] | None = None  # (.restore entry, the step root it was)

    # -- before the mount --------------------------------------------------------------------

    def prepare(self) -> ReplicatorSpec | None:
        """Clear a previous pod's protocol files; returns the spec a previous run accepted."""
        for name in (ERRORS, FAILED, PRERESTORE, JAX_INIT_INFO, temporary_name(Path(JAX_INIT_INFO)).name):
            (self.tree / name).unlink(missing_ok=True)
        with _opened(self.tree) as fd:
            _clear_entries(fd)
        if self.coordinator is not None:
            write_atomically(self.tree / JAX_INIT_INFO, jax_init_info(self.rank, self.coordinator), 0o555)
        try:
            data = json.loads(read_state(self.state_path, 1 << 20))  # UnsafeFile: not the daemon's own
            self.spec = ReplicatorSpec(**{**data, "peer_ranks": tuple(data["peer_ranks"])})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring the unreadable %s (%s)", self.state_path, e)
            return None
        return self.spec

    # -- hooks from the mount ------------------------------------------------------------------

    def file_done(self, path: str) -> None:
        if path == REPLICATOR:
            self._wake.set()

    def owns_rename(self, path: str) -> bool:
        """Renames of the protocol's own: presenting a step as its ``.restore`` entry, and the
        job's rename of that entry back onto the step. Neither is a new checkpoint."""
        if "/" not in path and RESTORE_ENTRY.fullmatch(path):
            return True
        if (
            self._presented is not None
            and path == self._presented[1]
            and not os.path.lexists(self.tree / self._presented[0])
        ):
            log.info("the job took step %s from %s", path, self._presented[0])
            self._presented = None
            return True
        return False

    def forget(self, roots: list[str]) -> None:
        """Retention dropped a step: Orbax never deletes local steps, so the node does."""
        if self.spec is not None:
            self._doomed.extend(roots)
            self._wake.set()

    # -- the task --------------------------------------------------------------------------------

    async def run(self) -> None:
        if os.path.lexists(self.tree / REPLICATOR):  # noqa: ASYNC240 (the tree is tmpfs: never waits on a disk)
            self._wake.set()  # written while no daemon was serving
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._doomed:
                root = self._doomed.pop()
                try:
                    await trio.to_thread.run_sync(self._delete, root)
                except OSError as e:  # a link in the way, or the volume refused: the step stays
                    log.warning("could not delete superseded step %s from the volume: %s", root, e)
            if os.path.lexists(self.tree / REPLICATOR):  # noqa: ASYNC240 (tmpfs, as above)
                try:
                    await self._answer()
                except OSError as e:  # the volume refused an answer: say so, keep the mount up
                    self.last_error = f"could not answer {REPLICATOR}: {e}"
                    log.error("%s", self.last_error)

    def _delete(self, root: str) -> None:
        """Delete a dropped step's root through the mount, never through a link the job made."""
        with _opened(self.mountpoint) as fd:
            if beneath.remove(fd, root):
                log.info("deleted superseded step %s from the volume", root)

    async def _answer(self) -> None:
        mnt = self.mountpoint
        owner = None  # the answers go to whoever wrote the question: in the sticky root only they may delete them
        try:
            st = await trio.to_thread.run_sync(os.lstat, mnt / REPLICATOR)
            owner = (st.st_uid, st.st_gid)
            text = await trio.to_thread.run_sync(self._read)
            problem = None
        except FileNotFoundError:
            return
        except SpecError as e:
            text, problem = None, str(e)
        except OSError as e:
            text, problem = None, f"cannot read {REPLICATOR}: {e.strerror or e}"
        for stale in (FAILED, ERRORS, PRERESTORE):  # a previous pod's answers, never read
            await trio.to_thread.run_sync(functools.partial((mnt / stale).unlink, missing_ok=True))
        if text is not None:
            try:
                spec, warnings = await trio.to_thread.run_sync(parse_spec, text)
                warnings += self._apply(spec)
                target = await self._restore_target()
            except SpecError as e:
                problem = str(e)
                if isinstance(e, NextStart):
                    await trio.to_thread.run_sync(write_atomically, self.state_path, json.dumps(asdict(spec)), 0o600)
            except Exception:  # a bug must cost this answer, never the mount
                log.exception("could not follow %s", REPLICATOR)
                problem = f"tierfs could not follow {REPLICATOR} (an internal error, in the daemon's log)"
        if problem is not None:
            self.last_error = problem
            log.error("%s: %s", REPLICATOR, problem)
            await self._put(FAILED, f"tierfs: {problem}\n", owner)
        else:
            self.spec, self.last_error = spec, None
            await trio.to_thread.run_sync(write_atomically, self.state_path, json.dumps(asdict(spec)), 0o600)
            if warnings:
                await self._put(ERRORS, "".join(f"tierfs: {w}\n" for w in warnings), owner)
            await self._put(PRERESTORE, prerestore(target[0] if target else None), owner)
            await trio.to_thread.run_sync(self._present, spec.job_name, target, owner)
            log.info(
                "%s accepted: job %s, rank %d of %d, restore %s",
                REPLICATOR,
                spec.job_name,
                spec.node_rank,
                spec.nodes,
                f"step {target[0]}" if target else "nothing",
            )
        # The acknowledgement comes last: the job reads the answers as soon as it sees it.
        await trio.to_thread.run_sync(functools.partial((mnt / REPLICATOR).unlink, missing_ok=True))

    def _read(self) -> str:
        """The job's ``replicator.yaml``: a regular file (never a link followed, never a fifo
        waited on) of at most MAX_SPEC_BYTES, in UTF-8. Raises SpecError otherwise."""
        with _opened(self.mountpoint) as fd:
            try:
                data = read_small(Path(REPLICATOR), MAX_SPEC_BYTES, dir_fd=fd)
            except UnsafeFile as e:
                raise SpecError(f"{e}: write it as a regular file of at most {MAX_SPEC_BYTES >> 10} KiB") from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecError(f"{REPLICATOR} is not UTF-8 text") from None

    async def _put(self, name: str, text: str, owner: tuple[int, int] | None) -> None:
        """An answer in the volume's root, readable by the job and its to delete."""
        await trio.to_thread.run_sync(write_atomically, self.mountpoint / name, text, 0o644, owner)

    def _present(self, job: str, target: tuple[int, str] | None, owner: tuple[int, int] | None = None) -> None:
        """The job renames the entry onto ``<step>``, which therefore must not exist yet: a
        step at the root is presented by renaming its directory to the entry; one elsewhere
        by a symlink to it, as GKE's replicator does. Names are one component of the root."""
        with _opened(self.mountpoint) as fd:
            _clear_entries(fd)
            if target is None:
                entry = restore_entry_name(job, 0, self.rank)
                marker = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
                try:
                    if owner is not None:
                        os.fchown(marker, *owner)
                finally:
                    os.close(marker)
                return
            step, root = target
            entry = restore_entry_name(job, step, self.rank)
            if root == str(step) and stat.S_ISDIR(os.lstat(root, dir_fd=fd).st_mode):
                os.rename(root, entry, src_dir_fd=fd, dst_dir_fd=fd)
                self._presented = (entry, root)
            else:
                os.symlink(root, entry, dir_fd=fd)
                if owner is not None:
                    os.chown(entry, *owner, dir_fd=fd, follow_symlinks=False)

    def status(self) -> dict:
        return {"spec": asdict(self.spec) if self.spec else None, "error": self.last_error}


def _clear_entries(dir_fd: int) -> None:
    """Take back ``.restore`` entries the job did not consume: a presented step directory
    gets its name back, anything else goes. ``dir_fd`` is the volume's root."""
    for entry in os.scandir(dir_fd):
        step = restore_entry_step(entry.name)
        if step is None:
            continue
        if entry.is_dir(follow_symlinks=False):
            try:
                os.lstat(str(step), dir_fd=dir_fd)
            except FileNotFoundError:
                os.rename(entry.name, str(step), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            try:
                os.unlink(entry.name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass


@contextlib.contextmanager
def _opened(directory: Path) -> Iterator[int]:
    """A descriptor of ``directory`` (the tree or the mount: paths the daemon chose), closed after."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)
