"""The multi-node harness as a fixture: real daemons on 127.0.0.2, 127.0.0.3, ..."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from tierfs_testing.cluster import LocalCluster


@pytest.fixture
def cluster():
    """Factory: ``cluster(nodes, **mount options)``; every node is stopped and removed afterwards."""
    made: list[LocalCluster] = []

    def make(nodes: int, job: str = "job", **options) -> LocalCluster:
        c = LocalCluster(Path("/dev/shm") / f"tierfs-cluster-{uuid.uuid4().hex[:10]}", nodes, job, **options)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
