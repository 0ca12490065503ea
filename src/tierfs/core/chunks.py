"""Chunks: the unit tierfs stores, compresses, uploads and deduplicates.

A committed file is cut into fixed-size chunks, each named by the xxh3-128 of its bytes.
Content addressing is what makes tiers cheap: a chunk that did not change between steps,
or that several ranks hold (replicated optimizer state, the same tokenizer), is stored and
transferred once.

A stored chunk is a *frame*: one tag byte naming the codec, then the payload. The tag makes
every object self-describing, so a reader never needs the manifest to know how to decode
it, and the codec can change per chunk. ``P`` ("planes") splits the bytes into four byte
planes before zstd: bf16 and fp32 tensors keep their exponents in one byte of each word
and their noisy low mantissa bits in others, so plain zstd sees mostly noise while the
planes compress well (bf16 stored in fp32 words shrinks to about a third).

Compression is CPU work that never runs on the FUSE write path; callers run ``encode``
and ``decode`` in worker threads, and both are safe to call from many threads at once.

Frames come back from buckets anyone with write access can fill, so ``decode`` never
produces more than the chunk can hold: a zstd frame must name its size in its header, and
one naming more than the caller's bound is refused before any memory is set aside for it.
"""

from __future__ import annotations

import functools
import io
import os
import stat
import threading
from collections.abc import Callable

import xxhash
import zstandard

from tierfs.core import holes

DEFAULT_CHUNK_SIZE = 4 << 20
MIN_CHUNK_SIZE = 64 << 10  # the smallest --chunk-size
MAX_CHUNK_SIZE = 64 << 20  # the largest --chunk-size: no chunk, decoded or raw, is larger

RAW, ZSTD, PLANES = b"R", b"Z", b"P"

_LEVEL = 1
_SAMPLE = 256 << 10  # bytes compressed to decide whether compressing the chunk pays
_WORTH_IT = 0.9  # compress only if the sample shrinks to at most this fraction
HASH_PIECE = 512 << 10  # bytes read at a time for hashing: what stays in a core's cache
_local = threading.local()


class CorruptChunk(Exception):
    """A stored chunk cannot be decoded, or decodes to bytes with another hash."""


def chunk_hash(data: bytes | memoryview) -> str:
    """The chunk's name: 32 lowercase hex digits of xxh3-128."""
    return xxhash.xxh3_128_hexdigest(data)


def _codecs() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    # zstd contexts are not thread-safe, and a fresh one per chunk would allocate its
    # working memory again for every chunk: keep one pair per thread.
    codecs: tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor] | None = getattr(_local, "codecs", None)
    if codecs is None:
        codecs = _local.codecs = zstandard.ZstdCompressor(level=_LEVEL), zstandard.ZstdDecompressor()
    return codecs


def scratch(n: int) -> memoryview:
    """``n`` bytes of this thread's reusable buffer (contents undefined), until its next call.

    A fresh ``bytearray`` is zeroed while holding the GIL and faulted in page by page: for a
    step of many small files, allocating a chunk-sized buffer per file cost more than
    reading it. The buffer grows to the largest size asked for in the thread and stays.
    """
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = _local.scratch = bytearray(n)
    return memoryview(buf)[:n]


def _split_planes(data: bytes) -> bytes:
    # Slicing bytes with a step runs in C; a strided memoryview is ten times slower.
    return b"".join(data[i::4] for i in range(4))


def _join_planes(planes: bytes) -> bytes:
    out = bytearray(len(planes))
    view, start = memoryview(planes), 0
    for i in range(4):
        count = len(range(i, len(out), 4))
        out[i::4] = view[start : start + count]
        start += count
    return bytes(out)


def _compress(tag: bytes, data: bytes) -> bytes:
    # The compressor writes the content size into the frame, so decode needs one call.
    compressor = _codecs()[0]
    return compressor.compress(_split_planes(data) if tag == PLANES else data)


