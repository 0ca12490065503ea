"""Coordination messages over real peer connections: the sender's address, refusals, pooling, timeouts."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

from tests.helpers import free_port
from tierfs.coordination.transport import Refused, Unreachable
from tierfs.peers.client import PeerClient
from tierfs.peers.messages import STARTING, PeerTransport
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve

JOB = "coord"
SECRET = b"a-secret-of-the-job-0123"
HOST = "127.0.0.2"  # the service; the senders are on 127.0.0.1 and 127.0.0.3
FAST = Timeouts(handshake=1.0, idle=5.0, request=5.0)


async def start_service(nursery: trio.Nursery, root: Path, messages) -> tuple[str, int]:
    root.mkdir(parents=True)
    store = ReplicaStore(root, SpaceAccount(None, root), None, job=JOB)
    store.load()
    port = await nursery.start(
        functools.partial(
            serve,
            (HOST, 0),
            job=JOB,
            secret=SECRET,
            store=store,
            timeouts=FAST,
            tls=None,
            info=lambda: {"rank": 0},
            messages=messages,
        )
    )
    return HOST, port


def transport(source_host: str = "127.0.0.3") -> PeerTransport:
    def connect(address, timeout):
        return PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=timeout, local_host=source_host)

    return PeerTransport(f"{source_host}:7000", connect)


async def test_a_message_reaches_the_handler_with_the_senders_listen_address(nursery, tmp_path):
    seen = []

    async def handle(source, message):
        seen.append((source, message["op"], message.get("n")))
        return {"ok": True, "echo": message.get("n")}

    host, port = await start_service(nursery, tmp_path / "s", handle)
    t = transport()
    for n in range(3):
        assert (await t.request(f"{host}:{port}", {"op": "coord_report", "n": n}, 2.0))["echo"] == n
    assert seen == [("127.0.0.3:7000", "coord_report", n) for n in range(3)]
    assert len(t._pools[f"{host}:{port}"]) == 1, "one pooled connection carried all three"
    await t.aclose()


async def test_a_sender_naming_an_address_on_another_host_is_refused(nursery, tmp_path):
    called = []

    async def handle(source, message):
        called.append(source)
        return {"ok": True}

    host, port = await start_service(nursery, tmp_path / "s", handle)
    async with await PeerClient.connect((host, port), job=JOB, secret=SECRET, tls=None, local_host="127.0.0.3") as c:
        reply = await c.call({"op": "coord_pull", "from": "10.1.2.3:7000"}, 2.0)
        assert "must name its sender's address on that host" in reply["error"]
        reply = await c.call({"op": "coord_pull"}, 2.0)
        assert "error" in reply
        assert (await c.call({"op": "coord_pull", "from": "127.0.0.3:9"}, 2.0)) == {"ok": True}, (
            "the connection stayed in step after the refusals"
        )
    assert called == ["127.0.0.3:9"]


async def test_a_node_without_coordination_refuses_in_words(nursery, tmp_path):
    host, port = await start_service(nursery, tmp_path / "s", None)
    reply = await transport().request(f"{host}:{port}", {"op": "coord_decide"}, 2.0)
    assert reply == {"error": "this node takes no coordination requests"}


async def test_a_starting_node_and_a_closed_port_are_refused_not_unreachable(nursery, tmp_path):
    async def starting(source, message):
        return {"error": STARTING}

    host, port = await start_service(nursery, tmp_path / "s", starting)
    with pytest.raises(Refused):
        await transport().request(f"{host}:{port}", {"op": "coord_report"}, 2.0)
    with pytest.raises(Refused):
        await transport().request(f"127.0.0.4:{free_port('127.0.0.4')}", {"op": "coord_report"}, 2.0)


async def test_an_answer_that_does_not_come_in_time_is_unreachable_and_the_connection_dropped(nursery, tmp_path):
    async def slow(source, message):
        await trio.sleep(3)
        return {"ok": True}

    host, port = await start_service(nursery, tmp_path / "s", slow)
    t = transport()
    with trio.fail_after(2):
        with pytest.raises(Unreachable) as e:
            await t.request(f"{host}:{port}", {"op": "await_chunk"}, 0.3)
    assert "0.3s" in str(e.value)
    assert not t._pools[f"{host}:{port}"], "a connection out of step is not pooled"


async def test_a_malformed_message_is_refused_and_the_service_goes_on(nursery, tmp_path):
    async def strict(source, message):
        raise ValueError("rank must be an integer")

    host, port = await start_service(nursery, tmp_path / "s", strict)
    t = transport()
    reply = await t.request(f"{host}:{port}", {"op": "coord_decide", "rank": "x"}, 2.0)
    assert reply == {"error": "malformed coord_decide: rank must be an integer"}
    assert (await t.request(f"{host}:{port}", {"op": "coord_decide"}, 2.0))["error"].startswith("malformed")
