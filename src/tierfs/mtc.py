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
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import stat
import string
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import trio
import yaml

from tierfs.atomic import read_state, temporary_name, write_atomically
from tierfs.ramtier import beneath

log = logging.getLogger(__name__)

JAX_INIT_INFO = "jax-init-info.txt"
REPLICATOR = "replicator.yaml"
ERRORS = "replicator.errors"
FAILED = "replicator.failed"
PRERESTORE = "replicator.prerestore"
RESTORE_ENTRY = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")
FRAMEWORKS = ("orbax", "pytorch.distributed", "pytorch")

_INT_KEYS = ("node-rank", "nodes", "assume-data-parallelism", "backup-interval-minutes",
             "backup-interval-steps", "workers-per-node", "peers-per-node", "master-port")
_REQUIRED = ("job-name", "framework", "assume-data-parallelism", "node-rank", "nodes", "peer-ranks")
_KNOWN = set(_REQUIRED) | set(_INT_KEYS)


class SpecError(Exception):
    """``replicator.yaml`` cannot be followed; the message names the key and the problem."""


@dataclass(frozen=True)
class ReplicatorSpec:
    """What the job told the node in ``replicator.yaml``, checked."""

    job_name: str
    framework: str
    nodes: int
    node_rank: int
    peer_ranks: tuple[int, ...]
    data_parallelism: int
    backup_interval_minutes: int | None = None  # exactly one of the two intervals
    backup_interval_steps: int | None = None
    workers_per_node: int = 1

    @property
    def backup_interval_s(self) -> float | None:
        return None if self.backup_interval_minutes is None else 60.0 * self.backup_interval_minutes


def parse_spec(text: str, env: Mapping[str, str] | None = None) -> tuple[ReplicatorSpec, list[str]]:
    """Parse and check ``replicator.yaml``; returns the spec and warnings (unknown keys...).

    Values may name environment variables (``$VAR`` or ``${VAR}``), expanded from ``env``
    (default: the daemon's environment); an undefined one is an error, not an empty string.
    """
    env = os.environ if env is None else env
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        raise SpecError(f"{REPLICATOR} is not valid YAML"
                        + (f" (line {where.line + 1})" if where else "") + f": {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{REPLICATOR} must be a mapping of keys to values, like 'nodes: 4'")
    values = {str(k): _expand(str(k), v, env) for k, v in raw.items()}
    warnings = [f"unknown key {k!r} in {REPLICATOR} ignored" for k in values if k not in _KNOWN]
    missing = [k for k in _REQUIRED if k not in values]
    if missing:
        raise SpecError(f"{REPLICATOR} lacks {', '.join(repr(k) for k in missing)}")
    ints = {k: _int(k, values[k]) for k in _INT_KEYS if k in values}
    has_minutes, has_steps = "backup-interval-minutes" in ints, "backup-interval-steps" in ints
    if has_minutes == has_steps:
        raise SpecError(f"{REPLICATOR} must give exactly one of 'backup-interval-minutes' and "
                        f"'backup-interval-steps' ({'both' if has_minutes else 'neither'} given)")
    nodes, rank, dp = ints["nodes"], ints["node-rank"], ints["assume-data-parallelism"]
    if nodes < 1:
        raise SpecError(f"'nodes' is {nodes} in {REPLICATOR}: it must be at least 1")
    if not 0 <= rank < nodes:
        raise SpecError(f"'node-rank' {rank} is out of range for {nodes} node(s) in {REPLICATOR}")
    if dp < 1 or nodes % dp:
        raise SpecError(f"'assume-data-parallelism' {dp} must be at least 1 and divide 'nodes' ({nodes})")
    for key in ("backup-interval-minutes", "backup-interval-steps", "workers-per-node"):
        if key in ints and ints[key] < (1 if key == "workers-per-node" else 0):
            raise SpecError(f"{key!r} is {ints[key]} in {REPLICATOR}: it must not be negative"
                            + (" or zero" if key == "workers-per-node" else ""))
    peers = values["peer-ranks"]
    if isinstance(peers, str):  # from a variable: read as if written in place
        try:
            peers = yaml.safe_load(peers)
        except yaml.YAMLError:
            pass
    if not isinstance(peers, list):
        raise SpecError(f"'peer-ranks' must be a list of ranks like [1, 3] in {REPLICATOR}, not {peers!r}")
    peer_ranks = tuple(_int("peer-ranks", p) for p in peers)
    if len(set(peer_ranks)) != len(peer_ranks):
        dup = sorted({p for p in peer_ranks if peer_ranks.count(p) > 1})
        raise SpecError(f"'peer-ranks' lists rank {', '.join(map(str, dup))} more than once in {REPLICATOR}")
    for p in peer_ranks:
        if not 0 <= p < nodes:
            raise SpecError(f"'peer-ranks' has rank {p}, out of range for {nodes} node(s) in {REPLICATOR}")
        if p == rank:
            raise SpecError(f"'peer-ranks' has this node's own rank {rank} in {REPLICATOR}")
    framework = str(values["framework"])
    if framework not in FRAMEWORKS:
        warnings.append(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}; treated like them")
    job = str(values["job-name"])
    if not job:
        raise SpecError(f"'job-name' is empty in {REPLICATOR}")
    spec = ReplicatorSpec(
        job_name=job, framework=framework, nodes=nodes, node_rank=rank, peer_ranks=peer_ranks,
        data_parallelism=dp, backup_interval_minutes=ints.get("backup-interval-minutes"),
        backup_interval_steps=ints.get("backup-interval-steps"),
        workers_per_node=ints.get("workers-per-node", 1),
    )
    return spec, warnings


