"""Every field of a coordination message or answer, checked once where it arrives.

A member holding the job's secret is trusted to *authenticate*, not to tell the truth:
what it sends decides which step a restarting node restores and what retention deletes
on every node. So nothing another node sent is used as it came. The handlers and the
member side parse each message here into typed values (steps are integers in
``[0, MAX_STEP]``, ranks lie in ``[0, nodes)``, addresses are ``HOST:PORT`` of at most
:data:`MAX_ADDRESS` characters, lists and maps are bounded, flags are booleans) and
anything else is :class:`~tierfs.coordination.transport.BadMessage`: one line, the
message or answer is dropped, and the node goes on serving. The checks are here, once,
rather than where the values are used; the logic past this boundary trusts the types.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal, overload

from tierfs.coordination.transport import BadMessage, Message
from tierfs.coordination.view import GCS, MAX_DECISIONS, MAX_STEP, Holdings, Summary

MAX_ADDRESS = 300  # characters of a HOST:PORT (the peer service allows a sender no longer)
MAX_COMPLETE = 5  # complete steps a summary lists (the newest)
MAX_QUESTION = 64  # characters of a question's id
_NUMBER = re.compile(r"[0-9]{1,19}")  # a step or rank as a JSON object's key
_ADDRESS = re.compile(r"[A-Za-z0-9._:%\[\]-]+:([0-9]{1,5})")  # matched whole (fullmatch)


def _what(value: object) -> str:
    """A short, safe rendering of a refused value for the one line that names it."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def address(value: object, what: str) -> str:
    """A node's ``HOST:PORT`` as other nodes name it."""
    m = _ADDRESS.fullmatch(value) if isinstance(value, str) and len(value) <= MAX_ADDRESS else None
    if m is None or not 0 < int(m.group(1)) < 65536:
        raise BadMessage(f"{what} must be a HOST:PORT address of at most {MAX_ADDRESS} characters, not {_what(value)}")
    return m.string  # ``value`` itself, as a str


def addresses(value: object, what: str, limit: int) -> list[str]:
    if not isinstance(value, list) or len(value) > limit:
        raise BadMessage(f"{what} must be a list of at most {limit} addresses")
    return [address(a, what) for a in value]


def holder(value: object, what: str) -> str:
    """Who holds a step: a node's address or ``"gcs"``."""
    return GCS if value == GCS else address(value, what)


@overload
def step(value: object, what: str, *, optional: Literal[False] = False) -> int: ...
@overload
def step(value: object, what: str, *, optional: bool) -> int | None: ...
def step(value: object, what: str, *, optional: bool = False) -> int | None:
    """A step number: an integer in ``[0, MAX_STEP]`` (None only where the message may say "none")."""
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise BadMessage(f"{what} must be a step, an integer in [0, {MAX_STEP}], not {_what(value)}")
    return value


