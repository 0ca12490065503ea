"""Every tier, real, behind one fixture: the conformance suite runs once per tier.

- ``local``: this node's RAM tier, a replica store on a tmpfs directory;
- ``disk``: the ``--disk`` tier on a directory of the test's own;
- ``peer``: the real peer service on a loopback address (TLS keyed from the secret, as
  nodes run it), reached through the peer tier;
- ``gcs``: the GCS emulator, one fresh bucket.

Each comes with a way to damage the copy it holds of a chunk, as a failing disk, a hostile
peer or someone with write access to the bucket would.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tierfs.config import Config
from tierfs.core import chunks
from tierfs.peers import tls
from tierfs.peers.network import PeerNetwork
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve
from tierfs.tiers.base import Tier

JOB = "conform"
SECRET = b"the-conformance-secret-0123"
KINDS = ["local", "disk", "peer", "gcs"]


@dataclass
class Subject:
    """A tier under test, and how to damage its copy of a chunk (``damage(h, bytes)``)."""

    tier: Tier
    damage: Callable[[str, bytes], None]


def _damage_file(root: Path, h: str, data: bytes) -> None:
    path = root / "chunks" / h[:2] / h
    with open(path, "r+b") as f:
        f.write(data)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def where(kind, request, shm_dir, tmp_path) -> dict:
    """What the tier of ``kind`` stands on: a directory, or a bucket."""
    if kind == "gcs":
        return {"bucket": request.getfixturevalue("gcs_bucket")}
    return {"dir": shm_dir("tierfs-tier") if kind in ("local", "peer") else tmp_path / "disk"}


@pytest.fixture
async def subject(kind, where, nursery) -> Subject:
    if kind == "local":
        from tierfs.tiers.local import LocalTier

        root = where["dir"] / "replicas"
        store = ReplicaStore(root, SpaceAccount(None, where["dir"]), job=JOB)
        store.load()
        return Subject(LocalTier(store), functools.partial(_damage_file, root))
    if kind == "disk":
        from tierfs.tiers.disk import DiskTier

        tier = DiskTier(where["dir"], JOB, 0)
        tier.open()
        return Subject(tier, functools.partial(_damage_file, tier.root))
    if kind == "peer":
        root = where["dir"] / "replicas"
        store = ReplicaStore(root, SpaceAccount(None, where["dir"]), job=JOB)
        store.load()
        tier = await peer_tier(nursery, "127.0.0.9", store)
        return Subject(tier, functools.partial(_damage_file, root))
    from tierfs.tiers.gcs import GcsTier

    tier = GcsTier(f"gs://{where['bucket']}/p", JOB)

    def damage(h: str, data: bytes) -> None:
        # A valid frame of other bytes under the chunk's name: decodes fine, hashes wrong.
        tier.store.client.bucket(where["bucket"]).blob(tier.store._chunk_name(h)).upload_from_string(chunks.RAW + data)

    return Subject(tier, damage)


async def peer_tier(nursery, host: str, store: ReplicaStore, port: int | None = None):
    """A peer tier reaching a real peer service of the loaded ``store`` on ``host``
    (none listening if ``port`` is given)."""
    from tierfs.tiers.peer import PeerTier

    if port is None:
        port = await nursery.start(
            functools.partial(
                serve,
                (host, 0),
                job=JOB,
                secret=SECRET,
                store=store,
                tls=tls.from_secret(JOB, SECRET),
                timeouts=Timeouts(handshake=2, idle=5, request=5),
                info=lambda: {"rank": 1, "steps": [], "topology": []},
            )
        )
    cfg = Config.build(
        mountpoint="/nonexistent", job=JOB, rank=0, nodes=3, secret=SECRET.decode(), peers=f"{host}:{port}"
    )
    return PeerTier(PeerNetwork(cfg, timeout=5), (host, port))


@pytest.fixture
def files(tmp_path) -> Callable[[bytes], Path]:
    """Factory: a local file holding ``data`` (the snapshot a step's chunks are read from)."""
    made = []

    def make(data: bytes) -> Path:
        path = tmp_path / f"src-{len(made)}"
        path.write_bytes(data)
        made.append(path)
        return path

    yield make
    for p in made:
        if p.exists():
            os.unlink(p)
