"""How coordination and broadcast code reach other nodes: one request, one answer, a timeout.

The code in this package never opens a socket itself. It is given a :class:`Transport`,
so the same coordinators, members and planned fetches run over the simulated network of
:mod:`tierfs_testing.sim` and, in the daemon, over the peer protocol's framing
(docs/peer-protocol.md): a message is one JSON header, an answer is one JSON header, and
a ``"len"`` in an answer announces a body (a chunk) the way ``get_chunk`` does.

Every message is a JSON object of at most :data:`MAX_MESSAGE` bytes, the peer wire's
header limit after authentication; :func:`encoded` refuses a bigger one before it leaves.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeAlias, overload

MAX_MESSAGE = 1 << 20  # the peer wire's header limit once a connection is authenticated

# A JSON object as it came off the wire: its values are whatever JSON holds until a reader
# checks them (int_field, int_list and the readers of fields.py).
Message: TypeAlias = dict[str, Any]
Handler = Callable[[str, Message], Awaitable[Message]]  # (who sent it, the message) -> the answer


class Unreachable(Exception):
    """The other node did not answer in time: down, too slow, cut off, or lost the message."""


class Refused(Unreachable):
    """The other node's host answered that nothing listens there (yet): worth asking again soon."""


class BadMessage(ValueError):
    """A message or answer that does not have the shape, types or sizes this package sends."""


class Transport(Protocol):
    """A request to another node and its answer, within ``timeout`` seconds.

    Raises :class:`Unreachable` when no answer comes (refused, timed out, lost). An answer
    ``{"error": ...}`` is returned as it is: the node answered, it just refused.
    """

    async def request(self, address: str, message: Message, timeout: float) -> Message: ...


def encoded(message: Message) -> bytes:
    """``message`` as the wire carries it; BadMessage if it is larger than the header limit."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise BadMessage(
            f"a {message.get('op', 'reply')!r} message of {len(data)} bytes is over the {MAX_MESSAGE}-byte limit"
        )
    return data


@overload
def int_field(
    message: Message, key: str, *, lo: int = 0, hi: int = 1 << 62, optional: Literal[False] = False
) -> int: ...
@overload
def int_field(message: Message, key: str, *, lo: int = 0, hi: int = 1 << 62, optional: bool) -> int | None: ...
def int_field(message: Message, key: str, *, lo: int = 0, hi: int = 1 << 62, optional: bool = False) -> int | None:
    """An integer field of a received message, range-checked (bools are not integers here)."""
    value = message.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadMessage(f"field {key!r} must be an integer in [{lo}, {hi}], not {value!r}")
    return value


def int_list(value: object, what: str, limit: int) -> list[int]:
    if not isinstance(value, list) or len(value) > limit:
        raise BadMessage(f"{what} must be a list of at most {limit} integers")
    for x in value:
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise BadMessage(f"{what} must hold non-negative integers, not {x!r}")
    return value
