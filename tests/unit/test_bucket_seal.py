"""Sealing chunks and manifests for a bucket (tierfs.core.bucket_seal): deterministic for a
frame, bound to its chunk and to its (rank, step), opened by the job's keys only."""

from __future__ import annotations

import os

import pytest

from tierfs.core.bucket_seal import OVERHEAD, TAG
from tierfs.core.chunks import RAW, CorruptChunk, chunk_hash, encode
from tierfs.core.keys import bucket_seals

SECRET, OTHER = b"a" * 64, b"b" * 64


def test_a_frame_seals_the_same_on_every_node_and_opens_only_as_its_chunk():
    seal = bucket_seals("job", SECRET)[0]
    data, other = os.urandom(10_000), os.urandom(10_000)
    h, g = chunk_hash(data), chunk_hash(other)
    body = seal.seal(h, encode(data))
    assert body == bucket_seals("job", SECRET)[0].seal(h, encode(data))  # deduplicates across nodes
    assert body[:1] == TAG and len(body) == len(encode(data)) + OVERHEAD
    assert data not in body and encode(data) not in body
    assert seal.open(h, body) == encode(data)
    with pytest.raises(CorruptChunk, match="does not open"):
        seal.open(g, body)  # moved under another chunk's name
    with pytest.raises(CorruptChunk, match="does not open"):
        seal.open(h, body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(CorruptChunk, match="does not open"):
        seal.open(h, RAW + data)  # a frame in clear is not a sealed chunk
    assert seal.seal(g, encode(other))[1:13] != body[1:13], "another frame, another nonce"


def test_keys_are_the_jobs_and_the_secrets():
    (seal,) = bucket_seals("job", SECRET)
    h = chunk_hash(b"x")
    names = {
        seal.object_key(h),
        bucket_seals("job", OTHER)[0].object_key(h),
        bucket_seals("job2", SECRET)[0].object_key(h),
    }
    assert len(names) == 3 and all(len(k) == 64 and int(k, 16) >= 0 for k in names)
    assert h not in seal.object_key(h) and len(seal.id) == 16
    with pytest.raises(CorruptChunk):
        bucket_seals("job", OTHER)[0].open(h, seal.seal(h, encode(b"x")))
    rotated = bucket_seals("job", OTHER, older=[SECRET])
    assert [s.id for s in rotated] == [bucket_seals("job", OTHER)[0].id, seal.id]
    assert bucket_seals("job", None) == ()


def test_a_manifest_opens_only_as_its_rank_and_step():
    (seal,) = bucket_seals("job", SECRET)
    body = seal.seal_manifest(3, 700, b'{"format":1}')
    assert b"format" not in body and body != seal.seal_manifest(3, 700, b'{"format":1}')  # a fresh nonce each time
    assert seal.open_manifest(3, 700, body) == b'{"format":1}'
    assert seal.open_manifest(3, 701, body) is None and seal.open_manifest(2, 700, body) is None
    assert bucket_seals("job", OTHER)[0].open_manifest(3, 700, body) is None