def encode(data: bytes | memoryview) -> bytes:
    """Frame a chunk for storage, compressed only where that saves space.

    Most checkpoint bytes are high-entropy and do not compress; trying both codecs on a
    sample from the middle of the chunk keeps the cost of finding that out small. The
    sample starts on a 4-byte boundary so its planes line up with the chunk's.
    """
    data = data if type(data) is bytes else bytes(data)
    if not data:
        return RAW
    start = max(0, (len(data) - _SAMPLE) // 2) & ~3
    sample = data[start : start + _SAMPLE]
    trials = {tag: _compress(tag, sample) for tag in (ZSTD, PLANES)}
    tag = min(trials, key=lambda t: len(trials[t]))
    if len(trials[tag]) > _WORTH_IT * len(sample):
        return RAW + data
    body = trials[tag] if len(sample) == len(data) else _compress(tag, data)
    return tag + body if len(body) < len(data) else RAW + data


def max_frame_size(chunk_length: int) -> int:
    """The largest frame a chunk of ``chunk_length`` bytes is stored in (raw, plus its tag)."""
    return chunk_length + 1


def decode(frame: bytes | memoryview, expected_hash: str | None = None, max_size: int = MAX_CHUNK_SIZE) -> bytes:
    """Unframe a chunk of at most ``max_size`` bytes; with ``expected_hash``, prove it is the one asked for.

    Chunks come back from disks, peers and GCS, so every failure to decode is reported as
    ``CorruptChunk``: the caller's answer is the same (fetch it from another tier). A
    caller that knows the chunk's length from its manifest passes it as ``max_size``.
    """
    if not frame:
        raise CorruptChunk("empty frame: no tag byte")
    if len(frame) > max_frame_size(max_size):
        raise CorruptChunk(
            f"frame of {len(frame)} bytes is too large: a chunk of at most {max_size} "
            f"bytes is stored in at most {max_frame_size(max_size)}"
        )
    tag, body = bytes(frame[:1]), memoryview(frame)[1:]
    try:
        if tag == RAW:
            data = bytes(body)
        elif tag in (ZSTD, PLANES):
            data = _decompress(body, max_size, tag)
            if tag == PLANES:
                data = _join_planes(data)
        else:
            raise CorruptChunk(f"bad frame tag {tag!r}: expected one of R, Z, P")
    except zstandard.ZstdError as e:
        raise CorruptChunk(f"bad {tag.decode()} frame: {e}") from None
    if expected_hash is not None:
        actual = chunk_hash(data)
        if actual != expected_hash:
            raise CorruptChunk(f"chunk hash mismatch: expected {expected_hash}, got {actual}")
    return data


def _decompress(body: memoryview, max_size: int, tag: bytes) -> bytes:
    """Decompress one zstd frame into a buffer of the size its header names, at most ``max_size``.

    zstd never writes past that buffer (a frame holding more fails), so the size check
    before it is the whole output cap: no bomb gets more memory than a real chunk would.
    The writer always records the size and compresses only non-empty chunks, so a frame
    without one is refused, and so is one of zero bytes (python-zstandard returns those
    without looking at the rest of the frame).
    """
    size = zstandard.frame_content_size(body)
    if size == -1:
        raise CorruptChunk(f"bad {tag.decode()} frame: its zstd header does not record the content size")
    if not 0 < size <= max_size:
        raise CorruptChunk(
            f"bad {tag.decode()} frame: its zstd header claims {size} bytes, the chunk has at most {max_size}"
        )
    return _codecs()[1].decompress(body, allow_extra_data=False)


def zero_hash(length: int) -> str:
    """The name of a chunk of ``length`` zero bytes: what a hole of that length hashes to."""
    return _zero_hashes(length)


@functools.lru_cache(maxsize=16)  # a step's chunk size, and the lengths of a few short last chunks
def _zero_hashes(length: int) -> str:
    return chunk_hash(bytes(length))


def hash_file(path: str | os.PathLike[str], chunk_size: int, pace: Callable[[], None] = lambda: None) -> list[str]:
    """The names of a file's chunks, in order; ``[]`` for an empty file.

    A chunk that lies wholly in a hole is named without reading it (:func:`zero_hash`), so
    a sparse file costs what it holds, not its size; a chunk that touches data is read
    whole, holes and all, :data:`HASH_PIECE` bytes at a time into the thread's one buffer
    (:func:`scratch`), so hashing many GiB, or many files, allocates nothing per chunk or
    per file. ``pace()`` is called before each chunk is read: it may wait, so that hashing
    in the background can give way to the job's own writes.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_size}")
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):

            def next_name() -> str | None:
                pace()
                return _hash_stream(f, chunk_size)

            return list(iter(next_name, None))
        return _hash_sparse(f.fileno(), st.st_size, chunk_size, pace)


def hash_range(fd: int, offset: int, length: int) -> xxhash.xxh3_128 | None:
    """An xxh3-128 hasher fed ``length`` bytes of ``fd`` at ``offset``; ``None`` if the file is short.

    Read :data:`HASH_PIECE` bytes at a time: a piece stays in the core's cache between the
    copy out of the page cache and the hashing, which a whole 4 MiB chunk does not (hashing
    a step is then a fifth faster).
    """
    hasher = xxhash.xxh3_128()
    view = scratch(min(length, HASH_PIECE))
    done = 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(view), length - done)]], offset + done)
        if n == 0:
            return None
        hasher.update(view[:n])
        done += n
    return hasher


def _hash_sparse(fd: int, size: int, chunk_size: int, pace: Callable[[], None]) -> list[str]:
    """A regular file's chunk names: runs of whole chunks in a hole named at once, the rest read."""
    hashes: list[str] = []
    extents = holes.data_extents(fd, 0, size)
    data = next(extents, None)
    offset = 0
    while offset < size:
        while data is not None and data[1] <= offset:
            data = next(extents, None)
        hole_end = size if data is None else max(offset, data[0])
        if whole := (hole_end - offset) // chunk_size:
            hashes += [zero_hash(chunk_size)] * whole
            offset += whole * chunk_size
            continue
        if hole_end == size:  # a short last chunk, all hole
            hashes.append(zero_hash(size - offset))
            break
        want = min(chunk_size, size - offset)
        pace()
        hasher = hash_range(fd, offset, want)
        if hasher is None:
            break  # shorter than it was: the caller compares the count with the size
        hashes.append(hasher.hexdigest())
        offset += want
    return hashes


def _hash_stream(f: io.FileIO, chunk_size: int) -> str | None:
    """The name of the next chunk of a file that is not a regular file; ``None`` at its end."""
    hasher, view, filled = xxhash.xxh3_128(), scratch(min(chunk_size, HASH_PIECE)), 0
    while filled < chunk_size and (n := f.readinto(view[: min(len(view), chunk_size - filled)])):
        hasher.update(view[:n])
        filled += n
    return hasher.hexdigest() if filled else None


def read_chunk(path: str | os.PathLike[str], index: int, chunk_size: int) -> bytes:
    """Chunk ``index`` of a file: ``chunk_size`` bytes, fewer for the last, none past EOF."""
    parts = []
    offset = index * chunk_size
    end = offset + chunk_size
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while offset < end and (part := os.pread(fd, end - offset, offset)):
            parts.append(part)
            offset += len(part)
    finally:
        os.close(fd)
    return b"".join(parts)
