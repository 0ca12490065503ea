"""A simulated network and GCS for running the real coordination and restore code at scale.

Everything runs in one trio run on a :class:`trio.testing.MockClock` with ``autojump``:
time stands still while any task can run and jumps to the next deadline when none can,
so 10,000 nodes' seconds of work pass in minutes of CPU and the times measured are the
ones the model gives, not those of this machine.

The model, kept simple and stated (:class:`NetModel`, :class:`GcsModel`):

- a message takes a one-way latency (plus jitter) each way and may be lost (``loss``);
- a node handles messages one at a time, ``service`` seconds of CPU each: a coordinator
  that receives 10,000 reports at once works through them in turn;
- a body (``"len"`` in an answer: a chunk) also waits for the sender's NIC and the
  receiver's NIC, each a FIFO at ``bandwidth`` bytes/s;
- a node that is down never answers: its requests time out (``refused`` nodes answer a
  refusal after one round trip instead, like a host whose daemon is gone);
- GCS: a read costs a first-byte latency and runs at a per-stream bandwidth, through the
  reading node's NIC and through the bucket's total bandwidth (a FIFO shared by every
  reader: what the job's project may read at once); a listing costs one request per page
  of 1000 objects. ``slow`` multiplies latencies and divides bandwidths;
- GCS writes (a backup): a conditional create whose body always goes out, through the
  writer's NIC at the per-stream bandwidth and through the bucket's total ingest (a FIFO
  like the reads'); the object exists once its body is in, and a create of a name that
  exists by then fails after sending the body, as GCS's ``ifGenerationMatch=0`` does. A
  metadata request (does the object exist) costs the first-byte latency and no body.
  Every byte up and down and every request is counted, so a backup's cost per unique
  byte is measured, not assumed.

Every message is encoded (:func:`tierfs.coordination.transport.encoded`), so the size cap
holds here as on the wire, and counted, per sender and per op.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import trio

from tierfs.coordination.transport import Handler, Message, Refused, Unreachable, encoded


@dataclass
class NetModel:
    latency: float = 0.00025  # one way, seconds
    jitter: float = 0.0001  # uniform extra, one way
    loss: float = 0.0  # probability that a request or its answer is lost
    service: float = 0.00005  # seconds of a node's CPU per message it handles
    bandwidth: float = 3.125e9  # bytes/s of each node's NIC (25 Gb/s), each way
    grid: float = 50e-6  # every event happens on this grid: events close in time wake together


@dataclass
class GcsModel:
    first_byte: float = 0.05  # seconds to the first byte of a read
    stream: float = 100e6  # bytes/s of one read
    total: float = 25e9  # bytes/s the bucket serves to everyone at once (the project's egress quota)
    ingest: float = 25e9  # bytes/s the bucket accepts from everyone at once (writes)
    page: float = 0.1  # seconds per listing page
    page_objects: int = 1000
    slow: float = 1.0  # a slow GCS: latencies times this, bandwidth divided by it


@dataclass
class _Host:
    handler: Handler
    down: str | None = None  # None, "timeout" or "refused"
    busy: float = 0.0  # when its CPU is free for the next message
    nic_out: float = 0.0  # when its NIC is free to send the next body
    nic_in: float = 0.0
    scope: trio.CancelScope | None = None  # cancelled when the node goes down


@dataclass
class Stats:
    requests: Counter = field(default_factory=Counter)  # op -> requests
    request_bytes: Counter = field(default_factory=Counter)
    answers: Counter = field(default_factory=Counter)
    answer_bytes: Counter = field(default_factory=Counter)
    body_bytes: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)  # address -> requests it sent
    received: Counter = field(default_factory=Counter)  # address -> requests it received
    lost: int = 0
    timeouts: Counter = field(default_factory=Counter)  # op -> requests that got no answer in time

    def messages(self, ops: Iterable[str] | None = None) -> int:
        keys = self.requests.keys() if ops is None else ops
        return sum(self.requests[k] + self.answers[k] for k in keys)

    def reset(self) -> None:
        self.__init__()


class Timers:
    """Tasks asleep until a time, woken by one driver task.

    ``trio.sleep_until`` costs a cancel scope per call; a message here sleeps two or three
    times, so at 10,000 nodes that machinery was most of the simulation's CPU. A parked
    task is woken in time order by :meth:`run`, which itself sleeps until the earliest
    wake-up (the deadline the MockClock jumps to). Cancelling a sleeper (a timeout, its
    node going down) takes it off the heap.
    """

    def __init__(self):
        self._heap: list[list] = []
        self._seq = 0
        self._scope: trio.CancelScope | None = None

    async def sleep_until(self, t: float) -> None:
        entry = [t, self._seq, trio.lowlevel.current_task(), True]
        self._seq += 1
        heapq.heappush(self._heap, entry)
        if self._scope is None:
            raise RuntimeError("SimNetwork.run is not running: start it in the simulation's nursery")
        if t < self._scope.deadline:
            self._scope.deadline = t

        def abort(_raise_cancel) -> trio.lowlevel.Abort:
            entry[3] = False
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        heap = self._heap
        self._scope = trio.CancelScope()
        task_status.started()
        try:
            while True:
                now = trio.current_time()
                while heap and heap[0][0] <= now:
                    _, _, task, live = heapq.heappop(heap)
                    if live:
                        trio.lowlevel.reschedule(task)
                self._scope = trio.CancelScope(deadline=heap[0][0] if heap else math.inf)
                with self._scope:
                    await trio.sleep_forever()
        finally:
            self._scope = None


class SimNetwork:
    """Nodes by address, each with a handler; :meth:`transport` gives one node's way out.

    :meth:`run` must run (in the simulation's nursery) while anything uses the network.
    """

    def __init__(self, model: NetModel | None = None, seed: int = 0):
        self.model = model or NetModel()
        self.rng = random.Random(seed)
        self.hosts: dict[str, _Host] = {}
        self.stats = Stats()
        self.timers = Timers()

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        await self.timers.run(task_status=task_status)

    def listen(self, address: str, handler: Handler) -> None:
        self.hosts[address] = _Host(handler)

    def transport(self, address: str) -> SimTransport:
        return SimTransport(self, address)

    def is_up(self, address: str) -> bool:
        host = self.hosts.get(address)
        return host is not None and host.down is None

    def down(self, address: str, how: str = "timeout") -> None:
        """Take a node off the network: its tasks stop, messages to it are never answered."""
        host = self.hosts[address]
        host.down = how
        if host.scope is not None:
            host.scope.cancel()

    def up(self, address: str, handler: Handler | None = None) -> None:
        host = self.hosts[address]
        host.down = None
        if handler is not None:
            host.handler = handler

    def at(self, t: float) -> float:
        """``t`` rounded up to the time grid (fewer distinct wake-ups for the scheduler)."""
        g = self.model.grid
        return math.ceil(t / g) * g if g else t

    async def sleep_until(self, t: float) -> None:
        await self.timers.sleep_until(self.at(t))

    def _latency(self) -> float:
        m = self.model
        return m.latency + m.jitter * self.rng.random()

    def _lost(self) -> bool:
        if self.model.loss and self.rng.random() < self.model.loss:
            self.stats.lost += 1
            return True
        return False

    async def _deliver(self, source: str, address: str, message: Message) -> Message:
        host = self.hosts.get(address)
        if host is None or host.down == "refused":
            await self.sleep_until(trio.current_time() + 2 * self._latency())
            raise Refused(f"{address} refused the connection")
        if host.down or self._lost():
            await trio.sleep_forever()
        now = trio.current_time()
        start = max(now + self._latency(), host.busy)
        host.busy = start + self.model.service
        await self.sleep_until(host.busy)
        if host.down:
            await trio.sleep_forever()
        self.stats.received[address] += 1
        answer = await host.handler(source, message)
        if host.down:
            await trio.sleep_forever()
        op = message.get("op", "?")
        self.stats.answers[op] += 1
        self.stats.answer_bytes[op] += len(encoded(answer))
        body = answer.get("len") if "ok" in answer else None
        if body:
            self.stats.body_bytes[op] += body
            await self.sleep_until(self._carry(address, source, body))
        if self._lost():
            await trio.sleep_forever()
        await self.sleep_until(trio.current_time() + self._latency())
        return answer

    def _carry(self, sender: str, receiver: str, n: int) -> float:
        """When ``n`` bytes sent now from ``sender`` have fully arrived at ``receiver``."""
        bw = self.model.bandwidth
        out, into = self.hosts[sender], self.hosts[receiver]
        start = max(trio.current_time(), out.nic_out)
        out.nic_out = start + n / bw
        into.nic_in = max(start, into.nic_in) + n / bw
        return max(out.nic_out, into.nic_in)

    def nic_in(self, receiver: str, n: int, rate: float) -> float:
        """When ``n`` bytes arriving at ``rate`` from outside (GCS) are in, through ``receiver``'s NIC."""
        host = self.hosts[receiver]
        now = trio.current_time()
        host.nic_in = max(now, host.nic_in) + n / self.model.bandwidth
        return max(host.nic_in, now + n / rate)

    def nic_out(self, sender: str, n: int, rate: float) -> float:
        """When ``n`` bytes sent now at ``rate`` to outside (GCS) have left through ``sender``'s NIC."""
        host = self.hosts[sender]
        now = trio.current_time()
        host.nic_out = max(now, host.nic_out) + n / self.model.bandwidth
        return max(host.nic_out, now + n / rate)


class SimTransport:
    """One node's requests over a :class:`SimNetwork` (the
    :class:`~tierfs.coordination.transport.Transport` protocol)."""

    def __init__(self, net: SimNetwork, address: str):
        self.net, self.address = net, address

    async def request(self, address: str, message: Message, timeout: float) -> Message:
        net = self.net
        op = message.get("op", "?")
        size = len(encoded(message))
        net.stats.requests[op] += 1
        net.stats.request_bytes[op] += size
        net.stats.sent[self.address] += 1
        with trio.move_on_after(timeout) as scope:
            return await net._deliver(self.address, address, message)
        if scope.cancelled_caught:
            net.stats.timeouts[op] += 1
        raise Unreachable(f"{address} did not answer {op} within {timeout:g}s")


class SimGcs:
    """The job's bucket: manifests to list, chunks to read and write; counts bytes and requests."""

    def __init__(self, net: SimNetwork, model: GcsModel | None = None, listing: dict[int, Iterable[int]] | None = None):
        self.net, self.model = net, model or GcsModel()
        self.bytes_read = 0
        self.reads = 0
        self.bytes_written = 0  # every body sent, also those of creates that failed
        self.writes = 0
        self.metadata_requests = 0
        self.list_requests = 0
        self.objects: set[str] = set()  # names whose body is in
        self.down = False
        self._free = 0.0  # when the bucket's bandwidth is free for the next read
        self._free_in = 0.0  # ... for the next write
        self.set_listing(listing or {})

    @property
    def requests(self) -> int:
        return self.reads + self.writes + self.metadata_requests + self.list_requests

    def set_listing(self, listing: dict[int, Iterable[int]]) -> None:
        self._names = sorted(f"rank-{r}/step-{s:012d}.json" for r, steps in listing.items() for s in steps)

    async def list_prefix(self, prefix: str = "") -> dict[int, list[int]]:
        """Manifests whose name (under manifests/) starts with ``prefix``, page by page."""
        if self.down:
            await trio.sleep(self.model.page * self.model.slow)
            raise OSError("GCS is unreachable")
        lo = bisect.bisect_left(self._names, prefix)
        hi = bisect.bisect_left(self._names, prefix + "\U0010ffff")
        pages = max(1, math.ceil((hi - lo) / self.model.page_objects))
        self.list_requests += pages
        await trio.sleep(pages * self.model.page * self.model.slow)
        out: dict[int, list[int]] = {}
        for name in self._names[lo:hi]:
            rank, step = name.split("/")
            out.setdefault(int(rank[5:]), []).append(int(step[5:17]))
        return out

    async def read(self, reader: str, h: str, length: int) -> int:
        m = self.model
        if self.down:
            await trio.sleep(m.first_byte * m.slow)
            raise OSError("GCS is unreachable")
        self.reads += 1
        self.bytes_read += length
        await self.net.sleep_until(trio.current_time() + m.first_byte * m.slow)
        now = trio.current_time()
        self._free = max(now, self._free) + length / (m.total / m.slow)
        await self.net.sleep_until(max(self._free, self.net.nic_in(reader, length, m.stream / m.slow)))
        return length

    async def exists(self, name: str) -> bool:
        """A metadata request: whether ``name``'s body is in (no body moves)."""
        m = self.model
        if self.down:
            await trio.sleep(m.first_byte * m.slow)
            raise OSError("GCS is unreachable")
        self.metadata_requests += 1
        await self.net.sleep_until(trio.current_time() + m.first_byte * m.slow)
        return name in self.objects

    async def delete(self, name: str) -> None:
        """A request without a body (a marker's delete)."""
        await self.exists(name)
        self.objects.discard(name)

    async def write(self, writer: str, name: str, length: int) -> bool:
        """Create ``name`` if absent; False if it existed when the body was in (the body went all the same)."""
        m = self.model
        if self.down:
            await trio.sleep(m.first_byte * m.slow)
            raise OSError("GCS is unreachable")
        self.writes += 1
        self.bytes_written += length
        await self.net.sleep_until(trio.current_time() + m.first_byte * m.slow)
        now = trio.current_time()
        self._free_in = max(now, self._free_in) + length / (m.ingest / m.slow)
        await self.net.sleep_until(max(self._free_in, self.net.nic_out(writer, length, m.stream / m.slow)))
        if name in self.objects:
            return False
        self.objects.add(name)
        return True
