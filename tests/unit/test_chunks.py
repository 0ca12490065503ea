"""Chunk hashing, frames and file chunking: every frame decodes to exactly what was encoded."""

from __future__ import annotations

import os
import random
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import pytest
import xxhash
import zstandard

from tierfs import chunks
from tierfs.chunks import CorruptChunk, chunk_hash, decode, encode, hash_file, read_chunk

TEXT = b"".join(b'{"name": "layers.%d.attention.wq.weight", "shape": [4096, 4096], "dtype": "bfloat16", '
                b'"offset": %d}\n' % (i, i << 25) for i in range(2000))


@lru_cache(maxsize=None)
def bf16_in_fp32(count: int, seed: int = 0) -> bytes:
    """fp32 words holding bf16 values, as a bf16 model upcast for saving: low 16 bits zero."""
    rng = random.Random(seed)
    words = array("I", array("f", (rng.gauss(0.0, 0.02) for _ in range(count))).tobytes())
    return array("I", (w & 0xFFFF0000 for w in words)).tobytes()


def test_chunk_hash_is_xxh3_128_hex():
    data = b"checkpoint shard"
    assert chunk_hash(data) == xxhash.xxh3_128(data).hexdigest()
    assert chunk_hash(memoryview(data)) == chunk_hash(data)
    assert len(chunk_hash(b"")) == 32 and chunk_hash(b"").islower()


def test_random_bytes_are_stored_raw():
    data = os.urandom(1 << 20)
    frame = encode(data)
    assert frame == b"R" + data
    assert decode(frame, chunk_hash(data)) == data


def test_incompressible_chunk_is_judged_on_a_sample(monkeypatch):
    compressed_sizes = []
    real = chunks._compress

    def spy(tag: bytes, data: bytes) -> bytes:
        compressed_sizes.append(len(data))
        return real(tag, data)

    monkeypatch.setattr(chunks, "_compress", spy)
    assert encode(os.urandom(4 << 20))[:1] == b"R"
    assert compressed_sizes and max(compressed_sizes) <= 256 << 10


@pytest.mark.parametrize("data", [bytes(1 << 20), TEXT], ids=["zeros", "text"])
def test_compressible_data_is_compressed_with_plain_zstd(data):
    frame = encode(data)
    assert frame[:1] == b"Z"
    assert len(frame) < len(data) // 10
    assert decode(frame, chunk_hash(data)) == data


@pytest.mark.parametrize("count", [16 << 10, 300_000], ids=["small", "larger-than-sample"])
def test_bf16_tensors_use_planes_and_beat_plain_zstd(count):
    data = bf16_in_fp32(count)
    frame = encode(data)
    assert frame[:1] == b"P"
    assert len(frame) < len(zstandard.ZstdCompressor(level=1).compress(data))
    assert decode(frame, chunk_hash(data)) == data


@pytest.mark.parametrize("tail", [1, 2, 3, 5])
@pytest.mark.parametrize("count", [16 << 10, 100_000])
def test_planes_round_trip_lengths_not_multiple_of_4(count, tail):
    data = bf16_in_fp32(count) + bytes(range(7, 7 + tail))
    frame = encode(data)
    assert frame[:1] == b"P"
    assert decode(frame, chunk_hash(data)) == data


@pytest.mark.parametrize("length", range(10))
def test_plane_split_and_join_are_inverse(length):
    data = bytes(range(1, length + 1))
    planes = chunks._split_planes(data)
    assert planes == data[0::4] + data[1::4] + data[2::4] + data[3::4]
    assert chunks._join_planes(planes) == data


def test_empty_chunk():
    assert encode(b"") == b"R"
    assert decode(b"R", chunk_hash(b"")) == b""


def test_memoryview_input_encodes_like_bytes():
    data = bf16_in_fp32(4096) + TEXT
    assert encode(memoryview(data)) == encode(data)
    assert encode(memoryview(bytearray(TEXT))[100:5000]) == encode(TEXT[100:5000])


