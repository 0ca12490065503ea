"""Every field of a peer's ``info`` and ``list`` answers, checked once where it arrives.

A node surveys its peers itself with these two requests (:func:`tierfs.pipeline.survey.survey`),
and places replicas and claims its rank from ``info``. A peer holding the job's secret is
trusted to authenticate, not to tell the truth, and what it answers here decides which
step a restart restores, the retention floor and where replicas go. So, as coordination
messages are (:mod:`tierfs.coordination.fields`, whose checkers these are), nothing is
used as it came: the client parses both answers into checked values and anything else is
:class:`MalformedAnswer`, which makes that peer count as unanswered, never a value used.
"""

from __future__ import annotations

import math
from typing import Any

from tierfs.coordination import fields
from tierfs.coordination.pairs import rank_step_pairs
from tierfs.coordination.transport import BadMessage
from tierfs.coordination.view import MAX_RANK, MAX_REPLICAS, MAX_STEP, MAX_STEPS, topology_labels
from tierfs.peers.wire import PeerError

MAX_NODE = 255 + 1 + 4096  # characters of a node's name: its host name, ":", its RAM tier's path
MAX_INSTANCE = 64  # characters of its instance (a daemon's is 16)


class MalformedAnswer(PeerError):
    """A peer's answer read whole but of the wrong shape, types or sizes: the connection is still in step."""


def info(answer: dict[str, Any], nodes: int | None) -> dict[str, Any]:
    """The fields of an ``info`` answer this node uses, checked.

    Returned as a new dict of the fields the peer sent, as the wire has them (JSON), so
    that a field this node does not check is never read. A peer whose rank lies beyond
    the job's ``nodes`` (a spare node that only keeps replicas, or one left from before the
    job shrank) still answers, but its own steps and restore step are left out, as a
    report's replicas of such ranks are: no rank outside the job counts as a writing rank
    or has a say in the step the job restores.
    """
    checked: dict[str, Any] = {"rank": fields.rank(answer.get("rank"), "rank", MAX_RANK + 1)}
    member = nodes is None or checked["rank"] < nodes
    if "steps" in answer:
        steps = fields.steps(answer["steps"], "steps", MAX_STEPS)
        if member:
            checked["steps"] = steps
    if "restore_step" in answer:
        restore_step = fields.step(answer["restore_step"], "restore_step", optional=True)
        if member:
            checked["restore_step"] = restore_step
    if "topology" in answer:
        checked["topology"] = [list(t) for t in topology_labels(answer["topology"])]
    if answer.get("twins") is not None:  # the ranks its replicator.yaml names as holding its data
        twins = answer["twins"]
        if not isinstance(twins, list) or len(twins) > MAX_REPLICAS:
            raise BadMessage(f"twins must be a list of at most {MAX_REPLICAS} ranks")
        checked["twins"] = [fields.rank(t, "twins", MAX_RANK + 1) for t in twins]
    for key in ("free", "data_parallel"):
        if answer.get(key) is not None:
            checked[key] = fields.count(answer[key], key)
    checked.update(_identity(answer))
    return checked


def _identity(answer: dict[str, Any]) -> dict[str, Any]:
    """Who the peer says it is (:mod:`tierfs.peers.claim`): all three fields, or none (an older version)."""
    if all(answer.get(key) is None for key in ("node", "instance", "started")):
        return {}
    node, instance, started = answer.get("node"), answer.get("instance"), answer.get("started")
    if not (isinstance(node, str) and 0 < len(node) <= MAX_NODE and node.isprintable()):
        raise BadMessage(f"node must be a printable name of at most {MAX_NODE} characters")
    if not (isinstance(instance, str) and 0 < len(instance) <= MAX_INSTANCE and instance.isprintable()):
        raise BadMessage(f"instance must be a printable name of at most {MAX_INSTANCE} characters")
    if (
        not isinstance(started, (int, float))
        or isinstance(started, bool)
        or not (math.isfinite(started) and started >= 0)
    ):
        raise BadMessage("started must be a time in seconds since the epoch")
    return {"node": node, "instance": instance, "started": float(started)}


def listing(answer: dict[str, Any], nodes: int | None) -> list[tuple[int, int]]:
    """The (rank, step) manifests of a ``list`` answer: at most MAX_REPLICAS, as a report may carry.

    Manifests of ranks beyond the job are left out rather than refused, as in a report
    (:func:`tierfs.coordination.fields.report`): a job that shrank leaves them in replica
    stores for a while, and one such rank would otherwise count as a writing rank.
    """
    pairs = rank_step_pairs(answer.get("manifests"), "manifest", MAX_REPLICAS, MAX_RANK, MAX_STEP)
    return [(r, s) for r, s in pairs if nodes is None or r < nodes]
