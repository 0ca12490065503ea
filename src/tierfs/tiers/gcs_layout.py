"""Where a job's objects lie in the bucket, and what they hold, as names and bytes.

Layout (with an empty PREFIX, names start at ``<job>/``)::

    <prefix>/<job>/chunks/<k[0:2]>/<k>                      a chunk: sealed (core.bucket_seal), its key
                                                             64 hex digits; or a frame in clear, its
                                                             key the chunk's hash (32 digits)
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.json     a manifest; its presence commits step S
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.pending  an upload in progress: JSON list of
                                                             the chunk keys it will reference
    <prefix>/<job>/aside/to-<N:012d>/manifests/rank-<R>/step-<S:012d>.json
                                                             a manifest of a timeline abandoned by
                                                             the rollback to step N, byte for byte:
                                                             no listing counts it, the collector
                                                             keeps its chunks until it is discarded
    <prefix>/<job>/rollbacks/to-<N:012d>.json                the rollback to step N: {"step": N};
                                                             its creation time (GCS's clock) is when
                                                             the job went back, for every node

Apart from the requests because the names are the format: a listing, an upload and the
collector must agree on them to the character. A name counts only when it is exactly the
one this module gives for its numbers (:func:`manifest_object`); another spelling of a
number names an object nothing would read or delete, and a planted one would win
retention and be chosen as the step to restore. What an object holds is parsed here too,
and anything else is :class:`~tierfs.tiers.gcs_http.CorruptObject`: nothing read from the
bucket is trusted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import NamedTuple

from google.cloud import storage

from tierfs.tiers.gcs_http import CorruptObject

USED_KEY = "tierfs-used"  # chunk metadata: unix time of the last touch

_HASH_RE = re.compile(r"[0-9a-f]{32}")
_KEY_RE = re.compile(r"[0-9a-f]{32}(?:[0-9a-f]{32})?")  # a chunk's hash, or a sealed chunk's key
_SEAL_RE = re.compile(rb'^\{"chunk_seal":"([0-9a-f]{16})"')
_SEAL_ID_RE = re.compile(r"[0-9a-f]{16}")
# Candidates only (digit counts keep int() cheap); a name counts once it is exactly the one
# manifest_name gives for its numbers.
_MANIFEST_RE = re.compile(r"rank-([0-9]{1,10})/step-([0-9]{1,19})\.(json|pending)")
_ASIDE_RE = re.compile(r"to-([0-9]{12,19})/")
_ROLLBACK_RE = re.compile(r"to-([0-9]{12,19})\.json")


class ChunkInfo(NamedTuple):
    """One chunk object as a listing saw it: enough to decide, and to delete only that version."""

    key: str  # the object's key: the chunk's hash in clear, or its sealed key
    size: int
    updated: float  # unix time the chunk was last written or touched
    metageneration: int


class ManifestListing(dict[int, list[int]]):
    """Committed steps by rank, oldest first, as a listing saw them: a plain mapping to every
    caller, with when each step was committed as far as the listing tells (:attr:`created`).

    That is the manifest object's creation time (``timeCreated``, GCS's clock): a manifest
    is put once, when its step is uploaded, right after the commit (or a backup interval
    later), and never patched. A manifest put again counts from then; None where the
    listing does not say.
    """

    def __init__(self, steps: dict[int, list[int]], created: dict[tuple[int, int], float | None]):
        super().__init__(steps)
        self.created = created  # (rank, step) -> unix time, or None


def job_base(prefix: str, job: str) -> str:
    """Where the job's objects start: ``<prefix>/<job>/``, or ``<job>/`` without a prefix."""
    if not job or "/" in job:
        raise ValueError(f"invalid job id {job!r}")
    return f"{prefix}/{job}/" if prefix else f"{job}/"


def chunk_name(base: str, key: str) -> str:
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"not a chunk key: {key!r}")
    return f"{base}chunks/{key[:2]}/{key}"


def manifest_name(base: str, rank: int, step: int, kind: str) -> str:
    if rank < 0 or step < 0:
        raise ValueError(f"invalid rank {rank} or step {step}")
    return f"{base}manifests/rank-{rank}/step-{step:012d}.{kind}"


def manifest_object(base: str, name: str) -> tuple[int, int, str] | None:
    """(rank, step, kind) of a manifest or marker name exactly as :func:`manifest_name` writes it, else None."""
    m = _MANIFEST_RE.fullmatch(name, len(f"{base}manifests/"))
    if m and name == manifest_name(base, int(m[1]), int(m[2]), m[3]):
        return int(m[1]), int(m[2]), m[3]
    return None


