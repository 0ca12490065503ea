"""Chunk hashing, frames and file chunking: every frame decodes to exactly what was encoded."""

from __future__ import annotations

import os
import random
import threading
from array import array
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import pytest
import xxhash
import zstandard

from tierfs.core import chunks
from tierfs.core.chunks import HASH_PIECE, CorruptChunk, chunk_hash, decode, encode, hash_file, read_chunk

TEXT = b"".join(
    b'{"name": "layers.%d.attention.wq.weight", "shape": [4096, 4096], "dtype": "bfloat16", '
    b'"offset": %d}\n' % (i, i << 25)
    for i in range(2000)
)


@cache
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
    monkeypatch.setattr(
        chunks, "_compress", lambda tag, data: real(tag, data) if len(data) <= 256 << 10 else b"x" * len(data)
    )
    data = bytes(1 << 20)
    assert encode(data) == b"R" + data


def test_wrong_expected_hash_is_corrupt():
    data = TEXT
    with pytest.raises(CorruptChunk, match=f"expected {'0' * 32}, got {chunk_hash(data)}"):
        decode(encode(data), "0" * 32)


@pytest.mark.parametrize(
    "data, tag", [(os.urandom(5000), b"R"), (TEXT, b"Z"), (bf16_in_fp32(16 << 10), b"P")], ids=["raw", "zstd", "planes"]
)
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


def test_hash_file_names_chunks_larger_than_its_read_piece(tmp_path):
    cs = 2 * HASH_PIECE + 12_345  # each chunk is read in three pieces, the last one short
    data = os.urandom(2 * cs + HASH_PIECE + 7)
    path = tmp_path / "shard"
    path.write_bytes(data)
    assert hash_file(path, cs) == [chunk_hash(data[i : i + cs]) for i in range(0, len(data), cs)]


@pytest.mark.parametrize(
    ("cs", "size", "dribble"), [(4096, 50_000, 999), (HASH_PIECE + 4096, 3 * HASH_PIECE + 13_287, 99_999)]
)
def test_hash_file_fills_whole_chunks_across_short_reads(tmp_path, cs, size, dribble):
    data = os.urandom(size)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write_in_dribbles():
        with open(fifo, "wb", buffering=0) as f:
            for i in range(0, len(data), dribble):
                f.write(data[i : i + dribble])

    writer = threading.Thread(target=write_in_dribbles)
    writer.start()
    try:
        hashes = hash_file(fifo, cs)
    finally:
        writer.join()
    assert hashes == [chunk_hash(data[i : i + cs]) for i in range(0, len(data), cs)]


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


# -- sparse files: holes are named, never read --------------------------------------------

CS = 64 << 10  # the smallest --chunk-size: a tmpfs page is 4 KiB, so holes fit inside chunks
PAGE = 4096


def sparse_file(path, size: int, data: list[tuple[int, bytes]]):
    """A file of ``size`` bytes that holds ``data`` at its offsets and holes everywhere else."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, chunk in data:
            os.pwrite(f.fileno(), chunk, offset)
    return path


def hashed_by_reading(path) -> list[str]:
    data = open(path, "rb").read()
    return [chunk_hash(data[i : i + CS]) for i in range(0, len(data), CS)]


LAYOUTS = {
    "all hole": (5 * CS, []),
    "all hole, short last chunk": (5 * CS + 3 * PAGE + 17, []),
    "hole at chunk boundaries": (6 * CS, [(0, b"a" * CS), (3 * CS, b"b" * CS)]),
    "hole inside a chunk": (3 * CS, [(CS, b"c" * PAGE), (2 * CS - PAGE, b"d" * PAGE)]),
    "hole at the end": (8 * CS + 100, [(0, b"e" * (CS + PAGE))]),
    "hole at the end of a short last chunk": (4 * CS + 3 * PAGE, [(4 * CS, b"f" * PAGE)]),
    "data at the end only": (7 * CS + 5, [(7 * CS, b"g" * 5)]),
    "data across a chunk boundary": (4 * CS, [(CS - PAGE, b"h" * 2 * PAGE)]),
    "zeros written as data": (4 * CS, [(CS, bytes(CS)), (3 * CS, bytes(PAGE))]),
    "one byte per chunk": (6 * CS, [(i * CS + 7 * i, b"i") for i in range(6)]),
}


@pytest.mark.parametrize("where", ["tmpfs", "disk"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hash_file_of_a_sparse_file_equals_hashing_every_byte(shm_dir, tmp_path, where, layout):
    size, data = LAYOUTS[layout]
    path = sparse_file((shm_dir() if where == "tmpfs" else tmp_path) / "f", size, data)
    assert hash_file(path, CS) == hashed_by_reading(path)


@pytest.mark.parametrize("seed", range(20))
def test_hash_file_equals_hashing_every_byte_for_random_holes(shm_dir, seed):
    rng = random.Random(seed)
    size = rng.randrange(1, 40 * CS)
    data = []
    for _ in range(rng.randrange(0, 12)):
        offset = rng.randrange(0, size)
        length = min(size - offset, rng.choice([1, PAGE, CS, 3 * CS, rng.randrange(1, 2 * CS)]))
        data.append((offset, rng.choice([bytes(length), rng.randbytes(length)])))
    path = sparse_file(shm_dir() / "f", size, data)
    assert hash_file(path, CS) == hashed_by_reading(path)


def test_zero_hash_is_the_hash_of_zeros():
    for length in (1, PAGE, CS, chunks.MAX_CHUNK_SIZE):
        assert chunks.zero_hash(length) == chunk_hash(bytes(length))


def bytes_read() -> int:
    """What this process has read with read(2) and its kind so far (the kernel's count)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_hash_file_reads_only_the_chunks_that_hold_data(shm_dir):
    size = 64 << 40  # 64 TiB: reading its holes would take hours
    cs = chunks.MAX_CHUNK_SIZE
    data = [(0, b"head"), (cs * 1000 + 12345, os.urandom(3 * PAGE)), (size - 10, b"tail" * 2)]
    path = sparse_file(shm_dir() / "huge", size, data)
    before = bytes_read()
    hashes = hash_file(path, cs)
    read = bytes_read() - before
    assert read <= 3 * cs + (1 << 20), f"read {read} bytes of a file holding {sum(len(d) for _, d in data)}"
    assert len(hashes) == size // cs
    holding = {0: 0, 1000: 1, size // cs - 1: 2}
    for index, h in enumerate(hashes):
        if index in holding:
            assert h == chunk_hash(read_chunk(path, index, cs))
        else:
            assert h == chunks.zero_hash(cs)


def test_hash_file_paces_itself_before_every_chunk_it_reads(shm_dir):
    """Background hashing gives way to the job's writes between chunks, never for a hole."""
    holding = [0, 3, 4, 9]  # chunks with data; the other six are holes, named without a read
    path = sparse_file(shm_dir() / "f", 10 * CS, [(i * CS + 5, os.urandom(PAGE)) for i in holding])
    paced = []
    assert hash_file(path, CS, lambda: paced.append(bytes_read())) == hashed_by_reading(path)
    assert len(paced) == len(holding)
    assert paced == sorted(paced) and paced[-1] - paced[0] >= 3 * CS  # a chunk read between each

    data = os.urandom(3 * CS + 1)
    fifo = shm_dir() / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(data))
    writer.start()
    paced.clear()
    try:
        assert hash_file(fifo, CS, lambda: paced.append(1)) == [
            chunk_hash(data[i : i + CS]) for i in range(0, len(data), CS)
        ]
    finally:
        writer.join()
    assert len(paced) == 5  # before each of the four chunks, and before the read that finds the end
