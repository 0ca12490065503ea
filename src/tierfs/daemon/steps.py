"""The daemon's answer to ``tierfs steps``: every step the job's tiers hold, as this node reaches them now.

``tierfs status`` shows this rank's own steps. Choosing a step to fall back to, or checking
what retention keeps, needs the job's: which tiers hold each step, for how many ranks,
how big and how old it is, whether it is a milestone. Any node can answer, since every
node reaches every rank's holdings through its peers (their RAM and the replicas they
keep) and the bucket.

The answer comes from a survey made for the request, with the restore's own bookkeeping
(:class:`~tierfs.pipeline.survey.Survey`), and kept out of the node's cluster view, so
that asking never moves retention. It runs while the job trains, so it is bounded: each
tier gets a few seconds (a silent peer is named in the answer, not waited for), and
manifests are read only for this rank's steps, at most one per step, newest first, and
at most :data:`MAX_MANIFESTS` per request; a step whose size its state already records
(the bytes of a copy on a tier) costs none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from tierfs.core.errors import UserError
from tierfs.core.manifest import Manifest, ManifestError, authenticate
from tierfs.core.milestones import Milestones
from tierfs.pipeline.survey import FAN_OUT, Survey
from tierfs.tiers.base import NotHeld, Tier, TierError, by_cost, first_line

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.core.keys import ManifestKeys
    from tierfs.pipeline.survey import ClusterView
    from tierfs.ramtier.steps import Steps, StepState
    from tierfs.tiers.local import LocalTier

log = logging.getLogger(__name__)

PEER_BOUND = 3.0  # seconds a node's tier may take to answer: the job trains meanwhile
BUCKET_BOUND = 20.0  # a bucket's listing reads each manifest it has not checked the seal of yet
MANIFEST_BOUND = 5.0  # seconds to read one step's manifest, for its size
MAX_MANIFESTS = 32  # manifests read per request
MANIFESTS_AT_ONCE = 8
MAX_MISSING = 8  # ranks named per step as lacking it
KINDS = {"local": "ram", "disk": "disk", "peer": "peers", "gcs": "gcs"}  # tier kind -> what the listing calls it
ORDER = ("ram", "disk", "peers", "gcs")  # cheapest first, as a restore reads them


@dataclass(frozen=True)
class Facts:
    """What one manifest tells about its step."""

    size: int  # bytes of the rank's files
    created: float  # when the manifest was made: the step's commit, give or take its hashing


def manifest_facts(data: bytes, keys: ManifestKeys | None, job: str, rank: int, step: int) -> Facts:
    """The size and time of a stored manifest, once it proves to be the job's (rank, step).

    Raises :class:`ManifestError` (:class:`~tierfs.core.manifest.Unauthenticated` for one
    the job's secret did not seal). Parsing a large manifest takes a while: call it in a thread.
    """
    manifest = Manifest.from_json(authenticate(data, keys, rank, step))
    manifest.check_identity(job, rank, step)
    return Facts(manifest.total_bytes, manifest.created)


def kind_of(tier: Tier) -> str:
    return KINDS.get(tier.kind, tier.kind)


async def answer(cfg: Config, view: ClusterView, steps: Steps) -> dict:
    """Every step some tier this node reaches holds, newest first, for the control socket's ``steps``."""
    tiers = by_cost(list(view.tiers))
    found = await survey(tiers, view.local)
    kinds = {t.name: kind_of(t) for t in tiers}
    ranks_of: dict[int, dict[int, list[str]]] = {}  # step -> rank -> tier names
    for rank, held in found.holders.items():
        for step, holders in held.items():
            ranks_of.setdefault(step, {})[rank] = holders
    facts = await own_facts(cfg, tiers, found, steps.states)
    milestones = Milestones.from_config(cfg)  # the rules retention keeps them by
    now = time.time()
    listed = []
    for step in sorted(ranks_of, reverse=True):
        ranks = ranks_of[step]
        names = {n for held in ranks.values() for n in held}
        state = steps.states.get(step) if cfg.rank in ranks else None
        fact = facts.get(step)
        at = state.committed_at if state is not None else fact.created if fact is not None else None
        age = round(max(0.0, now - at), 1) if at is not None else None
        listed.append(
            {
                "step": step,
                "tiers": sorted({kinds.get(n, n) for n in names}, key=lambda k: ORDER.index(k) if k in ORDER else 9),
                "peers": sorted(n.removeprefix("peer ") for n in names if kinds.get(n) == "peers"),
                "complete": sum(1 for r in ranks if 0 <= r < cfg.nodes),
                "nodes": cfg.nodes,
                "missing_ranks": [r for r in range(cfg.nodes) if r not in ranks][:MAX_MISSING],
                "size": fact.size if fact is not None else None,
                "committed_at": at,
                "age_s": age,
                "milestone": milestones.is_milestone(step, at, now),
            }
        )
    return {
        "job": cfg.job,
        "rank": cfg.rank,
        "nodes": cfg.nodes,
        "at": now,
        "steps": listed,
        "unanswered": dict(found.errors),
    }


async def survey(tiers: Sequence[Tier], local: LocalTier | None) -> Survey:
    """What every tier holds, each given a bounded time; this node's RAM as it is now."""
    result = Survey()
    limiter = trio.CapacityLimiter(FAN_OUT)

    async def ask(tier: Tier) -> None:
        bound = BUCKET_BOUND if tier.shared else PEER_BOUND
        with trio.move_on_after(bound) as scope:
            try:
                async with limiter:
                    holdings = await tier.holdings()
            except Exception as e:  # a tier that cannot answer is named in the answer, nothing more
                result.errors[tier.name] = first_line(e).removeprefix(f"{tier.name}: ")
                if not isinstance(e, TierError):
                    log.error("tierfs steps: %s failed unexpectedly", tier.name, exc_info=True)
                return
            result.record(tier.name, holdings)
        if scope.cancelled_caught:
            result.errors[tier.name] = f"no answer within {bound:g}s"

    async with trio.open_nursery() as nursery:
        for tier in tiers:
            if tier is not local:
                nursery.start_soon(ask, tier)
    if local is not None:
        result.record(local.name, local.current())
    return result


async def own_facts(
    cfg: Config, tiers: Sequence[Tier], found: Survey, states: dict[int, StepState]
) -> dict[int, Facts]:
    """Size and time of this rank's steps: from their recorded copies, else one manifest each (bounded)."""
    facts: dict[int, Facts] = {}
    to_read: list[int] = []
    for step in sorted(found.holders.get(cfg.rank, {}), reverse=True):
        state = states.get(step)
        size = recorded_size(state) if state is not None else None
        if state is not None and size is not None:
            facts[step] = Facts(size, state.committed_at)
        elif len(to_read) < MAX_MANIFESTS:
            to_read.append(step)
    limiter = trio.CapacityLimiter(MANIFESTS_AT_ONCE)

    async def read(step: int) -> None:
        async with limiter:
            fact = await read_facts(cfg, [t for t in tiers if t.name in found.tiers(cfg.rank, step)], step)
        if fact is not None:
            facts[step] = fact

    async with trio.open_nursery() as nursery:
        for step in to_read:
            nursery.start_soon(read, step)
    return facts


def recorded_size(state: StepState) -> int | None:
    """The bytes of the step's current version, as a lane recorded when it put the step on a tier."""
    return next(
        (
            copy["bytes"]
            for copy in state.copies.values()
            if copy.get("version") == state.version and isinstance(copy.get("bytes"), int)
        ),
        None,
    )


async def read_facts(cfg: Config, holders: Sequence[Tier], step: int) -> Facts | None:
    """This rank's manifest of ``step`` from the cheapest holder that has it; None if none does in time."""
    with trio.move_on_after(MANIFEST_BOUND):
        for tier in holders:
            try:
                data = await tier.get_manifest(cfg.rank, step)
                return await trio.to_thread.run_sync(manifest_facts, data, cfg.manifest_keys, cfg.job, cfg.rank, step)
            except NotHeld:  # this node's RAM before its manifest is built: the next holder has one
                continue
            except (TierError, ManifestError, UserError) as e:
                log.info("tierfs steps: no size for step %d from %s: %s", step, tier.name, first_line(e))
                return None
    return None
