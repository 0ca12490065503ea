"""A list of ``[rank, step]`` pairs as another node sent it: which manifests that node holds.

A report carries them as the replicas a node keeps (:mod:`.view`), and a peer's ``list``
answer as every manifest it holds (:mod:`tierfs.peers.answers`). Both decide which ranks
count as writing and which steps are complete, so a malformed pair is refused the same
way whichever way it came. This sits below :mod:`.view` and :mod:`.fields`, importing
neither, so both can use it; the caller gives the bounds.
"""

from __future__ import annotations

from tierfs.coordination.transport import BadMessage


def _what(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def rank_step_pairs(value: object, item: str, limit: int, max_rank: int, max_step: int) -> list[tuple[int, int]]:
    """At most ``limit`` pairs of a rank in ``[0, max_rank]`` and a step in ``[0, max_step]``.

    ``item`` names one pair in the one line that refuses them ("replica", "manifest").
    """
    if not isinstance(value, list) or len(value) > limit:
        raise BadMessage(f"{item}s must be a list of at most {limit} [rank, step] pairs")
    pairs = []
    for p in value:
        if not (isinstance(p, list) and len(p) == 2):
            raise BadMessage(f"each {item} must be a [rank, step] pair")
        r, s = p
        if type(r) is not int or not 0 <= r <= max_rank:
            raise BadMessage(f"a {item}'s rank must be a non-negative integer of at most {max_rank}, not {_what(r)}")
        if type(s) is not int or not 0 <= s <= max_step:
            raise BadMessage(f"a {item}'s step must be a step, an integer in [0, {max_step}], not {_what(s)}")
        pairs.append((r, s))
    return pairs
