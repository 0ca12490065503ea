"""A rollback in GCS, against the emulator: the abandoned steps set aside (kept, with their chunks, but
counted by no listing) until discarded, and the one record of when the job went back."""

from __future__ import annotations

import json
import secrets
import time

import pytest
import trio

from tests.gcs.test_gcs_store import chunks_in, h, manifest, raw_client
from tierfs.core.keys import bucket_seals, manifest_keys
from tierfs.core.manifest import authenticate, seal
from tierfs.tiers.base import TierError
from tierfs.tiers.gcs import GcsTier
from tierfs.tiers.gcs_http import CorruptObject, GcsError
from tierfs.tiers.gcs_layout import aside_base, aside_object, manifest_name, rollback_name, rollback_of
from tierfs.tiers.gcs_store import GcsStore

RANKS = (0, 1)
STEPS = (1, 2, 3, 4, 5)
SHARED = h(1)
BASE = "r/job1/"


def own(rank: int, step: int) -> str:
    """The chunk only (rank, step) uses."""
    return h(0x10000 + rank * 1000 + step)


def commit(store: GcsStore, rank: int, step: int) -> None:
    store.put_chunk(own(rank, step), f"{rank}/{step}".encode())
    store.put_manifest(rank, step, manifest(SHARED, own(rank, step)))


@pytest.fixture
def store(gcs_bucket: str) -> GcsStore:
    """Steps 1..5 committed for two ranks, each with a chunk of its own and a shared one."""
    store = GcsStore(f"gs://{gcs_bucket}/r", "job1")
    store.put_chunk(SHARED, b"shared")
    for rank in RANKS:
        for step in STEPS:
            commit(store, rank, step)
    return store


@pytest.fixture
def tier(store: GcsStore, gcs_bucket: str) -> GcsTier:
    return GcsTier(f"gs://{gcs_bucket}/r", "job1", store=store)


def committed_by(store: GcsStore) -> float:
    """A ``before`` right after every step so far (GCS's clock), and a later commit strictly after it."""
    before = max(store.list_manifests().created.values())
    time.sleep(0.01)
    return before


# -- names ---------------------------------------------------------------------------------------


def test_names_are_built_and_parsed_exactly():
    under = aside_base(BASE, 3)
    assert manifest_name(under, 1, 4, "json") == "r/job1/aside/to-000000000003/manifests/rank-1/step-000000000004.json"
    assert aside_object(BASE, manifest_name(under, 1, 4, "json")) == (3, 1, 4)
    assert rollback_name(BASE, 3) == "r/job1/rollbacks/to-000000000003.json"
    assert rollback_of(BASE, rollback_name(BASE, 3)) == 3
    for planted in [
        "r/job1/aside/to-3/manifests/rank-1/step-000000000004.json",
        "r/job1/aside/to-0000000000003/manifests/rank-1/step-000000000004.json",
        "r/job1/aside/to-000000000003/manifests/rank-01/step-000000000004.json",
        "r/job1/aside/to-000000000003/manifests/rank-1/step-000000000004.pending",
        "r/job1/aside/to-000000000003/rank-1/step-000000000004.json",
        "x/job1/aside/to-000000000003/manifests/rank-1/step-000000000004.json",
    ]:
        assert aside_object(BASE, planted) is None, planted
    for planted in [
        "r/job1/rollbacks/to-3.json",
        "r/job1/rollbacks/to-000000000003.json.bak",
        "r/job1/rollbacks/to-+00000000003.json",
    ]:
        assert rollback_of(BASE, planted) is None, planted


# -- setting aside -----------------------------------------------------------------------------


async def test_set_aside_moves_exactly_the_newer_steps_committed_before(store, tier):
    before = committed_by(store)
    for rank in RANKS:
        commit(store, rank, 6)  # the new timeline's, already: after `before`, so it stays
    assert await tier.set_aside(None, 3, before) == [(r, s) for r in RANKS for s in (4, 5)]
    assert store.list_manifests() == {0: [1, 2, 3, 6], 1: [1, 2, 3, 6]}
    assert await tier.list_manifests() == [(r, s) for r in RANKS for s in (1, 2, 3, 6)]
    assert store.list_aside() == {3: {0: [4, 5], 1: [4, 5]}}
    assert store.get_aside(3, 1, 5) == manifest(SHARED, own(1, 5))
    assert all(t is not None for t in store.list_aside()[3].created.values())


async def test_set_aside_of_one_rank_leaves_the_others(store, tier):
    assert await tier.set_aside(1, 2, time.time() + 3600) == [(1, 3), (1, 4), (1, 5)]
    assert store.list_manifests() == {0: list(STEPS), 1: [1, 2]}
    assert store.list_aside() == {2: {1: [3, 4, 5]}}


async def test_set_aside_is_idempotent(store, tier):
    before = committed_by(store)
    assert store.set_aside(0, 5, 3) is True
    assert store.set_aside(0, 5, 3) is True, "the original gone, its copy there: nothing to do"
    # Interrupted between the copy and the delete: the copy is the same bytes, so the move completes.
    store._upload(store._aside_name(3, 0, 4), store._download(store._manifest_name(0, 4, "json"), 1 << 20))
    assert await tier.set_aside(0, 3, before) == [(0, 4)]
    assert await tier.set_aside(0, 3, before) == []
    assert store.list_manifests()[0] == [1, 2, 3]
    assert store.list_aside() == {3: {0: [4, 5]}}
    assert store.set_aside(0, 9, 3) is False, "no such manifest: nothing to move"


