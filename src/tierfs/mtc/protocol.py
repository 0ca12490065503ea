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

``replicator.yaml`` is written by whoever runs in the pod, and read by root. It is read
without following a symbolic link and at most 64 KiB of it; YAML anchors and aliases are
refused (an alias bomb expands to 10^9 elements), so is nesting deeper than the spec needs
(deep nesting exhausts the YAML composer's stack), and it is parsed in a worker thread, so
the mount answers meanwhile. ``$VAR`` references expand only the variables that describe
the job's shape (:data:`EXPANDABLE`), never the daemon's secret or credentials, and an
error never repeats a value: ``replicator.failed`` is readable by every user of the node.
Whatever the file holds, the answer is one line in ``replicator.failed`` and the daemon
goes on serving.
"""

from __future__ import annotations

import collections
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

from tierfs.core.atomic import (
    UnsafeFile,
    read_small,
    read_state,
    temporary_name,
    write_atomically,
)
from tierfs.ramtier import beneath

log = logging.getLogger(__name__)

JAX_INIT_INFO = "jax-init-info.txt"
REPLICATOR = "replicator.yaml"
ERRORS = "replicator.errors"
FAILED = "replicator.failed"
PRERESTORE = "replicator.prerestore"
RESTORE_ENTRY = re.compile(r"^.+-s(\d+)-n\d+-w\d+\.restore$")
FRAMEWORKS = ("orbax", "pytorch.distributed", "pytorch")

MAX_SPEC_BYTES = 64 << 10  # Orbax's file is about 200 bytes
MAX_DEPTH = 4  # nodes from the document down: the spec needs 3 (mapping, list, rank)
MAX_NODES = 1 << 16
MAX_INT = 10**9  # any count or interval beyond this is a mistake, and would overflow a float
MAX_JOB_NAME = 200  # it names the .restore entry, a file name of at most 255 bytes
# The variables a value may name: those that describe the job's shape on Kubernetes (Job,
# JobSet), in torchrun and the PyTorch resiliency library, and tierfs' own options of the
# same kind. Nothing else of the daemon's environment (its peer secret, credentials, proxy
# settings) may reach a file the job reads.
EXPANDABLE = frozenset({
    "NODE_RANK", "NNODES", "MASTER_PORT", "HOSTNAME",
    "JOB_COMPLETION_INDEX", "JOB_INDEX", "JOBSET_NAME", "REPLICATED_JOB_NAME",
    "TIERFS_JOB", "TIERFS_RANK", "TIERFS_NODES", "TIERFS_DATA_PARALLEL",
})

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


class _SpecLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses anchors, aliases and deep nesting before composing them."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise SpecError(f"{REPLICATOR} uses a YAML anchor or alias ('&' or '*'): write each value out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise SpecError(f"{REPLICATOR} nests values deeper than {MAX_DEPTH} levels: "
                                "it holds plain keys, numbers and a list of ranks")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str) -> object:
    """One YAML document from the job, safely: SpecError (one line, no value echoed) if it is
    too large, not YAML, or uses anchors, aliases or deep nesting."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{REPLICATOR} is larger than {MAX_SPEC_BYTES >> 10} KiB: it holds a few keys")
    try:
        return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 (a SafeLoader, hardened)
    except SpecError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or "unreadable"
        raise SpecError(f"{REPLICATOR} is not valid YAML" + (f" (line {mark.line + 1})" if mark else "")
                        + f": {_one_line(str(problem))}") from None
    except Exception as e:  # a value the YAML constructor cannot build (a 31st of February...)
        raise SpecError(f"{REPLICATOR} has a value YAML cannot read ({type(e).__name__}): "
                        "use plain numbers and text") from None