def aside_base(base: str, to: int) -> str:
    """Where the manifests the rollback to step ``to`` set aside start: :func:`manifest_name`
    under it names each one as the job's own (same rank and step, so seals still verify)."""
    if to < 0:
        raise ValueError(f"invalid step {to}")
    return f"{base}aside/to-{to:012d}/"


def aside_object(base: str, name: str) -> tuple[int, int, int] | None:
    """(to, rank, step) of a set-aside manifest's name exactly as :func:`aside_base` and
    :func:`manifest_name` write it, else None (as :func:`manifest_object` for the active ones)."""
    m = _ASIDE_RE.match(name, len(f"{base}aside/"))
    if not (m and name.startswith(base)):
        return None
    under = aside_base(base, int(m[1]))
    found = manifest_object(under, name) if name.startswith(under) else None
    return (int(m[1]), found[0], found[1]) if found is not None and found[2] == "json" else None


def rollback_name(base: str, step: int) -> str:
    """The record of the rollback to ``step``: one per step, created once (its time is the record)."""
    if step < 0:
        raise ValueError(f"invalid step {step}")
    return f"{base}rollbacks/to-{step:012d}.json"


def rollback_of(base: str, name: str) -> int | None:
    """The step a rollback record's name is of, exactly as :func:`rollback_name` writes it, else None."""
    m = _ROLLBACK_RE.fullmatch(name, len(f"{base}rollbacks/"))
    return int(m[1]) if m and name == rollback_name(base, int(m[1])) else None


def rollback_record(step: int) -> bytes:
    """What the record of the rollback to ``step`` holds: only the step (its name says it too)."""
    return json.dumps({"step": step}).encode()


def parse_rollback(data: bytes, url: str, step: int) -> None:
    """Check that a rollback record holds exactly what :func:`rollback_record` writes for ``step``."""
    if data != rollback_record(step):
        raise CorruptObject(f"{url} is not the record of the rollback to step {step}")


def chunk_of(prefix: str, name: str) -> str | None:
    """The key a name under ``chunks/`` (``prefix``) is the object of, None for any other name."""
    shard, _, key = name[len(prefix) :].partition("/")
    return key if _KEY_RE.fullmatch(key) and shard == key[:2] else None


def last_used(blob: storage.Blob) -> float:
    """When the chunk was last written or touched.

    GCS moves ``updated`` on every metadata patch, so the touch stamp adds nothing there;
    fake-gcs-server does not, and the stamp stands in. A stamp from a fast clock keeps a
    chunk longer, never shorter.
    """
    updated: float = blob.updated.timestamp()
    try:
        return max(updated, float((blob.metadata or {}).get(USED_KEY, 0)))
    except ValueError:
        return updated


def pending_marker(keys: Iterable[str]) -> bytes:
    """An upload marker's content: the chunk objects the upload will reference, each once."""
    return json.dumps(sorted(set(keys))).encode()


def parse_pending(data: bytes, url: str) -> set[str]:
    try:
        keys = json.loads(data)
    except (ValueError, RecursionError):
        keys = None
    if not isinstance(keys, list) or not all(isinstance(k, str) and _KEY_RE.fullmatch(k) for k in keys):
        raise CorruptObject(f"{url} is not a JSON list of chunk keys")
    return set(keys)


def parse_manifest_chunks(data: bytes, url: str) -> tuple[str, set[str]]:
    """The seal a manifest's chunks are under ("": in clear) and the chunks it names; only
    ``chunk_seal`` and ``entries[].chunks`` matter to the collector."""
    try:
        obj = json.loads(data)
        entries, seal = obj["entries"], obj.get("chunk_seal", "")
        hashes = {h for entry in entries for h in entry.get("chunks", ())}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CorruptObject(f"{url} is not a manifest: its chunks cannot be told") from None
    if not all(is_hash(h) for h in hashes):
        raise CorruptObject(f"{url} names something that is not a chunk hash")
    if seal != "" and not (isinstance(seal, str) and _SEAL_ID_RE.fullmatch(seal)):
        raise CorruptObject(f"{url} names something that is not a chunk seal")
    return seal, hashes


def chunk_seal_of(data: bytes) -> str:
    """The seal id a manifest's JSON names (``""``: chunks in clear), without parsing it all:
    its keys are sorted and compact (:meth:`tierfs.core.manifest.Manifest.to_json`), so the
    field, when there, opens the object."""
    m = _SEAL_RE.match(data)
    return m[1].decode() if m else ""


def is_hash(h: object) -> bool:
    return isinstance(h, str) and _HASH_RE.fullmatch(h) is not None
