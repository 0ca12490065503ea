"""Milestones in GCS, against the emulator: kept beyond --keep with every chunk they use, until --keep-for."""

from __future__ import annotations

import time

import pytest

from tests.gcs.test_gcs_store import chunks_in, h, manifest
from tierfs.config import Config
from tierfs.core.milestones import Milestones
from tierfs.pipeline.policy import BackupPolicy
from tierfs.tiers.gcs import GcsTier
from tierfs.tiers.gcs_store import GcsStore

STEPS = range(100, 1000, 100)
RANKS = (0, 1)
SHARED = h(1)  # in every step: dedup keeps one object for all of them


def own(rank: int, step: int) -> str:
    """The chunk only (rank, step) uses."""
    return h(0x10000 + rank * 1000 + step)


def chunks_of(steps) -> set[str]:
    return {SHARED} | {own(rank, step) for rank in RANKS for step in steps}


@pytest.fixture
def store(gcs_bucket: str) -> GcsStore:
    """Steps 100..900 committed for two ranks, each with a chunk of its own and the shared one."""
    store = GcsStore(f"gs://{gcs_bucket}/m", "job1")
    store.put_chunk(SHARED, b"shared")
    for rank in RANKS:
        for step in STEPS:
            store.put_chunk(own(rank, step), f"{rank}/{step}".encode())
            store.put_manifest(rank, step, manifest(SHARED, own(rank, step)))
    return store


async def test_retention_keeps_milestones_besides_the_newest_with_their_chunks(store, gcs_bucket):
    """Through the backup lane's policy, as the daemon's rank 0 runs it: the flags reach the collector."""
    tier = GcsTier(f"gs://{gcs_bucket}/m", "job1", store=store)
    cfg = Config.build(mountpoint="/nonexistent", job="job1", rank=0, nodes=2, keep=2, keep_every=300, gc_grace="0s")
    await BackupPolicy(cfg).retain(tier)

    assert store.list_manifests() == {0: [300, 600, 800, 900], 1: [300, 600, 800, 900]}
    assert chunks_in(store) == chunks_of([300, 600, 800, 900])


def test_a_milestone_goes_once_keep_for_has_passed_since_its_upload(store):
    milestones = Milestones(300, keep_for=3600)
    result = store.collect_garbage(keep_newest=2, grace=0, nodes=2, milestones=milestones)
    assert store.list_manifests() == {0: [300, 600, 800, 900], 1: [300, 600, 800, 900]}
    assert result["manifests_deleted"] == 10 and result["chunks_missing"] == 0

    # Two hours on, by the manifests' creation times in GCS: 300 and 600 are ordinary old steps.
    result = store.collect_garbage(keep_newest=2, grace=0, nodes=2, milestones=milestones, now=time.time() + 7200)
    assert store.list_manifests() == {0: [800, 900], 1: [800, 900]}
    assert chunks_in(store) == chunks_of([800, 900])
    assert result["manifests_deleted"] == 4 and result["chunks_deleted"] == 4


def test_the_listing_says_when_each_manifest_was_created(store):
    listing = store.list_manifests()
    created = [listing.created[(rank, step)] for rank in RANKS for step in STEPS]
    assert all(c is not None and abs(c - time.time()) < 600 for c in created), created
