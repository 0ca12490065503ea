"""Manifests: what one rank committed at one step.

A manifest lists every path of one (job, rank, step) checkpoint with all it takes to
recreate it exactly: type, permission bits, owner, size, mtime, symlink target, and the
names of each file's chunks. It is written last on every tier, after every chunk it names,
so its presence on a tier is the commit point there: whoever finds a manifest can fetch
the whole checkpoint.

Manifests come back from peers and buckets and restoring one creates files, so parsing
trusts nothing: a manifest that could write outside the volume root, through a symlink,
or that disagrees with itself is refused before any of it is used. So is one larger than
the limits below, which are far beyond any real checkpoint and keep a hostile one from
costing the daemon its memory, and one with a number no system call accepts. Symlink
targets are relative and never climb (no ``..``), so a restored link only ever points
below its own directory. Restoring never sets set-uid, set-gid, or sticky on a file
(:func:`restorable_mode`): the daemon is root, the manifest's author may not be.

A node with the job's secret stores every manifest *sealed* (:func:`seal`): the JSON, then
one line ``hmac-sha256 <64 hex>`` whose MAC binds the job, rank and step to the exact
bytes. Anyone who can write to a bucket can write well-formed manifests; only holders of
the secret can seal them, and :func:`authenticate` is what a reader asks before it uses
one (docs/formats.md, "Sealed manifests").
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar, overload

from tierfs.core import bounded_json, chunks
from tierfs.core.errors import UserError
from tierfs.core.keys import ManifestKeys
from tierfs.core.parse import check_job_id

FORMAT_VERSION = 1
KINDS = ("file", "dir", "symlink")

MAX_BYTES = 64 << 20  # a manifest's JSON (the peer protocol carries no larger one either)
MAX_DEPTH = 16  # lists and objects inside one another: a manifest nests 4 (object, entries, entry, chunks)
MAX_ENTRIES = 1 << 20  # paths in one manifest
MAX_CHUNKS = 1 << 21  # chunk names in one manifest: 8 TiB of 4 MiB chunks per rank
MAX_PATH = 4096  # bytes in a path or symlink target (Linux PATH_MAX)
MAX_NAME = 255  # bytes in one path component (Linux NAME_MAX)
MAX_RANK = (1 << 31) - 1
MAX_STEP = (1 << 63) - 1
MAX_ID = (1 << 32) - 2  # uid/gid: 2**32 - 1 is chown's "leave as it is"
MAX_NS = (1 << 63) - 1  # mtime_ns: what utime takes

_HASH_RE = re.compile(r"[0-9a-f]{32}")
_SEAL_ID_RE = re.compile(r"[0-9a-f]{16}")
_MAC_PREFIX = b"\nhmac-sha256 "
_MAC_RE = re.compile(rb"\nhmac-sha256 ([0-9a-f]{64})\n\Z")
MAC_LINE = len(_MAC_PREFIX) + 64 + 1  # the bytes a seal adds
_MAC_LABEL = b"tierfs manifest v1\0"


class ManifestError(Exception):
    """A manifest that is malformed, inconsistent, unsafe, or from a newer tierfs."""


class Unauthenticated(ManifestError):
    """A manifest that this job's secrets did not seal for the (rank, step) it is read as."""


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
    # The seal (core.bucket_seal) its chunks are under in buckets, by id; "": in clear, as
    # before sealing existed, and as a node without the job's secret stores them. Readers
    # older than this field ignore it.
    chunk_seal: str = ""

    def to_json(self) -> bytes:
        """Equal manifests give equal bytes, so they can be compared and hashed as stored.

        Output is ASCII: names that are not UTF-8 travel as escaped surrogates and come
        back from ``os.fsencode`` as the original bytes.
        """
        # vars(), not asdict(): the same fields without asdict's deep copy, which costs more
        # than the encoding itself for a step of thousands of files.
        obj = {**vars(self), "entries": [vars(e) for e in self.entries]}
        if not self.chunk_seal:
            del obj["chunk_seal"]  # chunks in clear: the bytes a release before sealing wrote
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

    def sealed(self, keys: ManifestKeys | None) -> bytes:
        """The bytes every tier stores: :meth:`to_json`, sealed when the node has a secret."""
        return seal(self.to_json(), keys, self.rank, self.step)

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest from another machine: nothing in it is used before it is checked.

        A seal's MAC line is taken off, not checked: a reader that has not trusted the
        bytes yet asks :func:`authenticate` first.
        """
        data = split_seal(data)[0]
        if len(data) > MAX_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes is larger than {MAX_BYTES} bytes")
        try:
            obj = bounded_json.load(data, MAX_DEPTH)
        except bounded_json.TooDeep as e:
            raise ManifestError(f"manifest is not a manifest: its JSON {e}") from None
        except ValueError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ManifestError("manifest is not a JSON object")
        version = _get(obj, "format", int, "manifest")
        if version > FORMAT_VERSION:
            raise ManifestError(
                f"manifest format {version} is newer than this tierfs supports ({FORMAT_VERSION}): upgrade tierfs"
            )
        if version < 1:
            raise ManifestError(f"manifest format {version} does not exist")
        entries = _get(obj, "entries", list, "manifest")
        roots = _get(obj, "roots", list, "manifest")
        if max(len(entries), len(roots)) > MAX_ENTRIES:
            raise ManifestError(f"manifest has more than {MAX_ENTRIES} entries or roots")
        manifest = cls(
            job=_get(obj, "job", str, "manifest"),
            rank=_get(obj, "rank", int, "manifest"),
            step=_get(obj, "step", int, "manifest"),
            chunk_size=_get(obj, "chunk_size", int, "manifest"),
            roots=roots,
            entries=[_parse_entry(e) for e in entries],
            created=_get(obj, "created", (int, float), "manifest"),
            format=version,
            chunk_seal=_get(obj, "chunk_seal", str, "manifest") if "chunk_seal" in obj else "",
        )
        manifest.validate()
        return manifest

    def check_identity(self, job: str, rank: int, step: int) -> None:
        """Refuse a manifest that is not the one asked for.

        Tiers file manifests by name, and a name is only a claim: a hostile bucket writer
        or peer could otherwise serve rank 2's files as rank 3's, or step 5 as step 9.
        """
        if (self.job, self.rank, self.step) != (job, rank, step):
            raise ManifestError(
                f"it is job {self.job!r} rank {self.rank} step {self.step}, "
                f"not job {job!r} rank {rank} step {step} as asked"
            )

    def chunk_set(self) -> set[str]:
        """Every chunk the checkpoint needs: what must be on a tier before the manifest."""
        return {h for e in self.entries for h in e.chunks}

    def chunk_places(self) -> dict[str, tuple[str, int, int]]:
        """Every distinct chunk's first place, (file path, offset, length), in the order the files need them."""
        cs, places = self.chunk_size, {}
        for e in self.entries:
            for i, h in enumerate(e.chunks):
                if h not in places:
                    places[h] = (e.path, i * cs, min(cs, e.size - i * cs))
        return places

    def chunk_sizes(self) -> dict[str, int]:
        """Every chunk's length, in the order the files need them."""
        return {h: length for h, (_, _, length) in self.chunk_places().items()}

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries if e.kind == "file")

    def nonzero_bytes(self) -> int:
        """The bytes of every chunk place that is not all zeros: the most a restore writes.

        A chunk of zeros stays a hole of its placeholder, so a sparse file restores into the
        RAM its data takes, not its size.
        """
        cs, zero = self.chunk_size, chunks.zero_hash(self.chunk_size)
        total = 0
        for e in self.entries:
            if e.chunks:
                last = e.size - (len(e.chunks) - 1) * cs  # the last chunk may be short
                total += cs * sum(h != zero for h in e.chunks[:-1])
                total += 0 if e.chunks[-1] == chunks.zero_hash(last) else last
        return total

    @property
    def unique_chunk_count(self) -> int:
        return len(self.chunk_set())

    def validate(self) -> None:
        """Refuse a manifest that could write outside the volume root, or that disagrees with itself."""
        try:
            check_job_id(self.job)
        except UserError:
            raise ManifestError(f"manifest: invalid job id {self.job[:200]!r}") from None
        if not (
            0 <= self.rank <= MAX_RANK and 0 <= self.step <= MAX_STEP and 0 < self.chunk_size <= chunks.MAX_CHUNK_SIZE
        ):
            raise ManifestError(f"manifest: invalid rank {self.rank}, step {self.step} or chunk size {self.chunk_size}")
        if max(len(self.entries), len(self.roots)) > MAX_ENTRIES:
            raise ManifestError(f"manifest has more than {MAX_ENTRIES} entries or roots")
        if self.chunk_seal and not _SEAL_ID_RE.fullmatch(self.chunk_seal):
            raise ManifestError(f"manifest: invalid chunk seal {self.chunk_seal[:40]!r}")
        if sum(len(e.chunks) for e in self.entries) > MAX_CHUNKS:
            raise ManifestError(f"manifest names more than {MAX_CHUNKS} chunks")
        kinds: dict[str, str] = {}
        previous = ""
        for e in self.entries:
            check_path(e.path, "entry")
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
            check_path(root, "root")
            if root not in kinds:
                raise ManifestError(f"root {root!r} has no entry")


