"""Parity parts this node holds for its erasure-coded group, summed where they are stored.

Data members send their parts in pieces and the holder adds ``C[j][slot] * piece`` into parity
part j's buffer at the piece's offset: no node gathers a stripe's D parts, and memory holds a
piece, not a part (the buffer is a file: only the piece's range is read, summed, written back).
A piece added twice cancels out (x ^ x = 0), so the ranges each slot gave are remembered: the
same piece again is ignored, one overlapping another differently refused. They live in memory
only, so a sum a stop interrupted is unknowable: ``load`` deletes it and ``received`` tells its
senders to send again. A complete sum's meta file, written atomically after its last byte, is
its commit point. ``add`` blocks on file I/O and the codec: callers run it in worker threads.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.coordination.view import MAX_RANK, MAX_STEP
from tierfs.core import manifest
from tierfs.core.atomic import UnsafeFile, private_dir, read_small, write_atomically
from tierfs.core.erasure import Code, accumulate
from tierfs.core.linux import pwrite_all
from tierfs.core.stripes import MAX_SHARD
from tierfs.store.chunkfiles import discard_file, scan

log = logging.getLogger(__name__)
MAX_READ = 64 << 20  # bytes of one read: what one answer of the peer protocol carries at most


class ParityError(Exception):
    """A piece or a request the parity store refuses; one line naming step/stripe."""


class NotHeldParity(ParityError):
    """The parity (or manifest copy) asked for is not held complete."""


@dataclass(eq=False)
class _Entry:
    """One parity buffer. Its lock orders the pieces of its sum; all but ``key`` and ``path`` is used under it."""

    key: tuple[int, int, int]
    path: Path
    lock: threading.Lock = field(default_factory=threading.Lock)
    length: int = 0  # of the file, counted in the store's held bytes: the longest part seen
    parts: dict[int, int] = field(default_factory=dict)  # slot -> its data part's whole length
    pieces: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # slot -> sorted [start, end)
    received: dict[int, int] = field(default_factory=dict)  # slot -> bytes summed in
    complete: bool = False
    gone: bool = False  # forgotten or dropped: its files are no longer this entry's


def _whole(what: str, value: object, high: int) -> int:
    if type(value) is not int or not 0 <= value <= high:
        raise ParityError(f"{what} {value!r} is not in 0..{high}")
    return value


def _ints(name: str, *highs: int) -> tuple[int, ...] | None:
    """The integers a file name was made of, each at most its bound; None for a name this module does not make."""
    fields = name.split(".")
    ok = len(fields) == len(highs) and all(f.isdecimal() and f == str(int(f)) for f in fields)
    return tuple(map(int, fields)) if ok and all(int(f) <= h for f, h in zip(fields, highs, strict=True)) else None


class ParityStore:
    """The parity parts this node holds for a group coded with ``code``, and the group's manifest copies.

    Under ``root``: ``parity/<step>.<stripe>.<j>`` (and its ``.json`` meta once complete) is
    parity part j of a stripe, ``manifests/<rank>.<step>`` a member's manifest. The room they
    take is the holder's to check first (against --capacity): this store only counts it.
    """

    def __init__(self, root: Path, code: Code):
        self.root, self.code = Path(root), code
        self._parity_dir = private_dir(self.root / "parity")
        self._manifest_dir = private_dir(self.root / "manifests")
        self._lock = threading.Lock()  # the indexes; nobody holding it waits for an entry's lock
        self._entries: dict[tuple[int, int, int], _Entry] = {}
        self._manifests: set[tuple[int, int]] = set()  # (rank, step)
        self._manifest_lock = threading.Lock()  # two writes of one copy would share its temporary file
        self._held = 0
        self._closed = False

    def load(self) -> None:
        """Keep what a previous daemon completed; delete the sums it was in the middle of."""
        with self._lock:
            self._entries, self._manifests, self._held = {}, set(), 0
            for f in sorted(scan(self._parity_dir), key=lambda f: f.name):  # a buffer before its meta
                if (key := self._parse(f.name)) is not None and (entry := self._load_entry(key, f)) is not None:
                    self._entries[key] = entry
                    self._held += entry.length
                elif (key := self._parse(f.name.removesuffix(".json"))) not in self._entries and (
                    key is not None or f.name.startswith(".tmp.")
                ):
                    discard_file(Path(f.path))  # an interrupted sum, its meta, a temporary file
            for f in scan(self._manifest_dir):
                if (copy := _ints(f.name, MAX_RANK, MAX_STEP)) and f.is_file(follow_symlinks=False):
                    self._manifests.add((copy[0], copy[1]))
                elif f.name.startswith(".tmp."):
                    discard_file(Path(f.path))

    def add(
        self, step: int, stripe: int, parity: int, slot: int, part_length: int, offset: int, data: bytes | memoryview
    ) -> bool:
        """Sum ``C[parity][slot] * data`` in at ``offset``; True once every data part (``part_length``
        bytes, so that any piece sizes the buffer and tells when its part is done) is in, whole."""
        key, where = self._key(step, stripe, parity, slot)
        _whole(f"{where}: part length", part_length, MAX_SHARD)
        view = memoryview(data).cast("B")
        end = _whole(f"{where}: offset", offset, MAX_SHARD) + len(view)
        if end > part_length or not (view or part_length == 0):  # an empty piece is an empty part's
            raise ParityError(f"{where}: {len(view)} bytes at {offset} do not fit slot {slot}'s {part_length}")
        with self._lock:
            if self._closed:
                raise ParityError(f"{where}: this node dropped the grouping it was summed under")
            path = self._parity_dir / "{}.{}.{}".format(*key)
            entry = self._entries.get(key) or self._entries.setdefault(key, _Entry(key, path))
        with entry.lock:
            if entry.gone:  # dropped while this piece waited: its sum starts again
                raise ParityError(f"{where}: dropped meanwhile, every part must be sent again")
            if entry.parts.get(slot, part_length) != part_length:
                raise ParityError(f"{where}: slot {slot}'s part is {entry.parts[slot]} bytes, not {part_length}")
            if entry.complete:
                return True  # every byte of every part is in: this piece's too
            pieces = entry.pieces.setdefault(slot, [])
            i = bisect.bisect_left(pieces, (offset, end))
            if i < len(pieces) and pieces[i] == (offset, end):
                return False
            if (i and pieces[i - 1][1] > offset) or (i < len(pieces) and pieces[i][0] < end):
                raise ParityError(f"{where}: slot {slot}'s bytes [{offset}, {end}) overlap a piece sent otherwise")
            grow, truncate = max(part_length - entry.length, 0), 0 if entry.parts else os.O_TRUNC
            with self._lock:
                self._held += grow
            entry.length += grow
            try:  # read, sum and write back the piece's range alone: memory holds a piece, not a part
                fd = os.open(entry.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | truncate, 0o600)
                try:
                    if os.fstat(fd).st_size < entry.length:
                        os.ftruncate(fd, entry.length)  # zeros, which the tmpfs takes pages for once written
                    if view:
                        acc = bytearray(os.pread(fd, len(view), offset))
                        accumulate(acc, view, self.code.parity_matrix[parity][slot])  # BadPart if the read was short
                        pwrite_all(fd, acc, offset)
                finally:
                    os.close(fd)
                entry.parts[slot] = part_length
                pieces.insert(i, (offset, end))
                entry.received[slot] = entry.received.get(slot, 0) + len(view)
                if entry.received == entry.parts and len(entry.parts) == self.code.d:
                    meta = json.dumps({"parts": [entry.parts[s] for s in range(self.code.d)]})
                    write_atomically(Path(f"{entry.path}.json"), meta)
                    entry.complete = True
                    entry.pieces.clear()
            except (OSError, ValueError) as e:  # the sum is unknowable now: start it again
                self._drop(entry)
                raise ParityError(f"{where}: {e}: dropped, every part must be sent again") from None
            return entry.complete

    def _drop(self, entry: _Entry) -> int:
        """Forget an entry and delete its files, the commit point first; with its lock held. The bytes freed."""
        if entry.gone:
            return 0
        entry.gone = True
        discard_file(Path(f"{entry.path}.json"))
        discard_file(entry.path)
        with self._lock:
            self._entries.pop(entry.key, None)  # this entry: another comes only once it is gone
            self._held -= entry.length
        return entry.length

    def growth(self, step: int, stripe: int, parity: int, part_length: int) -> int:
        """How many bytes a piece of a ``part_length``-byte part would grow its parity buffer by."""
        with self._lock:
            entry = self._entries.get((step, stripe, parity))
        return max(part_length - (entry.length if entry is not None else 0), 0)

    def complete(self, step: int, stripe: int, parity: int) -> bool:
        """Whether the parity part is held whole: what a repair may read."""
        with self._lock:
            entry = self._entries.get(self._key(step, stripe, parity)[0])
        return entry is not None and entry.complete and not entry.gone

    def length(self, step: int, stripe: int, parity: int) -> int:
        """The complete parity part's length: its stripe's, the longest of its data parts."""
        return self._complete(step, stripe, parity)[0].length

    def read(self, step: int, stripe: int, parity: int, offset: int, length: int) -> bytes:
        """Bytes of a complete parity part; past its end, the zeros of the stripe's virtual padding."""
        entry, where = self._complete(step, stripe, parity)
        _whole(f"{where}: offset", offset, MAX_SHARD)
        _whole(f"{where}: read length", length, MAX_READ)
        with entry.lock:
            if entry.gone:
                raise NotHeldParity(f"{where} is not held complete")
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                return os.pread(fd, max(min(length, entry.length - offset), 0), offset).ljust(length, b"\0")
            finally:
                os.close(fd)

    def received(self, step: int, stripe: int, parity: int, slot: int) -> int:
        """Bytes of the slot's part summed in so far: whether a sender that reconnects must send again."""
        key, where = self._key(step, stripe, parity, slot)
        with self._lock:
            entry = self._entries.get(key) or _Entry(key, Path())  # an entry nobody sent to has nothing
        with entry.lock:
            return 0 if entry.gone else (entry.parts if entry.complete else entry.received).get(slot, 0)

    def entries(self) -> dict[int, dict[tuple[int, int], bool]]:
        """step -> {(stripe, parity): complete}."""
        out: dict[int, dict[tuple[int, int], bool]] = {}
        with self._lock:
            for (step, stripe, parity), entry in sorted(self._entries.items()):
                if entry.parts:  # else its first piece was refused: nothing is summed
                    out.setdefault(step, {})[stripe, parity] = entry.complete
        return out

    def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        """Keep a group member's manifest: without it, its rebuilt shard is bytes without names."""
        path, where = self._manifest_path(rank, step)
        if len(data) > manifest.MAX_BYTES:
            raise ParityError(f"{where}: {len(data)} bytes, over {manifest.MAX_BYTES}")
        with self._manifest_lock:
            if self._closed:
                raise ParityError(f"{where}: this node dropped the grouping it was kept under")
            write_atomically(path, bytes(data))
            with self._lock:
                self._manifests.add((rank, step))

    def get_manifest(self, rank: int, step: int) -> bytes:
        path, where = self._manifest_path(rank, step)
        with self._lock:
            held = (rank, step) in self._manifests
        with contextlib.suppress(FileNotFoundError, UnsafeFile):  # dropped meanwhile
            if held:
                return read_small(path, manifest.MAX_BYTES, private=True)
        raise NotHeldParity(f"{where} is not held")

    def manifests(self) -> list[tuple[int, int]]:
        with self._lock:
            return sorted(self._manifests)

    def forget_before(self, step: int) -> int:
        """Drop the parity parts and manifest copies of the steps before ``step``; the parity bytes freed."""
        return self._forget_below(_whole("step", step, MAX_STEP))

    def _forget_below(self, step: int) -> int:
        with self._manifest_lock, self._lock:
            old = [entry for key, entry in self._entries.items() if key[0] < step]
            for rank, s in [copy for copy in self._manifests if copy[1] < step]:
                self._manifests.discard((rank, s))
                discard_file(self._manifest_path(rank, s)[0])
        freed = 0
        for entry in old:
            with entry.lock:
                freed += self._drop(entry)
        return freed

    def close(self) -> int:
        """Take no more pieces and drop everything held, once the sums in progress are done: the
        grouping they were summed under is gone. The parity bytes freed."""
        with self._manifest_lock, self._lock:
            self._closed = True
        return self._forget_below(MAX_STEP + 1)

    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def _key(self, step: int, stripe: int, parity: int, slot: int = 0) -> tuple[tuple[int, int, int], str]:
        """The entry's key, checked (and a data slot), and how messages name it."""
        _whole("parity step", step, MAX_STEP)
        _whole(f"parity step {step}: stripe", stripe, self.code.group.size - 1)
        _whole(f"parity step {step} stripe {stripe}: parity", parity, self.code.p - 1)
        _whole(f"parity step {step} stripe {stripe} parity {parity}: slot", slot, self.code.d - 1)
        return (step, stripe, parity), f"parity step {step} stripe {stripe} parity {parity}"

    def _manifest_path(self, rank: int, step: int) -> tuple[Path, str]:
        _whole("manifest rank", rank, MAX_RANK)
        _whole(f"manifest of rank {rank}: step", step, MAX_STEP)
        return self._manifest_dir / f"{rank}.{step}", f"manifest of rank {rank} step {step}"

    def _complete(self, step: int, stripe: int, parity: int) -> tuple[_Entry, str]:
        key, where = self._key(step, stripe, parity)
        with self._lock:
            entry = self._entries.get(key)
        if entry is None or not entry.complete or entry.gone:
            raise NotHeldParity(f"{where} is not held complete")
        return entry, where

    def _parse(self, name: str) -> tuple[int, int, int] | None:
        fields = _ints(name, MAX_STEP, self.code.group.size - 1, self.code.p - 1)
        return None if fields is None else (fields[0], fields[1], fields[2])

    def _load_entry(self, key: tuple[int, int, int], f: os.DirEntry[str]) -> _Entry | None:
        """The complete entry whose buffer ``f`` is; None if its meta is missing or does not match it."""
        try:
            parts = json.loads(read_small(Path(f"{f.path}.json"), 4096, private=True))["parts"]
            if not (isinstance(parts, list) and len(parts) == self.code.d and f.is_file(follow_symlinks=False)):
                raise ValueError("not a buffer and its lengths")
            if not all(type(n) is int and 0 <= n <= MAX_SHARD for n in parts) or f.stat().st_size != max(parts):
                raise ValueError("lengths that do not match its buffer")
        except FileNotFoundError:
            return None  # a sum a stop interrupted: the usual case, not worth a warning
        except (OSError, ValueError, KeyError, TypeError, UnsafeFile) as e:
            log.warning("parity store: dropping %s: %s", f.path, e)
            return None
        return _Entry(key, Path(f.path), length=max(parts), parts=dict(enumerate(parts)), complete=True)