def parse_spec(text: str, env: Mapping[str, str] | None = None) -> tuple[ReplicatorSpec, list[str]]:
    """Parse and check ``replicator.yaml``; returns the spec and warnings (unknown keys...).

    Values may name environment variables (``$VAR`` or ``${VAR}``) of :data:`EXPANDABLE`,
    expanded from ``env`` (default: the daemon's environment); an undefined one is an
    error, not an empty string. Every problem is a SpecError of one line that repeats no
    value, whatever ``text`` holds.
    """
    env = os.environ if env is None else env
    raw = load_yaml(text)
    if not isinstance(raw, dict):
        raise SpecError(f"{REPLICATOR} must be a mapping of keys to values, like 'nodes: 4'")
    values = {k: _expand(k, v, env) for k, v in raw.items() if isinstance(k, str)}
    unknown = [k for k in values if k not in _KNOWN]
    warnings = [f"unknown key {_short(k)} in {REPLICATOR} ignored" for k in unknown[:5]]
    if len(unknown) > 5:
        warnings.append(f"{len(unknown) - 5} more unknown keys in {REPLICATOR} ignored")
    if len(values) < len(raw):
        warnings.append(f"{len(raw) - len(values)} key(s) that are not text in {REPLICATOR} ignored")
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
    if nodes > MAX_NODES:
        raise SpecError(f"'nodes' is {nodes} in {REPLICATOR}: tierfs serves jobs of at most {MAX_NODES} nodes")
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
            peers = load_yaml(peers)
        except SpecError:
            pass
    if not isinstance(peers, list):
        raise SpecError(f"'peer-ranks' must be a list of ranks like [1, 3] in {REPLICATOR}, not {_kind(peers)}")
    peer_ranks = tuple(_int("peer-ranks", p) for p in peers)
    counts = collections.Counter(peer_ranks)
    if len(counts) != len(peer_ranks):
        dup = sorted(p for p, n in counts.items() if n > 1)[:5]
        raise SpecError(f"'peer-ranks' lists rank {', '.join(map(str, dup))} more than once in {REPLICATOR}")
    for p in peer_ranks:
        if not 0 <= p < nodes:
            raise SpecError(f"'peer-ranks' has rank {p}, out of range for {nodes} node(s) in {REPLICATOR}")
        if p == rank:
            raise SpecError(f"'peer-ranks' has this node's own rank {rank} in {REPLICATOR}")
    framework = values["framework"]
    if not isinstance(framework, str):
        raise SpecError(f"'framework' must be text like 'orbax' in {REPLICATOR}, not {_kind(framework)}")
    if framework not in FRAMEWORKS:
        shown = _short(framework) if framework == raw["framework"] else "from the environment"
        warnings.append(f"framework {shown} is not one of {', '.join(FRAMEWORKS)}; treated like them")
    job = values["job-name"]
    if isinstance(job, int) and not isinstance(job, bool) and abs(job) <= MAX_INT:
        job = str(job)  # a run named by a number
    if not isinstance(job, str):
        raise SpecError(f"'job-name' must be text in {REPLICATOR}, not {_kind(job)}")
    if not job:
        raise SpecError(f"'job-name' is empty in {REPLICATOR}")
    if len(job) > MAX_JOB_NAME or "/" in job or not job.isprintable():
        raise SpecError(f"'job-name' in {REPLICATOR} must be at most {MAX_JOB_NAME} printable characters "
                        "without '/': it names the .restore entry")
    spec = ReplicatorSpec(
        job_name=job, framework=framework, nodes=nodes, node_rank=rank, peer_ranks=peer_ranks,
        data_parallelism=dp, backup_interval_minutes=ints.get("backup-interval-minutes"),
        backup_interval_steps=ints.get("backup-interval-steps"),
        workers_per_node=ints.get("workers-per-node", 1),
    )
    return spec, warnings


def _expand(key: str, value: object, env: Mapping[str, str]) -> object:
    """``value`` with its ``$VAR`` references replaced; only :data:`EXPANDABLE` ones."""
    if isinstance(value, list):
        return [_expand(key, v, env) for v in value]
    if not isinstance(value, str) or "$" not in value:
        return value
    template = string.Template(value)
    if not template.is_valid():
        raise SpecError(f"{_short(key)} in {REPLICATOR} has a '$' that does not start a variable name "
                        "(write $$ for a '$' of its own)")
    names = template.get_identifiers()
    for name in names:
        if name not in EXPANDABLE:
            raise SpecError(f"{_short(key)} in {REPLICATOR} refers to ${_one_line(name, 40)}, which tierfs "
                            f"does not expand: use a value, or one of ${', $'.join(sorted(EXPANDABLE))}")
        if name not in env:
            raise SpecError(f"{_short(key)} in {REPLICATOR} refers to ${name}, which is not set")
    return template.substitute({name: env[name] for name in names})


def _int(key: str, value: object) -> int:
    """A whole number from YAML or from text; SpecError (without the value) otherwise."""
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*", value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{key!r} must be a whole number in {REPLICATOR}, not {_kind(value)}")
    if abs(value) > MAX_INT:
        raise SpecError(f"{key!r} is out of range in {REPLICATOR}: at most {MAX_INT}")
    return value


def _kind(value: object) -> str:
    """What ``value`` is, for an error that must not repeat it."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, str):
        return "text" if value else "empty text"
    if isinstance(value, (int, float)):
        return "a decimal number" if isinstance(value, float) else "a single number"
    return {list: "a list", dict: "a mapping"}.get(type(value), f"a YAML {type(value).__name__}")


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _one_line(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "")


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
            log.info("%s accepted: job %s, rank %d of %d, restore %s", REPLICATOR, spec.job_name,
                     spec.node_rank, spec.nodes, f"step {target[0]}" if target else "nothing")
        # The acknowledgement comes last: the job reads the answers as soon as it sees it.
        await trio.to_thread.run_sync(functools.partial((mnt / REPLICATOR).unlink, missing_ok=True))

    def _read(self) -> str:
        """The job's ``replicator.yaml``: a regular file (never a link followed, never a fifo
        waited on) of at most MAX_SPEC_BYTES, in UTF-8. Raises SpecError otherwise."""
        with _opened(self.mountpoint) as fd:
            try:
                data = read_small(REPLICATOR, MAX_SPEC_BYTES, dir_fd=fd)
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