def seal(body: bytes, keys: ManifestKeys | None, rank: int, step: int) -> bytes:
    """A manifest's JSON as stored: followed by its MAC line, or as it is without keys."""
    if keys is None:
        return body
    data = b"%s%s%s\n" % (body, _MAC_PREFIX, _mac(keys.seal, keys.job, rank, step, body).encode())
    if len(data) > MAX_BYTES:
        raise ManifestError(f"manifest of rank {rank} step {step} is larger than {MAX_BYTES} bytes once sealed")
    return data


def authenticate(data: bytes, keys: ManifestKeys | None, rank: int, step: int) -> bytes:
    """The JSON of a stored manifest if one of ``keys`` sealed it as ``keys.job``'s (rank, step).

    Checked before a byte of it is parsed. Without keys (a node without a secret) nothing
    can be checked: the JSON is returned, sealed or not. Raises :class:`Unauthenticated`.
    """
    body, mac = split_seal(data)
    if keys is None:
        return body
    if mac is None:
        raise Unauthenticated("it is not sealed (no MAC line): it was not written by a node with this job's secret")
    if not any(hmac.compare_digest(_mac(key, keys.job, rank, step, body), mac) for key in keys.accept):
        raise Unauthenticated(
            f"its MAC does not verify: it was not sealed with this job's secret as rank {rank} step {step}"
        )
    return body


