"""A step's manifest, described from the frozen snapshot tree it commits.

The format (:mod:`tierfs.core.manifest`) is pure: bytes in, a checked manifest out, the
same on every node and tier. Describing a step is the one place that reads a file system:
it walks the tree, decides what a checkpoint holds (symlinks recorded, never followed;
fifos, sockets and devices skipped), and hashes the files. It stands apart so that the
costs of that walk (the step's size checked before a byte is hashed, hashes reused across
steps) are weighed in one place, and every reader of manifests goes without it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierfs.core import chunks
from tierfs.core.manifest import (
    MAX_BYTES,
    MAX_CHUNKS,
    MAX_ENTRIES,
    Entry,
    Manifest,
    ManifestError,
    check_path,
    check_target,
    short,
)
from tierfs.core.parse import format_size

log = logging.getLogger(__name__)

FileKey = tuple[int, int, int]  # (st_ino, st_size, st_mtime_ns)
HASH_THREADS = min(4, os.cpu_count() or 1)  # files hashed at once: a few cores, not the training job's


def build(
    snapshot_root: Path,
    roots: list[str],
    *,
    job: str,
    rank: int,
    step: int,
    chunk_size: int,
    known: dict[FileKey, list[str]] | None = None,
    hashed: Callable[[str, int, list[str]], None] | None = None,
    pace: Callable[[], None] = lambda: None,
) -> Manifest:
    """Describe the committed ``roots`` of a snapshot tree that nothing writes to any more.

    Symlinks are recorded, never followed; fifos, sockets and devices are skipped, since no
    checkpoint format writes them, and so are symlinks that are absolute or climb out of
    their directory, which no restore would recreate (:func:`check_target`). Hard links
    become separate files: their chunks are the same, so they cost nothing extra. The
    ancestors of each root are recorded too, so a restore recreates their modes and owners
    as well. The result is checked as a manifest from elsewhere would be: what is backed
    up can be restored.

    The whole tree is described before any byte is hashed, and a step larger than a
    manifest can describe is refused then (:class:`_Tally`): a file's size is a number
    its owner sets (``truncate -s 1P`` costs no RAM), and hashing it first would cost the
    daemon time in proportion to that number. Holes are never read (:func:`chunks.hash_file`).

    ``known`` caches chunk lists by ``(st_ino, st_size, st_mtime_ns)``. Passing the same
    dict for every step of one volume hashes a file that outlives several steps once, not
    once per step, as long as it keeps its inode (the same file, or hard links to it); hard
    links within one step are hashed once too. It is filled in as files are hashed. Keep one
    per filesystem and chunk size: the key holds neither.

    Files are hashed :data:`HASH_THREADS` at a time: reading a tmpfs file into a buffer and
    hashing it release the GIL, and the step is waited for by every lane. ``hashed(path,
    size, chunks)`` is told of each file as soon as its chunks are known (from a hashing
    thread), so its chunks can be on their way before the whole step is described.
    ``pace()`` is called in a hashing thread before each chunk is read (:func:`chunks.hash_file`).
    """
    top = Path(snapshot_root)
    ancestors: dict[str, Entry] = {}
    found: dict[str, Entry] = {}
    files: dict[str, os.stat_result] = {}  # regular files to hash, by path
    tally = _Tally(chunk_size)
    for root in roots:
        check_path(root, "root")
        parts = root.split("/")
        for depth in range(1, len(parts)):
            path = "/".join(parts[:depth])
            if path not in ancestors:
                st = os.lstat(top / path)
                if not stat.S_ISDIR(st.st_mode):
                    raise ManifestError(f"root {root!r}: {path!r} is not a directory")
                ancestors[path] = _entry(path, st, "dir")
        _walk(top, root, found, files, tally)
        if root not in found:
            raise ManifestError(
                f"root {root!r} is not a file, directory or symlink (or is a symlink no restore could recreate)"
            )
    names: dict[FileKey, list[str]] = {}  # hard links share a key: hashed once
    for rel, st in files.items():
        names.setdefault((st.st_ino, st.st_size, st.st_mtime_ns), []).append(rel)
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(names))), thread_name_prefix="tierfs-hash") as pool:

        def describe_file(rels: list[str]) -> list[str]:
            file_chunks = _file_chunks(top / rels[0], files[rels[0]], chunk_size, known, pace)
            if hashed is not None:
                hashed(rels[0], files[rels[0]].st_size, file_chunks)
            return file_chunks

        for rels, file_chunks in zip(names.values(), pool.map(describe_file, names.values()), strict=True):
            for rel in rels:
                found[rel].chunks = list(file_chunks)
    entries = sorted({**ancestors, **found}.values(), key=lambda e: e.path)
    manifest = Manifest(
        job=job, rank=rank, step=step, chunk_size=chunk_size, roots=list(roots), entries=entries, created=time.time()
    )
    manifest.validate()
    if len(manifest.to_json()) > MAX_BYTES:  # the tally counted a lower bound
        raise _too_large()
    return manifest


_JSON_PER_CHUNK = 35  # bytes a chunk name takes in a manifest's JSON: 32 digits, quotes, a comma


def _too_large() -> ManifestError:
    return ManifestError(
        f"the step's manifest would be larger than {MAX_BYTES} bytes, which no tier "
        "stores: commit fewer or smaller files in one step"
    )


class _Tally:
    """What the paths described so far will cost the step's manifest, refused as soon as it is too much.

    Counting needs only sizes, so a step no manifest could describe is refused before any
    byte is hashed. The refusal names the step's largest file, the usual reason (a sparse
    file of a huge apparent size).
    """

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.entries = self.chunks = self.json_bytes = 0
        self.largest: Entry | None = None

    def add(self, e: Entry) -> None:
        n = -(-e.size // self.chunk_size)
        self.entries += 1
        self.chunks += n
        self.json_bytes += len(e.path) + _JSON_PER_CHUNK * n  # a lower bound of what the entry adds
        if self.largest is None or e.size > self.largest.size:
            self.largest = e
        if self.entries > MAX_ENTRIES:
            raise ManifestError(
                f"the step has more than {MAX_ENTRIES} paths, more than a manifest may "
                "list: commit fewer files in one step"
            )
        if self.chunks > min(MAX_CHUNKS, MAX_BYTES // _JSON_PER_CHUNK):
            big = self.largest
            raise ManifestError(
                f"the step needs at least {self.chunks} chunks of {format_size(self.chunk_size)}, more than "
                f"a manifest can name ({min(MAX_CHUNKS, MAX_BYTES // _JSON_PER_CHUNK)}); its largest file "
                f"{short(big.path)} has a size of {big.size} bytes ({format_size(big.size)}, holes "
                "included): shrink it or leave it out of the step"
            )
        if self.json_bytes > MAX_BYTES:
            raise _too_large()


def _walk(top: Path, root: str, found: dict[str, Entry], files: dict[str, os.stat_result], tally: _Tally) -> None:
    pending = [root]
    while pending:
        rel = pending.pop()
        if rel in found:
            continue  # inside a root walked before: that walk covered its whole subtree
        st = os.lstat(top / rel)
        entry = _describe(top, rel, st)
        if entry is None:
            continue
        found[rel] = entry
        tally.add(entry)
        if entry.kind == "file":
            files[rel] = st
        elif entry.kind == "dir":
            pending.extend(f"{rel}/{name}" for name in os.listdir(top / rel))


def _describe(top: Path, rel: str, st: os.stat_result) -> Entry | None:
    """The entry of one path, a file's chunks not hashed yet."""
    if stat.S_ISDIR(st.st_mode):
        return _entry(rel, st, "dir")
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(top / rel)
        try:
            check_target(target)
        except ManifestError as e:
            log.warning("not backing up symlink %r: its %s, and no restore would recreate it", rel, e)
            return None
        return _entry(rel, st, "symlink", target=target)
    if stat.S_ISREG(st.st_mode):
        return _entry(rel, st, "file", size=st.st_size)
    return None


def _entry(rel: str, st: os.stat_result, kind: str, size: int = 0, target: str | None = None) -> Entry:
    return Entry(
        path=rel,
        kind=kind,
        mode=stat.S_IMODE(st.st_mode),
        uid=st.st_uid,
        gid=st.st_gid,
        size=size,
        mtime_ns=st.st_mtime_ns,
        target=target,
    )


def _file_chunks(
    path: Path, st: os.stat_result, chunk_size: int, known: dict[FileKey, list[str]] | None, pace: Callable[[], None]
) -> list[str]:
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    if known is not None and key in known:
        return list(known[key])
    hashes = chunks.hash_file(path, chunk_size, pace)
    if len(hashes) != -(-st.st_size // chunk_size) or os.lstat(path).st_size != st.st_size:
        raise ManifestError(f"{path} changed size while it was hashed: the snapshot is not frozen")
    if known is not None:
        known[key] = hashes
    return list(hashes)