def steps(value: object, what: str, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit:
        raise BadMessage(f"{what} must be a list of at most {limit} steps")
    return [step(s, what) for s in value]


def rank(value: object, what: str, nodes: int) -> int:
    """A rank of the job: ``[0, nodes)``."""
    if type(value) is not int or not 0 <= value < nodes:
        raise BadMessage(f"{what} must be a rank of the job's {nodes} nodes, not {_what(value)}")
    return value


def count(value: object, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_STEP:
        raise BadMessage(f"{what} must be a non-negative integer, not {_what(value)}")
    return value


def flag(value: object, what: str) -> bool:
    if type(value) is not bool:
        raise BadMessage(f"{what} must be true or false, not {_what(value)}")
    return value


def obj(value: object, what: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise BadMessage(f"{what} must be a JSON object")
    return value


def report(value: object, nodes: int) -> Holdings:
    """A member's holdings (``coord_report``, ``coord_decide``, a pull's answer), for ranks of the job only.

    Its own rank must be one of the job's. Replicas of ranks beyond the job are left out
    rather than refused: a job that shrank leaves them in replica stores for a while. Left
    in, one such rank would count as a writing rank, and no step would be complete.
    """
    h = Holdings.from_wire(value)
    rank(h.rank, "a report's rank", nodes)
    if any(r >= nodes for r, _ in h.replicas):
        h = replace(h, replicas=tuple(p for p in h.replicas if p[0] < nodes))
    return h


def summary(value: object) -> Summary:
    """SUMMARY of :mod:`tierfs.coordination.protocol`: the floor and newest step every node acts on."""
    data = obj(value, "summary")
    return {
        "newest": step(data.get("newest"), "summary newest", optional=True),
        "floor": step(data.get("floor"), "summary floor", optional=True),
        "decisions": steps(data.get("decisions", []), "summary decisions", MAX_DECISIONS),
        "complete": steps(data.get("complete", []), "summary complete", MAX_COMPLETE),
        "ranks": count(data.get("ranks", 0), "summary ranks"),
    }


# -- the coordinator side: questions from members -------------------------------------------


def suspects(message: Message, limit: int) -> list[str]:
    """The coordinators a member found silent (``coord_report``'s optional ``suspects``)."""
    value = message.get("suspects")
    return [] if value is None else addresses(value, "suspects", limit)


@dataclass(frozen=True)
class Question:
    """A ``coord_decide``: which rank (and twins) ask, how long they wait, the asker's holdings."""

    rank: int
    group: tuple[int, ...]
    wait: float
    question: str
    report: Holdings | None

    @classmethod
    def parse(cls, message: Message, nodes: int, max_group: int, max_wait: float) -> Question:
        asked = rank(message.get("rank"), "rank", nodes)
        group = message.get("group", [])
        if not isinstance(group, list) or len(group) > max_group:
            raise BadMessage(f"group must be a list of at most {max_group} ranks")
        wait = message.get("wait", 0)
        if type(wait) not in (int, float) or not 0 <= wait <= max_wait:
            raise BadMessage(f"wait must be a number of seconds in [0, {max_wait:g}]")
        question = message.get("q", "")
        if not isinstance(question, str) or len(question) > MAX_QUESTION or not question.isprintable():
            raise BadMessage(f"q must be a printable string of at most {MAX_QUESTION} characters")
        held = message.get("report")
        return cls(
            asked,
            tuple(rank(g, "group", nodes) for g in group),
            float(wait),
            question,
            None if held is None else report(held, nodes),
        )


# -- the member side: answers from coordinators -----------------------------------------------


def report_answer(reply: Message, max_down: int) -> tuple[Summary, list[str]]:
    """A ``coord_report`` answer: the coordinator's summary, and the coordinators it found down."""
    return summary(reply.get("summary")), addresses(reply.get("down", []), "down", max_down)


def number_key(value: str, what: str) -> int:
    """A step or rank that keys a JSON object (``"12"``)."""
    if not (isinstance(value, str) and _NUMBER.fullmatch(value)):
        raise BadMessage(f"{what} must be keyed by numbers, not {_what(value)}")
    return int(value)


def rank_answer(
    value: object, what: str, max_steps: int, max_holders: int
) -> tuple[int | None, dict[int, list[str]], list[str]]:
    """What a ``coord_decide`` answer says of one rank: (choice, step -> holders, the rank's nodes)."""
    data = obj(value, what)
    choice = step(data.get("choice"), f"{what} choice", optional=True)
    held = obj(data.get("steps"), f"{what} steps")
    if len(held) > max_steps:
        raise BadMessage(f"{what} steps must list at most {max_steps} steps")
    by_step: dict[int, list[str]] = {}
    for s, holders in held.items():
        key = step(number_key(s, f"{what} steps"), f"{what} steps")
        if not isinstance(holders, list) or len(holders) > max_holders:
            raise BadMessage(f"{what} step {key} must list at most {max_holders} holders")
        by_step[key] = [holder(h, f"{what} step {key} holder") for h in holders]
    if choice is not None and by_step and choice not in by_step and (len(by_step) < max_steps or choice > min(by_step)):
        # A rank that holds steps chooses one of them; only the newest are listed, so an older one may be cut.
        raise BadMessage(f"{what} choice {choice} is none of the steps it lists")
    return choice, by_step, addresses(data.get("nodes", []), f"{what} nodes", max_holders)


def chunk_status(reply: Message, max_via: int) -> tuple[bool, bool, bool, int | None, list[str]]:
    """An ``await_chunk`` answer: (have, pending, fetching, progress, via)."""
    progress = reply.get("progress")
    return (
        flag(reply.get("have", False), "have"),
        flag(reply.get("pending", False), "pending"),
        flag(reply.get("fetching", False), "fetching"),
        None if progress is None else count(progress, "progress"),
        addresses(reply.get("via", []), "via", max_via),
    )
