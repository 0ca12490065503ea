"""JSON from outside the daemon, with its nesting bounded.

json's C parser stops a nesting bomb only at the interpreter's C recursion limit, and that
limit moves between Python versions: ``RecursionError`` at about 1,000 levels on 3.11 and
3.12, only past 10,000 on 3.13. Formats that nest a few levels deep therefore say how deep
they may go, and what parses is walked once (without recursion) to hold it to that; a bomb
gets the same refusal on every version.
"""

from __future__ import annotations

import json
from typing import Any


class TooDeep(ValueError):
    """JSON whose lists and objects nest deeper than its format allows."""


def load(raw: bytes | str, max_depth: int) -> Any:
    """``raw`` parsed; :class:`TooDeep` past ``max_depth``, ``ValueError`` if it is not JSON (or not UTF-8)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise TooDeep(f"nests deeper than {max_depth} levels") from None
    if nesting_depth(value, max_depth) > max_depth:
        raise TooDeep(f"nests deeper than {max_depth} levels")
    return value


def nesting_depth(value: Any, limit: int) -> int:
    """How deep lists and objects nest in ``value`` (a scalar is 0); counts no further than ``limit + 1``.

    Level by level, so the loops over each container's items run in C: a 100,000-file
    manifest is walked in a fraction of the time json takes to parse it.
    """
    depth, level = 0, [value]
    while True:
        containers = [v for v in level if isinstance(v, (dict, list))]
        if not containers:
            return depth
        depth += 1
        if depth > limit:
            return depth
        level = []
        for c in containers:
            level.extend(c.values() if isinstance(c, dict) else c)
