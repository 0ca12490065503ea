"""A small job on the simulated network, for the coordination tests, and coordinators that answer as told.

Every node of a :class:`Cluster` runs the real :class:`~tierfs.coordination.node.Coordination`
behind a :class:`~tierfs_testing.sim.SimNetwork`; what it holds is set by the test. Run it
on trio's MockClock (the ``autojump_clock`` fixture) so seconds of protocol pass at once.

:class:`StandInCoordinators` answer a restarting node's questions with what the test
says, for the checks a node makes of an answer (:class:`tierfs.pipeline.planning.RestorePlanner`):
a stale or hostile answer is a fault the real coordinators do not produce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio
from tierfs_testing.sim import GcsModel, NetModel, SimGcs, SimNetwork

from tierfs.coordination.gcs_listing import list_sharded, listing_prefixes
from tierfs.coordination.node import Coordination
from tierfs.coordination.protocol import candidates
from tierfs.coordination.view import Holdings, HoldingsView
from tierfs.pipeline.survey import Survey

JOB = "test"


class Cluster:
    def __init__(
        self,
        n: int,
        held: dict[int, Holdings] | None = None,
        gcs: dict[int, list[int]] | None = None,
        k: int = 3,
        interval: float = 30.0,
        model: NetModel | None = None,
        gcs_model: GcsModel | None = None,
    ):
        self.n, self.k, self.interval = n, k, interval
        self.net = SimNetwork(model or NetModel(), seed=1)
        self.gcs = None if gcs is None else SimGcs(self.net, gcs_model or GcsModel(), gcs)
        self.gcs_listing = gcs
        self.addresses = [f"10.0.{r // 256}.{r % 256}:7070" for r in range(n)]
        self.order = candidates(JOB, self.addresses)
        self.members = frozenset(self.order)
        self.held = {r: (held or {}).get(r, Holdings(r)) for r in range(n)}
        self.nodes: dict[int, Coordination] = {}
        self.starts = 0
        for r in range(n):
            self.make(r)

    def make(self, rank: int) -> Coordination:
        """A fresh daemon for ``rank`` (a restart: new incarnation, nothing remembered)."""
        address = self.addresses[rank]
        self.starts += 1
        list_gcs = None
        if self.gcs is not None:
            prefixes = listing_prefixes(self.n)
            list_gcs = lambda: list_sharded(self.gcs.list_prefix, prefixes)  # noqa: E731
        node = Coordination(
            address,
            self.order,
            self.net.transport(address),
            lambda: self.held[rank],
            nodes=self.n,
            list_gcs=list_gcs,
            interval=self.interval,
            k=self.k,
            members=self.members,
            inc=self.starts,
        )
        self.nodes[rank] = node
        self.net.listen(address, node.handle)
        return node

    def rank_of(self, address: str) -> int:
        return self.addresses.index(address)

    def coordinator(self, i: int) -> int:
        """The rank of the ``i``-th coordinator candidate."""
        return self.rank_of(self.order[i])

    async def start(self, nursery: trio.Nursery, ranks=None) -> None:
        for r in range(self.n) if ranks is None else ranks:
            await nursery.start(self.run, r)

    async def run(self, rank: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        host = self.net.hosts[self.addresses[rank]]
        host.down = None
        with trio.CancelScope() as host.scope:
            await self.nodes[rank].run(task_status=task_status)
            await trio.sleep_forever()

    def kill(self, rank: int, how: str = "timeout") -> None:
        self.net.down(self.addresses[rank], how)

    def truth(self, live=None) -> HoldingsView:
        view = HoldingsView(self.n)
        for r in range(self.n) if live is None else live:
            view.put_holdings(self.addresses[r], self.held[r])
        if self.gcs_listing is not None:
            view.put_listing(self.gcs_listing)
        return view


@dataclass
class Answer:
    coordinator: str
    step: int | None
    summary: dict = field(default_factory=dict)


class StandInCoordinators:
    """Answers in turn, and records which coordinators each question excluded.

    ``given``: the first answer was already given (the one the check under test is
    about), so questions get the answers after it; then None, as when no coordinator is left.
    """

    def __init__(self, *answers: Answer, given: bool = False):
        self.answers, self.asked = list(answers), []
        self._next = 0
        if given:
            self.decision, self._next = self.answers[0], 1

    async def decide(self, exclude=()) -> tuple[Survey, int | None] | None:
        self.asked.append(tuple(exclude))
        if self._next >= len(self.answers):
            return None
        self.decision = self.answers[self._next]
        self._next += 1
        return Survey(), self.decision.step
