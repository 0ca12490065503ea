"""Fixtures: real daemons on 127.0.0.2, 127.0.0.3, ... sharing one port (so that one brace
pattern names them all), and a tiny real DNS server on loopback."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import pytest
from tierfs_testing import free_port
from tierfs_testing.cluster import LocalCluster

from tests.discovery.dns_server import DnsServer


def common_port(hosts: list[str]) -> int:
    """A port free on every one of ``hosts`` right now."""
    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port is free on all of {hosts}")


@pytest.fixture
def cluster():
    """Factory: ``cluster(nodes, **mount options)``, every node on the same port; all stopped afterwards."""
    made: list[LocalCluster] = []

    def make(nodes: int, job: str = "job", **options) -> LocalCluster:
        c = LocalCluster(Path("/dev/shm") / f"tierfs-discovery-{uuid.uuid4().hex[:10]}", nodes, job, **options)
        made.append(c)
        port = common_port([n.host for n in c.nodes])
        for n in c.nodes:
            n.port = port
        c.port = port
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture
def dns_server():
    server = DnsServer()
    try:
        yield server
    finally:
        server.close()