def _expand(key: str, value, env: Mapping[str, str]):
    if isinstance(value, list):
        return [_expand(key, v, env) for v in value]
    if not isinstance(value, str) or "$" not in value:
        return value
    try:
        expanded = string.Template(value).substitute(env)
    except KeyError as e:
        raise SpecError(f"{key!r} in {REPLICATOR} refers to ${e.args[0]}, which is not set") from None
    except ValueError:
        raise SpecError(f"{key!r} in {REPLICATOR} has a '$' that is not a variable: {value!r}") from None
    return expanded


def _int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SpecError(f"{key!r} must be a whole number in {REPLICATOR}, not {value!r}")
    try:
        return int(value)
    except ValueError:
        raise SpecError(f"{key!r} must be a whole number in {REPLICATOR}, not {value!r}") from None


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

    def __init__(self, tree: Path, state_path: Path, mountpoint: Path, rank: int, coordinator: str | None,
                 apply: Callable[[ReplicatorSpec], list[str]],
                 restore_target: Callable[[], Awaitable[tuple[int, str] | None]]):
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
        if self._presented is not None and path == self._presented[1] \
                and not os.path.lexists(self.tree / self._presented[0]):
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
        if os.path.lexists(self.tree / REPLICATOR):  # written while no daemon was serving
            self._wake.set()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._doomed:
                root = self._doomed.pop()
                try:
                    await trio.to_thread.run_sync(self._delete, root)
                except OSError as e:  # a link in the way, or the volume refused: the step stays
                    log.warning("could not delete superseded step %s from the volume: %s", root, e)
            if os.path.lexists(self.tree / REPLICATOR):
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
        try:
            text = await trio.to_thread.run_sync((mnt / REPLICATOR).read_text)
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as e:
            text = None
            problem = f"cannot read {REPLICATOR}: {e}"
        for stale in (FAILED, ERRORS, PRERESTORE):  # a previous pod's answers, never read
            await trio.to_thread.run_sync(functools.partial((mnt / stale).unlink, missing_ok=True))
        if text is not None:
            try:
                spec, warnings = parse_spec(text)
                warnings += self._apply(spec)
                target = await self._restore_target()
                problem = None
            except SpecError as e:
                problem = str(e)
        if problem is not None:
            self.last_error = problem
            log.error("%s: %s", REPLICATOR, problem)
            await self._put(FAILED, f"tierfs: {problem}\n")
        else:
            self.spec, self.last_error = spec, None
            await trio.to_thread.run_sync(write_atomically, self.state_path, json.dumps(asdict(spec)), 0o600)
            if warnings:
                await self._put(ERRORS, "".join(f"tierfs: {w}\n" for w in warnings))
            await self._put(PRERESTORE, prerestore(target[0] if target else None))
            await trio.to_thread.run_sync(self._present, spec.job_name, target)
            log.info("%s accepted: job %s, rank %d of %d, restore %s", REPLICATOR, spec.job_name,
                     spec.node_rank, spec.nodes, f"step {target[0]}" if target else "nothing")
        # The acknowledgement comes last: the job reads the answers as soon as it sees it.
        await trio.to_thread.run_sync(functools.partial((mnt / REPLICATOR).unlink, missing_ok=True))

    async def _put(self, name: str, text: str) -> None:
        """An answer in the volume's root, readable by the job (which deletes it)."""
        await trio.to_thread.run_sync(write_atomically, self.mountpoint / name, text, 0o644)

    def _present(self, job: str, target: tuple[int, str] | None) -> None:
        """The job renames the entry onto ``<step>``, which therefore must not exist yet: a
        step at the root is presented by renaming its directory to the entry; one elsewhere
        by a symlink to it, as GKE's replicator does. Names are one component of the root."""
        with _opened(self.mountpoint) as fd:
            _clear_entries(fd)
            if target is None:
                entry = restore_entry_name(job, 0, self.rank)
                os.close(os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd))
                return
            step, root = target
            entry = restore_entry_name(job, step, self.rank)
            if root == str(step) and stat.S_ISDIR(os.lstat(root, dir_fd=fd).st_mode):
                os.rename(root, entry, src_dir_fd=fd, dst_dir_fd=fd)
                self._presented = (entry, root)
            else:
                os.symlink(root, entry, dir_fd=fd)

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
