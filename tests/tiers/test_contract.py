"""One contract, every tier (see tierfs.tiers.base): the same tests over local RAM, disk,
a real peer service over loopback, and the GCS emulator."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import trio
import trio.lowlevel

from tests import helpers
from tests.tiers.conftest import JOB, SECRET
from tierfs.core.chunks import chunk_hash
from tierfs.core.keys import manifest_keys
from tierfs.core.manifest import Manifest, authenticate
from tierfs.tiers.base import MAX_CHUNK, MAX_MANIFEST, Holdings, NotHeld, Progress, Tier, TierError, by_cost, put_step

CS = 64 << 10


def randbytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def one_line(e: BaseException) -> str:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)
    return text


def make_step(base: Path, rank: int, step: int, files: dict[str, bytes]) -> tuple[Manifest, dict]:
    return helpers.make_step(base, files, job=JOB, rank=rank, step=step, chunk_size=CS)


# -- chunks --------------------------------------------------------------------------------


async def test_a_chunk_put_is_held_and_given_back_whole(subject, files):
    tier = subject.tier
    data = randbytes(CS, 1)
    h = chunk_hash(data)
    assert await tier.has_chunks([h]) == [False]
    put = await tier.put_chunk(h, files(b"head" + data), 4, len(data))
    assert put.sent == len(data) and put.stored > 0
    assert await tier.has_chunks([h, chunk_hash(b"other")]) == [True, False]
    assert await tier.get_chunk(h, len(data)) == data


async def test_bytes_that_are_not_the_chunk_are_refused_on_put(subject, files):
    tier = subject.tier
    data = randbytes(CS, 2)
    h = chunk_hash(data)
    wrong = bytearray(data)
    wrong[100] ^= 1
    with pytest.raises(TierError) as err:
        await tier.put_chunk(h, files(bytes(wrong)), 0, len(data))
    one_line(err.value)
    assert await tier.has_chunks([h]) == [False]
    with pytest.raises(NotHeld):
        await tier.get_chunk(h, len(data))


async def test_a_damaged_copy_is_never_handed_out(subject, files):
    tier = subject.tier
    data = randbytes(CS, 3)
    h = chunk_hash(data)
    await tier.put_chunk(h, files(data), 0, len(data))
    subject.damage(h, randbytes(CS, 4))
    with pytest.raises(TierError) as err:
        await tier.get_chunk(h, len(data))
    assert h in one_line(err.value)


async def test_a_missing_chunk_is_a_clear_error(subject):
    h = chunk_hash(b"never stored")
    with pytest.raises(NotHeld) as err:
        await subject.tier.get_chunk(h, 12)
    assert h in one_line(err.value)


async def test_chunks_put_together_are_each_held_and_come_back_together(subject, files, tmp_path):
    """put_chunks and get_chunks_into: one request on a tier that takes batches (a peer), one by one elsewhere."""
    tier = subject.tier
    datas = [randbytes(n, 10 + i) for i, n in enumerate([CS, 1000, 3 * CS + 5])]
    chunks = [(chunk_hash(d), (str(files(b"head" + d)), 4, len(d))) for d in datas]
    puts = await tier.put_chunks(chunks)
    assert [p.sent for p in puts] == [len(d) for d in datas]
    assert await tier.has_chunks([h for h, _ in chunks]) == [True] * 3
    absent = chunk_hash(b"never stored")
    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        asks = [(h, len(d), fd, 10 * CS * i) for i, ((h, _), d) in enumerate(zip(chunks, datas, strict=True))]
        assert await tier.get_chunks_into(asks + [(absent, 10, fd, 40 * CS)]) == [True, True, True, False]
        for (_, length, _, offset), d in zip(asks, datas, strict=True):
            assert os.pread(fd, length, offset) == d
    finally:
        os.close(fd)


async def test_a_lying_chunk_among_others_is_refused_and_never_held(subject, files):
    tier = subject.tier
    good, lie = randbytes(CS, 20), randbytes(CS, 21)
    liar = chunk_hash(b"the name of other bytes")
    with pytest.raises(TierError) as err:
        await tier.put_chunks([(chunk_hash(good), (str(files(good)), 0, CS)), (liar, (str(files(lie)), 0, CS))])
    one_line(err.value)
    assert await tier.has_chunks([liar]) == [False]


async def test_sizes_beyond_any_chunk_or_manifest_are_refused_before_any_transfer(subject, files):
    tier = subject.tier
    small = files(b"x" * 10)
    h = chunk_hash(b"x" * 10)
    for call in (
        tier.put_chunk(h, small, 0, MAX_CHUNK + 1),
        tier.get_chunk(h, MAX_CHUNK + 1),
        tier.put_chunk("not-a-hash", small, 0, 10),
        tier.put_manifest(0, 1, b" " * (MAX_MANIFEST + 1)),
    ):
        with pytest.raises(TierError) as err:
            await call
        one_line(err.value)
    assert await tier.has_chunks([h]) == [False]
    assert (0, 1) not in (await tier.holdings()).manifests


# -- manifests -----------------------------------------------------------------------------


async def test_a_step_put_is_listed_and_its_manifest_and_chunks_come_back(subject, tmp_path):
    tier = subject.tier
    files = {"a": randbytes(3 * CS + 5, 10), "b": randbytes(CS, 11), "same": randbytes(CS, 11)}
    manifest, where = make_step(tmp_path, 0, 5, files)
    progress = Progress(5, len(where))
    pushed = await put_step(tier, manifest, where, progress=progress)
    assert pushed.sent_bytes == 4 * CS + 5 and pushed.skipped_bytes == 0  # "same" is one chunk with "b"
    assert progress.chunks_done == progress.chunks_total == 5
    assert Manifest.from_json(await tier.get_manifest(0, 5)) == manifest
    for h, (path, offset, length) in where.items():
        with open(path, "rb") as f:
            f.seek(offset)
            assert await tier.get_chunk(h, length) == f.read(length)
    # The same step again moves no chunk: the tier says it holds them all.
    again = await put_step(tier, manifest, where)
    assert again.sent_bytes == 0 and again.skipped_bytes == 4 * CS + 5


async def test_listing_holds_every_manifest_put(subject, tmp_path):
    tier = subject.tier
    for rank, step in [(0, 5), (1, 5), (0, 7)]:
        manifest, where = make_step(tmp_path, rank, step, {"w": randbytes(CS, rank * 100 + step)})
        await put_step(tier, manifest, where)
    holdings = await tier.holdings()
    assert isinstance(holdings, Holdings)
    assert {(0, 5), (1, 5), (0, 7)} <= set(holdings.manifests)
    assert await tier.list_manifests() == sorted(holdings.manifests)
    report = tier.report()
    assert report["name"] == tier.name and json.dumps(report)


async def test_a_missing_manifest_is_a_clear_error(subject):
    with pytest.raises(NotHeld) as err:
        await subject.tier.get_manifest(3, 99)
    text = one_line(err.value)
    assert "3" in text and "99" in text


async def test_a_manifest_put_again_replaces_the_old_one_whole(subject, tmp_path):
    tier = subject.tier
    first, where1 = make_step(tmp_path, 0, 9, {"a": randbytes(CS, 20)})
    second, where2 = make_step(tmp_path, 0, 9, {"a": randbytes(CS, 21), "b": randbytes(2 * CS, 22)})
    await put_step(tier, first, where1)
    await put_step(tier, second, where2)
    assert Manifest.from_json(await tier.get_manifest(0, 9)) == second
    versions = {first.to_json(), second.to_json()}
    seen = set()

    async def writer():
        for i in range(6):
            await tier.put_manifest(0, 9, (first if i % 2 else second).to_json())

    async def reader():
        for _ in range(12):
            data = await tier.get_manifest(0, 9)
            assert data in versions, "a reader saw a partial or foreign manifest"
            seen.add(data)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        nursery.start_soon(reader)
    assert seen and await tier.list_manifests() == [(0, 9)]


# -- what a tier says about itself ----------------------------------------------------------


async def test_a_tier_is_a_value_with_a_name_kind_and_cost(subject):
    tier = subject.tier
    assert isinstance(tier, Tier) and tier.name and tier.kind and tier.where
    assert tier.cost.read_gib_s > 0 and tier.cost.dollars_per_gib >= 0
    assert by_cost([tier]) == [tier]
    await tier.aclose()


async def test_a_sealed_manifest_comes_back_with_its_seal(subject, tmp_path):
    """Every tier keeps a manifest's seal: a restoring node checks it, whichever tier answers."""
    keys = manifest_keys(JOB, SECRET)
    manifest, where = make_step(tmp_path, 0, 6, {"s": randbytes(CS + 3, 12)})
    await put_step(subject.tier, manifest, where, seal_with=keys)
    data = await subject.tier.get_manifest(0, 6)
    assert data == manifest.sealed(keys)
    assert Manifest.from_json(authenticate(data, keys, 0, 6)) == manifest
    assert (0, 6) in (await subject.tier.holdings()).manifests