async def test_an_earlier_rollbacks_different_copy_is_never_replaced(store, tier):
    assert store.set_aside(0, 5, 3) is True
    store.put_manifest(0, 5, manifest(SHARED))  # the new timeline's step 5, other bytes
    with pytest.raises(GcsError, match=r"to-000000000003/.*a different one lies there .*discard it first"):
        store.set_aside(0, 5, 3)
    with pytest.raises(TierError, match=r"^cannot set aside the steps after 3 in gs://.*discard it first$"):
        await tier.set_aside(0, 3, time.time() + 3600)
    assert store.get_aside(3, 0, 5) == manifest(SHARED, own(0, 5)), "the abandoned step is kept"
    assert store.list_manifests()[0] == [1, 2, 3, 5], "step 4 moved; step 5 stays until the copy is discarded"
    assert store.list_aside() == {3: {0: [4, 5]}}


# -- garbage collection -----------------------------------------------------------------------


async def test_gc_keeps_the_chunks_of_set_aside_manifests_until_they_are_discarded(store, tier):
    before = committed_by(store)
    for rank in RANKS:
        commit(store, rank, 6)
    await tier.set_aside(None, 3, before)

    result = store.collect_garbage(keep_newest=1, grace=0, nodes=2)
    assert store.list_manifests() == {0: [6], 1: [6]}
    assert store.list_aside() == {3: {0: [4, 5], 1: [4, 5]}}, "retention never deletes them"
    aside = {own(r, s) for r in RANKS for s in (4, 5)}
    assert chunks_in(store) == {SHARED} | aside | {own(r, 6) for r in RANKS}
    assert result["manifests_deleted"] == 6 and result["chunks_deleted"] == 6 and result["chunks_missing"] == 0

    assert store.discard_aside(3) == 4
    assert store.discard_aside() == 0
    assert store.list_aside() == {}
    result = store.collect_garbage(keep_newest=1, grace=0, nodes=2)
    assert chunks_in(store) == {SHARED} | {own(r, 6) for r in RANKS}
    assert result["manifests_deleted"] == 0 and result["chunks_deleted"] == 4


def test_discard_aside_of_one_rollback_leaves_the_others_and_foreign_names(store, gcs_bucket):
    store.set_aside(0, 5, 4)
    store.set_aside(0, 4, 3)
    planted = f"{aside_base('r/job1/', 3)}README"
    raw_client().bucket(gcs_bucket).blob(planted).upload_from_string(b"not a manifest")
    assert store.discard_aside(3) == 1
    assert store.list_aside() == {4: {0: [5]}}
    assert store.discard_aside() == 1
    assert planted in {b.name for b in raw_client().list_blobs(gcs_bucket, prefix="r/job1/aside/")}


# -- the record --------------------------------------------------------------------------------


async def test_a_rollback_is_recorded_once_and_its_time_read_back(store, tier, gcs_bucket):
    assert await tier.rollback_at(3) is None
    first = await tier.rollback_at(3, record=True)
    assert abs(first - time.time()) < 600
    await trio.sleep(0.01)
    assert store.record_rollback(3) == first, "the standing record's time, not a new one"
    assert store.rollback_time(3) == first and await tier.rollback_at(3) == first
    assert store.rollback_time(4) is None
    body = raw_client().bucket(gcs_bucket).blob(rollback_name("r/job1/", 3)).download_as_bytes()
    assert json.loads(body) == {"step": 3}


def test_a_record_holding_anything_else_is_corrupt(store, gcs_bucket):
    raw_client().bucket(gcs_bucket).blob(rollback_name("r/job1/", 3)).upload_from_string(b"x" * 100)
    with pytest.raises(CorruptObject, match=r"to-000000000003\.json is larger than"):
        store.rollback_time(3)
    raw_client().bucket(gcs_bucket).blob(rollback_name("r/job1/", 4)).upload_from_string(b'{"step": 5}')
    with pytest.raises(CorruptObject, match=r"to-000000000004\.json is not the record of the rollback to step 4"):
        store.record_rollback(4)


# -- sealed ------------------------------------------------------------------------------------


def test_sealed_manifests_survive_the_move_and_keep_their_chunks(gcs_bucket):
    secret = secrets.token_hex(32).encode()
    keys, seals = manifest_keys("job1", secret), bucket_seals("job1", secret)
    store = GcsStore(f"gs://{gcs_bucket}/r", "job1", keys=keys, seals=seals)
    chunk_seal = seals[0]

    def sealed(step: int) -> bytes:
        body = json.dumps(
            {"chunk_seal": chunk_seal.id, "entries": [{"path": "f", "kind": "file", "chunks": [own(0, step)]}]},
            separators=(",", ":"),
        ).encode()
        return seal(body, keys, 0, step)

    for step in (1, 2, 3):
        store.put_chunk(own(0, step), store.body(own(0, step), b"frame"))
        store.put_manifest(0, step, sealed(step))
    stored = raw_client().bucket(gcs_bucket).blob(manifest_name(BASE, 0, 3, "json")).download_as_bytes()
    assert store.set_aside(0, 3, 2) is True
    copied = raw_client().bucket(gcs_bucket).blob(manifest_name(aside_base(BASE, 2), 0, 3, "json"))
    assert copied.download_as_bytes() == stored, "byte for byte, still sealed"
    assert authenticate(store.get_aside(2, 0, 3), keys, 0, 3) == authenticate(sealed(3), keys, 0, 3)
    # With keys, an aside copy counts only if its seal verifies: a planted one is ignored.
    raw_client().bucket(gcs_bucket).blob(manifest_name(aside_base(BASE, 2), 0, 9, "json")).upload_from_string(
        json.dumps({"entries": []}).encode()
    )
    assert store.list_aside() == {2: {0: [3]}}

    store.collect_garbage(keep_newest=1, grace=0)
    assert store.list_manifests() == {0: [2]}
    assert chunks_in(store) == {chunk_seal.object_key(own(0, s)) for s in (2, 3)}
