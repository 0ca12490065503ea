"""The GCS tier against a real GCS API server (fake-gcs-server on loopback)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from tierfs_testing.gcs_emulator import GcsEmulator

from tierfs.core.chunks import RAW, chunk_hash, encode
from tierfs.core.errors import UserError
from tierfs.core.parse import parse_gcs_url
from tierfs.tiers import gcs_http
from tierfs.tiers.gcs_http import CorruptObject, GcsUnavailable, MissingObject
from tierfs.tiers.gcs_store import Found, GcsStore, object_md5

MiB = 1 << 20


def h(n: int) -> str:
    """A valid, distinct chunk hash."""
    return f"{n:032x}"


def manifest(*hashes: str) -> bytes:
    """Just enough of a manifest for the collector: a file naming chunks, and a directory."""
    return json.dumps(
        {"entries": [{"path": "d", "kind": "dir"}, {"path": "d/f", "kind": "file", "chunks": list(hashes)}]}
    ).encode()


def raw_client() -> storage.Client:
    return storage.Client(credentials=AnonymousCredentials(), project="test")


@pytest.fixture
def store(gcs_bucket: str) -> GcsStore:
    return GcsStore(f"gs://{gcs_bucket}/some/prefix", "job1")


def chunks_in(store: GcsStore) -> set[str]:
    return {info.key for info in store.list_chunks()}


# -- URLs and the bucket -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("gs://bucket", ("bucket", "")),
        ("gs://bucket/", ("bucket", "")),
        ("gs://my-bucket_1/ckpt", ("my-bucket_1", "ckpt")),
        ("gs://b.example.com/a/b/", ("b.example.com", "a/b")),
    ],
)
def test_parse_gcs_url_splits_bucket_and_prefix(url, expected):
    assert parse_gcs_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/x",
        "bucket/x",
        "gs://",
        "gs:///x",
        "gs://Bucket",
        "gs://ab",
        "gs://-bucket",
        "gs://a..b",
        "gs://bucket//x",
        "gs://bucket/a\nb",
        "gs://bu cket",
    ],
)
def test_parse_gcs_url_rejects_malformed_urls_in_one_line(url):
    with pytest.raises(UserError) as info:
        parse_gcs_url(url)
    assert "\n" not in str(info.value) and repr(url) in str(info.value)


def test_check_accepts_existing_bucket(store):
    store.check()


def test_check_names_missing_bucket(gcs_emulator):
    store = GcsStore("gs://no-such-bucket-here/x", "job1")
    with pytest.raises(UserError, match=r"gs://no-such-bucket-here does not exist"):
        store.check()


def test_objects_follow_the_documented_layout(store, gcs_bucket):
    store.put_chunk(h(0xABC), b"frame")
    store.put_manifest(3, 42, manifest(h(0xABC)))
    store.put_pending(3, 43, [h(0xABC)])
    names = {b.name for b in raw_client().list_blobs(gcs_bucket)}
    assert names == {
        f"some/prefix/job1/chunks/00/{h(0xABC)}",
        "some/prefix/job1/manifests/rank-3/step-000000000042.json",
        "some/prefix/job1/manifests/rank-3/step-000000000043.pending",
    }
    assert store.url_of("x/y") == f"gs://{gcs_bucket}/x/y"


def test_empty_prefix_puts_the_job_at_the_bucket_root(gcs_bucket):
    GcsStore(f"gs://{gcs_bucket}", "job1").put_chunk(h(1), b"frame")
    assert [b.name for b in raw_client().list_blobs(gcs_bucket)] == [f"job1/chunks/00/{h(1)}"]


# -- chunks ------------------------------------------------------------------------------


def test_put_chunk_creates_once_and_keeps_the_first_content(store):
    assert store.put_chunk(h(1), b"first") is True
    assert store.put_chunk(h(1), b"second") is False
    assert store.get_chunk_frame(h(1)) == b"first"


def test_frame_larger_than_one_request_round_trips(store):
    frame = bytes(range(256)) * (9 << 12)  # 9 MiB: past the single-request upload limit
    assert store.put_chunk(h(1), frame)
    assert store.get_chunk_frame(h(1)) == frame


def test_touch_marks_an_existing_chunk_used_and_reports_a_missing_one(store):
    store.put_chunk(h(1), b"frame")
    before = time.time()
    assert store.touch_chunk(h(1)) is True
    assert store.touch_chunk(h(2)) is False
    (info,) = store.list_chunks()
    assert info.updated >= before


def spy(monkeypatch, store: GcsStore, name: str) -> list:
    """Record every call of one of the store's request methods (its object names)."""
    calls: list = []
    real = getattr(store, name)
    monkeypatch.setattr(store, name, lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    return calls


def test_an_object_holding_the_frame_is_proven_by_its_md5_without_a_download(store, gcs_bucket, monkeypatch):
    data = os.urandom(MiB)
    c, frame = chunk_hash(data), encode(data)
    assert GcsStore(f"gs://{gcs_bucket}/some/prefix", "job1").put_chunk(c, frame)  # a twin's upload
    downloads, uploads = spy(monkeypatch, store, "_download"), spy(monkeypatch, store, "_upload")
    assert store.touch(c) is Found.UNPROVEN, "touched, but this store never proved that content"
    assert store.find_chunk(c, object_md5(frame)) is Found.CHUNK
    assert store.put_chunk(c, frame) is False
    assert store.touch(c) is Found.CHUNK and store.touch_chunk(c)
    assert downloads == [] and uploads == [], "not a byte of the chunk moved"


def test_a_frame_another_encoder_made_is_downloaded_once_then_known(store, gcs_bucket, monkeypatch):
    data = bytes(MiB)  # compresses: this node's frame is zstd, the one in the bucket is raw
    c, frame = chunk_hash(data), encode(data)
    assert frame[:1] != RAW
    assert GcsStore(f"gs://{gcs_bucket}/some/prefix", "job1").put_chunk(c, RAW + data)
    downloads = spy(monkeypatch, store, "_download")
    assert store.find_chunk(c, object_md5(frame)) is Found.CHUNK
    assert store.put_chunk(c, frame) is False and store.touch_chunk(c)
    assert len(downloads) == 1


def test_a_planted_object_under_a_chunks_name_is_checked_once_and_replaced(store, gcs_bucket, monkeypatch):
    data = os.urandom(MiB)
    c, frame = chunk_hash(data), encode(data)
    name = f"some/prefix/job1/chunks/{c[:2]}/{c}"
    raw_client().bucket(gcs_bucket).blob(name).upload_from_string(RAW + os.urandom(MiB))
    downloads = spy(monkeypatch, store, "_download")
    assert store.touch(c) is Found.UNPROVEN and not downloads
    for _ in range(3):  # a twin waiting for the chunk looks again and again: one download in all
        assert store.find_chunk(c, object_md5(frame)) is Found.UNPROVEN
    assert len(downloads) == 1
    assert store.put_chunk(c, frame) is True, "replaced, not trusted"
    assert store.get_chunk_frame(c) == frame
    assert store.find_chunk(c, object_md5(frame)) is Found.CHUNK


def test_get_missing_chunk_names_its_url(store, gcs_bucket):
    with pytest.raises(MissingObject, match=f"gs://{gcs_bucket}/some/prefix/job1/chunks/00/{h(7)}"):
        store.get_chunk_frame(h(7))


def test_list_chunks_reports_size_and_skips_foreign_objects(store, gcs_bucket):
    store.put_chunk(h(1), b"x" * 10)
    store.put_chunk(h(0x1F << 120), b"y" * 20)
    bucket = raw_client().bucket(gcs_bucket)
    bucket.blob("some/prefix/job1/chunks/README").upload_from_string(b"not a chunk")
    bucket.blob(f"some/prefix/job1/chunks/ff/{h(3)}").upload_from_string(b"wrong shard")
    listed = {info.key: info for info in store.list_chunks()}
    assert {k: v.size for k, v in listed.items()} == {h(1): 10, h(0x1F << 120): 20}
    assert all(info.metageneration >= 1 and info.updated > 0 for info in listed.values())


def test_delete_chunk_reports_whether_it_deleted(store):
    store.put_chunk(h(1), b"frame")
    (info,) = store.list_chunks()
    assert store.delete_chunk(h(1), info.metageneration) is True
    assert store.delete_chunk(h(1), info.metageneration) is False
    assert chunks_in(store) == set()


def test_sixteen_threads_share_one_store_without_dropping_connections(store, caplog):
    with ThreadPoolExecutor(16) as pool:
        created = list(pool.map(lambda n: store.put_chunk(h(n), bytes([n]) * 1000), range(64)))
        frames = list(pool.map(lambda n: store.get_chunk_frame(h(n)), range(64)))
    assert all(created)
    assert frames == [bytes([n]) * 1000 for n in range(64)]
    assert "Connection pool is full" not in caplog.text


def test_chunk_names_must_be_hashes(store):
    with pytest.raises(ValueError):
        store.put_chunk("../../etc", b"frame")


# -- manifests and upload markers --------------------------------------------------------


def test_manifests_are_listed_per_rank_in_numeric_step_order(store, monkeypatch):
    monkeypatch.setattr(gcs_http, "LIST_PAGE", 2)  # several pages per listing
    for rank, step in [(0, 100), (0, 2), (0, 10), (1, 10), (12, 1)]:
        store.put_manifest(rank, step, f"{rank}:{step}".encode())
    store.put_pending(0, 101, [h(1)])  # an upload in progress is not a committed step

    assert store.list_steps(0) == [2, 10, 100]
    assert store.list_steps(1) == [10]
    assert store.list_steps(5) == []
    assert store.list_manifests() == {0: [2, 10, 100], 1: [10], 12: [1]}
    assert store.get_manifest(0, 10) == b"0:10"

    store.delete_manifest(0, 10)
    store.delete_manifest(0, 10)  # already gone: fine
    assert store.list_steps(0) == [2, 100]
    with pytest.raises(MissingObject, match="step-000000000010.json"):
        store.get_manifest(0, 10)


def test_pending_markers_are_listed_until_deleted(store):
    store.put_pending(0, 5, [h(1), h(2), h(1)])
    store.put_pending(3, 6, [])
    assert store.list_pending(max_age=60) == {(0, 5): {h(1), h(2)}, (3, 6): set()}
    store.delete_pending(0, 5)
    store.delete_pending(0, 5)
    assert store.list_pending(max_age=60) == {(3, 6): set()}


def test_stale_pending_markers_are_dropped_and_deleted(store):
    store.put_pending(0, 5, [h(1)])
    time.sleep(0.5)
    store.put_pending(1, 5, [h(2)])
    assert store.list_pending(max_age=0.4) == {(1, 5): {h(2)}}
    assert store.list_pending(max_age=60) == {(1, 5): {h(2)}}  # the stale one is gone


# -- garbage collection ------------------------------------------------------------------


def populate(store: GcsStore) -> None:
    """Three steps on ranks 0 and 1, an upload in progress on rank 2, and an orphan chunk."""
    store.put_manifest(0, 1, manifest(h(0xA), h(0xB)))
    store.put_manifest(0, 2, manifest(h(0xC)))
    store.put_manifest(0, 3, manifest(h(0xD)))
    store.put_manifest(1, 1, manifest(h(0xE)))
    store.put_manifest(1, 2, manifest(h(0xB)))
    store.put_manifest(1, 3, manifest(h(0xB)))
    store.put_pending(2, 7, [h(0xF)])
    for n in (0xA, 0xB, 0xC, 0xD, 0xE, 0xF, 0x99):
        store.put_chunk(h(n), bytes(n))


def test_gc_keeps_the_newest_step_every_rank_has(store):
    populate(store)
    store.delete_manifest(1, 3)  # rank 1 never got past step 2
    result = store.collect_garbage(keep_newest=1, grace=0, nodes=2)
    # Keeping only the newest would leave rank 0 at 3 and rank 1 at 2: no common step.
    assert store.list_manifests() == {0: [2, 3], 1: [2]}
    assert result["manifests_deleted"] == 2 and result["chunks_missing"] == 0


def test_gc_keeps_newest_steps_and_every_chunk_still_named(store):
    populate(store)
    result = store.collect_garbage(keep_newest=2, grace=0)

    assert store.list_manifests() == {0: [2, 3], 1: [2, 3]}
    # A: only in a dropped step. E: same, other rank. 0x99: never named. B: dropped
    # with rank 0 step 1 but kept by rank 1. F: named only by the upload in progress.
    assert chunks_in(store) == {h(0xB), h(0xC), h(0xD), h(0xF)}
    assert result == {
        "manifests_deleted": 2,
        "chunks_deleted": 3,
        "bytes_deleted": 0xA + 0xE + 0x99,
        "chunks_kept": 4,
        "chunks_missing": 0,
    }


def test_gc_spares_unreferenced_chunks_younger_than_grace(store):
    populate(store)
    result = store.collect_garbage(keep_newest=2, grace=3600)
    assert result["manifests_deleted"] == 2
    assert result["chunks_deleted"] == 0
    assert len(chunks_in(store)) == 7


def test_gc_reports_chunks_a_kept_manifest_needs_but_gcs_lacks(store):
    store.put_manifest(0, 1, manifest(h(1), h(2)))
    store.put_chunk(h(1), b"frame")
    assert store.collect_garbage(keep_newest=1, grace=0)["chunks_missing"] == 1


def test_gc_deletes_nothing_when_a_manifest_is_unreadable(store):
    store.put_manifest(0, 1, b"{not json")
    store.put_chunk(h(1), b"frame")
    with pytest.raises(CorruptObject, match="step-000000000001.json"):
        store.collect_garbage(keep_newest=1, grace=0)
    assert chunks_in(store) == {h(1)}


def wrap_then(method: Callable, after: Callable[[], None]) -> Callable:
    """``method`` as is, then ``after``: a concurrent uploader acting at that moment."""

    def wrapper(*args, **kwargs):
        result = method(*args, **kwargs)
        if isinstance(result, Iterator):
            result = list(result)
        after()
        return result

    return wrapper


@pytest.mark.parametrize("moment", ["list_manifests", "list_chunks"])
def test_gc_spares_a_chunk_touched_after_it_started(store, monkeypatch, moment):
    """An uploader reusing an orphan chunk, after the collector listed manifests or chunks."""
    store.put_chunk(h(0x99), b"orphan")
    store.put_chunk(h(0x98), b"orphan too")
    monkeypatch.setattr(store, moment, wrap_then(getattr(store, moment), lambda: store.touch_chunk(h(0x99))))
    result = store.collect_garbage(keep_newest=1, grace=0)
    assert chunks_in(store) == {h(0x99)}
    assert result["chunks_deleted"] == 1


# -- outages -----------------------------------------------------------------------------


def test_outage_surfaces_quickly_and_recovery_finds_the_data(tmp_path: Path, monkeypatch):
    """A private emulator, so stopping it cannot disturb other tests."""
    with GcsEmulator(tmp_path / "gcs") as emulator:
        for name, value in emulator.environ().items():
            monkeypatch.setenv(name, value)
        emulator.make_bucket("outage")
        store = GcsStore("gs://outage/p", "job1")
        store.put_chunk(h(1), b"before")
        store.put_manifest(0, 1, b"manifest")

        emulator.stop()
        for operation in (
            lambda: store.put_chunk(h(2), b"during"),
            lambda: store.get_chunk_frame(h(1)),
            lambda: store.list_steps(0),
            lambda: store.touch_chunk(h(1)),
        ):
            started = time.monotonic()
            with pytest.raises(GcsUnavailable, match=r"gs://outage/p/job1/.*: Connection refused"):
                operation()
            assert time.monotonic() - started < 15

        emulator.restart()
        assert store.get_chunk_frame(h(1)) == b"before"
        assert store.list_steps(0) == [1]
        assert store.put_chunk(h(2), b"after") is True
