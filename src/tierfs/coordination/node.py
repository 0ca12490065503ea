"""One node's coordination as the peer service hosts it: the member and coordinator sides behind one handler.

The two sides are separate objects (:mod:`.member`, :mod:`.coordinator`) because a node
is always a member and only sometimes a coordinator; they meet here, where the member
answers a coordinator's pulls, asks its own node's coordinator without a message, and
the coordinator reads this node's holdings as they are in every round.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

from tierfs.coordination.coordinator import DOWN_AFTER, PULL_AFTER, Coordinator
from tierfs.coordination.member import SUSPECT_FOR, Member
from tierfs.coordination.protocol import INTERVAL, RPC_TIMEOUT, Clock, K
from tierfs.coordination.transport import Message, Transport
from tierfs.coordination.view import Holdings


class Coordination:
    """A node's member and coordinator sides together, behind one handler for the peer service."""

    def __init__(
        self,
        address: str,
        order: Sequence[str],
        transport: Transport,
        holdings: Callable[[], Holdings],
        *,
        nodes: int,
        list_gcs: Callable[[], Awaitable[dict[int, list[int]]]] | None = None,
        interval: float = INTERVAL,
        k: int = K,
        rpc_timeout: float = RPC_TIMEOUT,
        pull_after: float = PULL_AFTER,
        down_after: int = DOWN_AFTER,
        suspect_for: float = SUSPECT_FOR,
        clock: Clock = trio.current_time,
        inc: int | None = None,
        members: frozenset[str] | None = None,
    ):
        """``order``: :func:`~tierfs.coordination.protocol.candidates` of the job's members (this node included)."""
        self.interval = interval
        self.coordinator = Coordinator(
            address,
            order,
            transport,
            nodes=nodes,
            list_gcs=list_gcs,
            interval=interval,
            rpc_timeout=rpc_timeout,
            k=k,
            pull_after=pull_after,
            down_after=down_after,
            clock=clock,
            members=members,
        )
        self.member = Member(
            address,
            order,
            transport,
            holdings,
            k=k,
            rpc_timeout=rpc_timeout,
            suspect_for=suspect_for,
            local=self.coordinator,
            clock=clock,
            inc=inc,
        )
        self.coordinator.own = self.member.report_now

    OPS = ("coord_report", "coord_decide", "coord_pull")

    def set_order(self, order: Sequence[str]) -> None:
        """The job's members changed (a DNS name found more nodes): ``candidates`` of the new set."""
        c = self.coordinator
        c.order, c.members, c._leading, c._index = order, frozenset(order), frozenset(order[: 4 * c.k]), None
        self.member.order = order

    async def handle(self, source: str, message: Message) -> Message:
        if message.get("op") == "coord_pull":
            return await self.member.handle_pull(source, message)
        return await self.coordinator.handle(source, message)

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.coordinator.run)
            await nursery.start(self.member.run, self.interval)
            task_status.started()
