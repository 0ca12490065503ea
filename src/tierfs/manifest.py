"""Manifests: what one rank committed at one step.

A manifest lists every path of one (job, rank, step) checkpoint with all it takes to
recreate it exactly: type, permission bits, owner, size, mtime, symlink target, and the
names of each file's chunks. It is written last on every tier, after every chunk it names,
so its presence on a tier is the commit point there: whoever finds a manifest can fetch
the whole checkpoint.

Manifests come back from peers and buckets and restoring one creates files, so parsing
trusts nothing: a manifest that could write outside the volume root, through a symlink,
or that disagrees with itself is refused before any of it is used.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierfs import chunks

FORMAT_VERSION = 1
KINDS = ("file", "dir", "symlink")

_HASH_RE = re.compile(r"[0-9a-f]{32}")

FileKey = tuple[int, int, int]  # (st_ino, st_size, st_mtime_ns)


class ManifestError(Exception):
    """A manifest that is malformed, inconsistent, unsafe, or from a newer tierfs."""


@dataclass
class Entry:
    """One path of the checkpoint, relative to the volume root."""

    path: str
    kind: str  # one of KINDS
    mode: int  # stat.S_IMODE: permissions with setuid, setgid and sticky
    uid: int
    gid: int
    size: int  # 0 unless a file
    mtime_ns: int
    target: str | None = None  # symlinks only
    chunks: list[str] = field(default_factory=list)  # files only, in order


@dataclass
class Manifest:
    """One rank's checkpoint at one step, as committed."""

    job: str
    rank: int
    step: int
    chunk_size: int
    roots: list[str]  # the committed paths the step consists of
    entries: list[Entry]  # sorted by path, so parents come before their children
    created: float
    format: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        """Equal manifests give equal bytes, so they can be compared and hashed as stored.

        Output is ASCII: names that are not UTF-8 travel as escaped surrogates and come
        back from ``os.fsencode`` as the original bytes.
        """
        # vars(), not asdict(): the same fields without asdict's deep copy, which costs more
        # than the encoding itself for a step of thousands of files.
        obj = {**vars(self), "entries": [vars(e) for e in self.entries]}
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest from another machine: nothing in it is used before it is checked."""
        try:
            obj = json.loads(data)
        except ValueError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ManifestError("manifest is not a JSON object")
        version = _get(obj, "format", int, "manifest")
        if version > FORMAT_VERSION:
            raise ManifestError(f"manifest format {version} is newer than this tierfs "
                                f"supports ({FORMAT_VERSION}): upgrade tierfs")
        if version < 1:
            raise ManifestError(f"manifest format {version} does not exist")
        manifest = cls(
            job=_get(obj, "job", str, "manifest"),
            rank=_get(obj, "rank", int, "manifest"),
            step=_get(obj, "step", int, "manifest"),
            chunk_size=_get(obj, "chunk_size", int, "manifest"),
            roots=_get(obj, "roots", list, "manifest"),
            entries=[_parse_entry(e) for e in _get(obj, "entries", list, "manifest")],
            created=_get(obj, "created", (int, float), "manifest"),
            format=version,
        )
        manifest._validate()
        return manifest

    def chunk_set(self) -> set[str]:
        """Every chunk the checkpoint needs: what must be on a tier before the manifest."""
        return {h for e in self.entries for h in e.chunks}

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "file")

    @property
    def unique_chunk_count(self) -> int:
        return len(self.chunk_set())

    def _validate(self) -> None:
        if self.rank < 0 or self.step < 0 or self.chunk_size <= 0:
            raise ManifestError(f"manifest: invalid rank {self.rank}, step {self.step} "
                                f"or chunk size {self.chunk_size}")
        kinds: dict[str, str] = {}
        previous = ""
        for e in self.entries:
            _check_path(e.path, "entry")
            if e.path in kinds:
                raise ManifestError(f"duplicate path {e.path!r}")
            if e.path < previous:
                raise ManifestError(f"entries are not sorted by path: {e.path!r} after {previous!r}")
            # An entry below a symlink would be restored through it, outside the volume root.
            parent = e.path.rpartition("/")[0]
            if parent and kinds.get(parent) != "dir":
                raise ManifestError(f"entry {e.path!r}: parent {parent!r} is not a directory entry")
            _check_entry(e, self.chunk_size)
            kinds[e.path], previous = e.kind, e.path
        for root in self.roots:
            _check_path(root, "root")
            if root not in kinds:
                raise ManifestError(f"root {root!r} has no entry")


def _get(obj: dict, key: str, kind: type | tuple[type, ...], where: str):
    if key not in obj:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = obj[key]
    # bool is an int to isinstance, never to a manifest.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ManifestError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _parse_entry(obj: object) -> Entry:
    if not isinstance(obj, dict):
        raise ManifestError("manifest: an entry is not a JSON object")
    path = _get(obj, "path", str, "entry")
    where = f"entry {path!r}"
    return Entry(
        path=path,
        kind=_get(obj, "kind", str, where),
        mode=_get(obj, "mode", int, where),
        uid=_get(obj, "uid", int, where),
        gid=_get(obj, "gid", int, where),
        size=_get(obj, "size", int, where),
        mtime_ns=_get(obj, "mtime_ns", int, where),
        target=_get(obj, "target", (str, type(None)), where),
        chunks=_get(obj, "chunks", list, where),
    )


def _check_path(path: object, what: str) -> None:
    """Refuse a path that could leave the volume root or name one file two ways."""
    if not isinstance(path, str):
        raise ManifestError(f"{what} {path!r} is not a string")
    parts = path.split("/")
    if not path:
        problem = "is empty"
    elif path.startswith("/"):
        problem = "is absolute"
    elif ".." in parts:
        problem = "has a '..' component"
    elif "" in parts or "." in parts or "\0" in path:
        problem = "is not normalized"
    else:
        return
    raise ManifestError(f"{what} path {path!r} {problem}")


def _check_entry(e: Entry, chunk_size: int) -> None:
    where = f"entry {e.path!r}"
    if e.kind not in KINDS:
        raise ManifestError(f"{where}: unknown kind {e.kind!r}")
    if not 0 <= e.mode <= 0o7777:
        raise ManifestError(f"{where}: mode {e.mode:#o} is not permission bits")
    if min(e.uid, e.gid, e.size) < 0:
        raise ManifestError(f"{where}: negative uid, gid or size")
    if (e.target is not None) != (e.kind == "symlink"):
        raise ManifestError(f"{where}: a symlink needs a target and nothing else has one")
    if e.kind != "file" and e.size:
        raise ManifestError(f"{where}: a {e.kind} has no size")
    expected = -(-e.size // chunk_size)
    if len(e.chunks) != expected:
        raise ManifestError(f"{where}: {len(e.chunks)} chunks for {e.size} bytes, "
                            f"expected {expected} of {chunk_size} bytes")
    for h in e.chunks:
        if not isinstance(h, str) or not _HASH_RE.fullmatch(h):
            raise ManifestError(f"{where}: {h!r} is not a chunk hash")


def build(snapshot_root: Path, roots: list[str], *, job: str, rank: int, step: int,
          chunk_size: int, known: dict[FileKey, list[str]] | None = None) -> Manifest:
    """Describe the committed ``roots`` of a snapshot tree that nothing writes to any more.

    Symlinks are recorded, never followed; fifos, sockets and devices are skipped, since no
    checkpoint format writes them. Hard links become separate files: their chunks are the
    same, so they cost nothing extra. The ancestors of each root are recorded too, so a
    restore recreates their modes and owners as well.

    ``known`` caches chunk lists by ``(st_ino, st_size, st_mtime_ns)``. Passing the same
    dict for every step of one volume hashes a file that outlives several steps once, not
    once per step, as long as it keeps its inode (the same file, or hard links to it); hard
    links within one step are hashed once too. It is filled in as files are hashed. Keep one
    per filesystem and chunk size: the key holds neither.
    """
    top = Path(snapshot_root)
    ancestors: dict[str, Entry] = {}
    found: dict[str, Entry] = {}
    for root in roots:
        _check_path(root, "root")
        parts = root.split("/")
        for depth in range(1, len(parts)):
            path = "/".join(parts[:depth])
            if path not in ancestors:
                st = os.lstat(top / path)
                if not stat.S_ISDIR(st.st_mode):
                    raise ManifestError(f"root {root!r}: {path!r} is not a directory")
                ancestors[path] = _describe(top, path, st, chunk_size, known)
        _walk(top, root, found, chunk_size, known)
        if root not in found:
            raise ManifestError(f"root {root!r} is not a file, directory or symlink")
    entries = sorted({**ancestors, **found}.values(), key=lambda e: e.path)
    return Manifest(job=job, rank=rank, step=step, chunk_size=chunk_size, roots=list(roots),
                    entries=entries, created=time.time())


def _walk(top: Path, root: str, found: dict[str, Entry], chunk_size: int,
          known: dict[FileKey, list[str]] | None) -> None:
    pending = [root]
    while pending:
        rel = pending.pop()
        if rel in found:
            continue  # inside a root walked before: that walk covered its whole subtree
        entry = _describe(top, rel, os.lstat(top / rel), chunk_size, known)
        if entry is None:
            continue
        found[rel] = entry
        if entry.kind == "dir":
            pending.extend(f"{rel}/{name}" for name in os.listdir(top / rel))


def _describe(top: Path, rel: str, st: os.stat_result, chunk_size: int,
              known: dict[FileKey, list[str]] | None) -> Entry | None:
    common = dict(path=rel, mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                  mtime_ns=st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        return Entry(kind="dir", size=0, **common)
    if stat.S_ISLNK(st.st_mode):
        return Entry(kind="symlink", size=0, target=os.readlink(top / rel), **common)
    if stat.S_ISREG(st.st_mode):
        return Entry(kind="file", size=st.st_size,
                     chunks=_file_chunks(top / rel, st, chunk_size, known), **common)
    return None


def _file_chunks(path: Path, st: os.stat_result, chunk_size: int,
                 known: dict[FileKey, list[str]] | None) -> list[str]:
    key = (st.st_ino, st.st_size, st.st_mtime_ns)
    if known is not None and key in known:
        return list(known[key])
    hashes = chunks.hash_file(path, chunk_size)
    if len(hashes) != -(-st.st_size // chunk_size):
        raise ManifestError(f"{path} changed size while it was hashed: the snapshot is not frozen")
    if known is not None:
        known[key] = hashes
    return list(hashes)