def split_seal(data: bytes) -> tuple[bytes, str | None]:
    """(JSON, MAC in hex or ``None``), nothing checked: a seal is one line after the JSON, which holds no newline."""
    m = _MAC_RE.search(data, max(0, len(data) - MAC_LINE))
    return (data[: m.start()], m[1].decode()) if m else (data, None)


def _mac(key: bytes, job: str, rank: int, step: int, body: bytes) -> str:
    """HMAC-SHA256 over the label, the job, rank and step the manifest is stored as, and its JSON."""
    mac = hmac.new(key, b"%s%s\0%d\0%d\0" % (_MAC_LABEL, job.encode(), rank, step), hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


_T = TypeVar("_T")
_U = TypeVar("_U")


@overload
def _get(obj: Mapping[str, object], key: str, kind: type[_T], where: str) -> _T: ...
@overload
def _get(obj: Mapping[str, object], key: str, kind: tuple[type[_T], type[_U]], where: str) -> _T | _U: ...
def _get(obj: Mapping[str, object], key: str, kind: type | tuple[type, ...], where: str) -> object:
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
    where = f"entry {short(path)}"
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


def check_path(path: object, what: str) -> None:
    """Refuse a path that could leave the volume root or name one file two ways."""
    if not isinstance(path, str):
        raise ManifestError(f"{what} {path!r} is not a string")
    parts = path.split("/")
    problem = _name_problem(path)
    if problem is None:
        if "" in parts or "." in parts:
            problem = "is not normalized"
        else:
            return
    raise ManifestError(f"{what} path {short(path)} {problem}")


def check_target(target: str) -> None:
    """Refuse a symlink target that is absolute or climbs: a restored link stays below its directory.

    Links that obey this can only lead to other paths below the volume root, however they
    chain, so nothing that follows a restored link (the job, a later backup) is led out.
    """
    problem = _name_problem(target)
    if problem is not None:
        raise ManifestError(f"symlink target {short(target)} {problem}")


def _name_problem(path: str) -> str | None:
    """What makes ``path`` unfit to name something below the volume root, if anything."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "contains NUL"
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError:
        return "is not a file name (it has unpaired surrogates)"
    if len(encoded) > MAX_PATH:
        return f"is longer than {MAX_PATH} bytes"
    if path.startswith("/"):
        return "is absolute"
    parts = encoded.split(b"/")
    if b".." in parts:
        return "has a '..' component"
    if max(map(len, parts)) > MAX_NAME:
        return f"has a component longer than {MAX_NAME} bytes"
    return None


def short(text: str) -> str:
    """A value for a one-line message: quoted, and cut if long."""
    return repr(text) if len(text) <= 100 else f"{text[:100]!r}... ({len(text)} characters)"


def restorable_mode(e: Entry) -> int:
    """The permission bits a restore gives ``e``: set-uid and set-gid never, sticky on directories only.

    The daemon restores as root with the manifest's owner, so honouring these bits would
    let anyone who can write to the bucket, or speak for a peer, plant a set-uid-root file.
    """
    mode = stat.S_IMODE(e.mode) & ~(stat.S_ISUID | stat.S_ISGID)
    return mode if e.kind == "dir" else mode & ~stat.S_ISVTX


def _check_entry(e: Entry, chunk_size: int) -> None:
    where = f"entry {short(e.path)}"
    if e.kind not in KINDS:
        raise ManifestError(f"{where}: unknown kind {e.kind!r}")
    if not 0 <= e.mode <= 0o7777:
        raise ManifestError(f"{where}: mode {e.mode:#o} is not permission bits")
    if not (0 <= e.uid <= MAX_ID and 0 <= e.gid <= MAX_ID):
        raise ManifestError(f"{where}: uid {e.uid} or gid {e.gid} is not between 0 and {MAX_ID}")
    if e.size < 0:
        raise ManifestError(f"{where}: negative size")
    if not -MAX_NS <= e.mtime_ns <= MAX_NS:
        raise ManifestError(f"{where}: mtime_ns {e.mtime_ns} is out of range")
    if (e.target is not None) != (e.kind == "symlink"):
        raise ManifestError(f"{where}: a symlink needs a target and nothing else has one")
    if e.target is not None:
        check_target(e.target)
    if e.kind != "file" and e.size:
        raise ManifestError(f"{where}: a {e.kind} has no size")
    expected = -(-e.size // chunk_size)
    if len(e.chunks) != expected:
        raise ManifestError(
            f"{where}: {len(e.chunks)} chunks for {e.size} bytes, expected {expected} of {chunk_size} bytes"
        )
    for h in e.chunks:
        if not isinstance(h, str) or not _HASH_RE.fullmatch(h):
            raise ManifestError(f"{where}: {h!r} is not a chunk hash")