def test_falls_back_to_raw_when_the_whole_chunk_does_not_shrink(monkeypatch):
    real = chunks._compress
    # The sample compresses well, the whole chunk (larger than a sample) does not.
    monkeypatch.setattr(chunks, "_compress", lambda tag, data: real(tag, data)
                        if len(data) <= 256 << 10 else b"x" * len(data))
    data = bytes(1 << 20)
    assert encode(data) == b"R" + data


def test_wrong_expected_hash_is_corrupt():
    data = TEXT
    with pytest.raises(CorruptChunk, match=f"expected {'0' * 32}, got {chunk_hash(data)}"):
        decode(encode(data), "0" * 32)


@pytest.mark.parametrize("data, tag", [(os.urandom(5000), b"R"), (TEXT, b"Z"), (bf16_in_fp32(16 << 10), b"P")],
                         ids=["raw", "zstd", "planes"])
def test_tampered_frame_is_corrupt(data, tag):
    frame = bytearray(encode(data))
    assert frame[:1] == tag
    frame[len(frame) // 2] ^= 0x40
    with pytest.raises(CorruptChunk):
        decode(bytes(frame), chunk_hash(data))


def test_truncated_or_padded_zstd_frame_is_corrupt_without_a_hash():
    frame = encode(TEXT)
    with pytest.raises(CorruptChunk, match="bad Z frame"):
        decode(frame[:-4])
    with pytest.raises(CorruptChunk, match="bad Z frame"):
        decode(frame + b"junk")


@pytest.mark.parametrize("frame", [b"X" + TEXT, b"r", b"\x00"])
def test_bad_tag_is_corrupt(frame):
    with pytest.raises(CorruptChunk, match="bad frame tag"):
        decode(frame)


def test_empty_frame_is_corrupt():
    with pytest.raises(CorruptChunk, match="empty frame"):
        decode(b"")


def test_concurrent_encode_and_decode_from_threads():
    inputs = [os.urandom(300_000), TEXT, bytes(700_000), bf16_in_fp32(100_000), bf16_in_fp32(1000) + b"x"] * 6
    expected = [encode(data) for data in inputs]

    def round_trip(data: bytes) -> tuple[bytes, bytes]:
        frame = encode(data)
        return frame, decode(frame, chunk_hash(data))

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(round_trip, inputs))
    assert [frame for frame, _ in results] == expected
    assert [data for _, data in results] == inputs


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 3 * 4096, 3 * 4096 + 1])
def test_hash_file_matches_hashing_slices(tmp_path, size):
    data = os.urandom(size)
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert hash_file(path, 4096) == [chunk_hash(data[i : i + 4096]) for i in range(0, size, 4096)]
    assert len(hash_file(str(path), 4096)) == -(-size // 4096)


def test_hash_file_fills_whole_chunks_across_short_reads(tmp_path):
    data = os.urandom(50_000)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write_in_dribbles():
        with open(fifo, "wb", buffering=0) as f:
            for i in range(0, len(data), 999):
                f.write(data[i : i + 999])

    writer = threading.Thread(target=write_in_dribbles)
    writer.start()
    try:
        hashes = hash_file(fifo, 4096)
    finally:
        writer.join()
    assert hashes == [chunk_hash(data[i : i + 4096]) for i in range(0, len(data), 4096)]


def test_hash_file_rejects_nonpositive_chunk_size(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ValueError, match="chunk size"):
        hash_file(tmp_path / "f", 0)


def test_read_chunk(tmp_path):
    data = os.urandom(3 * 4096 + 10)
    path = tmp_path / "shard"
    path.write_bytes(data)
    for index in range(4):
        assert read_chunk(path, index, 4096) == data[index * 4096 : (index + 1) * 4096]
    assert len(read_chunk(path, 3, 4096)) == 10
    assert read_chunk(path, 4, 4096) == b""
