"""``replicator.yaml``: what a job may tell the node about its shape, and why it is refused.

The file is the one input of the multi-tier checkpointing protocol that the job writes and
root parses, so parsing it is the protocol's attack surface, and it is kept apart from the
files and renames of :mod:`tierfs.mtc.protocol`: pure text in, a checked spec or one line of
refusal out, testable without a mount. At most 64 KiB is read; YAML anchors and aliases
are refused (an alias bomb expands to 10^9 elements), so is nesting deeper than the spec
needs (deep nesting exhausts the YAML composer's stack). ``$VAR`` references expand only
the variables that describe the job's shape (:data:`EXPANDABLE`), never the daemon's secret
or credentials, and an error never repeats a value: ``replicator.failed`` is readable by
every user of the node.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass

REPLICATOR = "replicator.yaml"
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
EXPANDABLE = frozenset(
    {
        "NODE_RANK",
        "NNODES",
        "MASTER_PORT",
        "HOSTNAME",
        "JOB_COMPLETION_INDEX",
        "JOB_INDEX",
        "JOBSET_NAME",
        "REPLICATED_JOB_NAME",
        "TIERFS_JOB",
        "TIERFS_RANK",
        "TIERFS_NODES",
        "TIERFS_DATA_PARALLEL",
    }
)

_INT_KEYS = (
    "node-rank",
    "nodes",
    "assume-data-parallelism",
    "backup-interval-minutes",
    "backup-interval-steps",
    "workers-per-node",
    "peers-per-node",
    "master-port",
    "restore-step",
)
_REQUIRED = ("job-name", "framework", "assume-data-parallelism", "node-rank", "nodes", "peer-ranks")
_KNOWN = set(_REQUIRED) | set(_INT_KEYS)


class SpecError(Exception):
    """``replicator.yaml`` cannot be followed; the message names the key and the problem."""


class NextStart(SpecError):
    """The spec is kept, but what it asks (a rollback) is done when the volume starts again."""


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
    restore_step: int | None = None  # a rollback the job asks for (tierfs.pipeline.rollback)

    @property
    def backup_interval_s(self) -> float | None:
        return None if self.backup_interval_minutes is None else 60.0 * self.backup_interval_minutes


@functools.cache
def _loader() -> type:
    """``yaml.SafeLoader`` that refuses anchors, aliases and deep nesting before composing them.

    Made on first use: importing yaml costs every daemon's start 15-20 ms, and only a job
    that writes a ``replicator.yaml`` needs it.
    """
    import yaml  # noqa: PLC0415

    class SpecLoader(yaml.SafeLoader):
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
                    raise SpecError(
                        f"{REPLICATOR} nests values deeper than {MAX_DEPTH} levels: "
                        "it holds plain keys, numbers and a list of ranks"
                    )
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

    return SpecLoader


def load_yaml(text: str) -> object:
    """One YAML document from the job, safely: SpecError (one line, no value echoed) if it is
    too large, not YAML, or uses anchors, aliases or deep nesting."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{REPLICATOR} is larger than {MAX_SPEC_BYTES >> 10} KiB: it holds a few keys")
    import yaml  # noqa: PLC0415 (not at the top: see _loader)

    try:
        return yaml.load(text, Loader=_loader())  # noqa: S506 (a SafeLoader, hardened)
    except SpecError:
        raise
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or "unreadable"
        raise SpecError(
            f"{REPLICATOR} is not valid YAML"
            + (f" (line {mark.line + 1})" if mark else "")
            + f": {_one_line(str(problem))}"
        ) from None
    except Exception as e:  # noqa: BLE001 (a value the YAML constructor cannot build: a 31st of February...)
        raise SpecError(
            f"{REPLICATOR} has a value YAML cannot read ({type(e).__name__}): use plain numbers and text"
        ) from None


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
        raise SpecError(
            f"{REPLICATOR} must give exactly one of 'backup-interval-minutes' and "
            f"'backup-interval-steps' ({'both' if has_minutes else 'neither'} given)"
        )
    nodes, rank, dp = ints["nodes"], ints["node-rank"], ints["assume-data-parallelism"]
    if nodes < 1:
        raise SpecError(f"'nodes' is {nodes} in {REPLICATOR}: it must be at least 1")
    if nodes > MAX_NODES:
        raise SpecError(f"'nodes' is {nodes} in {REPLICATOR}: tierfs serves jobs of at most {MAX_NODES} nodes")
    if not 0 <= rank < nodes:
        raise SpecError(f"'node-rank' {rank} is out of range for {nodes} node(s) in {REPLICATOR}")
    if dp < 1 or nodes % dp:
        raise SpecError(f"'assume-data-parallelism' {dp} must be at least 1 and divide 'nodes' ({nodes})")
    for key in ("backup-interval-minutes", "backup-interval-steps", "workers-per-node", "restore-step"):
        if key in ints and ints[key] < (1 if key == "workers-per-node" else 0):
            raise SpecError(
                f"{key!r} is {ints[key]} in {REPLICATOR}: it must not be negative"
                + (" or zero" if key == "workers-per-node" else "")
            )
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
        raise SpecError(
            f"'job-name' in {REPLICATOR} must be at most {MAX_JOB_NAME} printable characters "
            "without '/': it names the .restore entry"
        )
    spec = ReplicatorSpec(
        job_name=job,
        framework=framework,
        nodes=nodes,
        node_rank=rank,
        peer_ranks=peer_ranks,
        data_parallelism=dp,
        backup_interval_minutes=ints.get("backup-interval-minutes"),
        backup_interval_steps=ints.get("backup-interval-steps"),
        workers_per_node=ints.get("workers-per-node", 1),
        restore_step=ints.get("restore-step"),
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
        raise SpecError(
            f"{_short(key)} in {REPLICATOR} has a '$' that does not start a variable name "
            "(write $$ for a '$' of its own)"
        )
    names = template.get_identifiers()
    for name in names:
        if name not in EXPANDABLE:
            raise SpecError(
                f"{_short(key)} in {REPLICATOR} refers to ${_one_line(name, 40)}, which tierfs "
                f"does not expand: use a value, or one of ${', $'.join(sorted(EXPANDABLE))}"
            )
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
    containers: dict[type[object], str] = {list: "a list", dict: "a mapping"}
    return containers.get(type(value), f"a YAML {type(value).__name__}")


def _short(text: str, limit: int = 40) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def _one_line(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text[:limit] + ("..." if len(text) > limit else "")
