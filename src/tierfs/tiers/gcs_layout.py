"""Where a job's objects lie in the bucket, and what they hold, as names and bytes.

Layout (with an empty PREFIX, names start at ``<job>/``)::

    <prefix>/<job>/chunks/<h[0:2]>/<h>                      a chunk frame, named by its hash
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.json     a manifest; its presence commits step S
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.pending  an upload in progress: JSON list of
                                                             the chunk hashes it will reference

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
# Candidates only (digit counts keep int() cheap); a name counts once it is exactly the one
# manifest_name gives for its numbers.
_MANIFEST_RE = re.compile(r"rank-([0-9]{1,10})/step-([0-9]{1,19})\.(json|pending)")


class ChunkInfo(NamedTuple):
    """One chunk as a listing saw it: enough to decide, and to delete only that version."""

    hash: str
    size: int
    updated: float  # unix time the chunk was last written or touched
    metageneration: int



def job_base(prefix: str, job: str) -> str:
    """Where the job's objects start: ``<prefix>/<job>/``, or ``<job>/`` without a prefix."""
    if not job or "/" in job:
        raise ValueError(f"invalid job id {job!r}")
    return f"{prefix}/{job}/" if prefix else f"{job}/"


def chunk_name(base: str, h: str) -> str:
    if not _HASH_RE.fullmatch(h):
        raise ValueError(f"not a chunk hash: {h!r}")
    return f"{base}chunks/{h[:2]}/{h}"


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


def chunk_of(prefix: str, name: str) -> str | None:
    """The hash a name under ``chunks/`` (``prefix``) is the object of, None for any other name."""
    shard, _, h = name[len(prefix):].partition("/")
    return h if _HASH_RE.fullmatch(h) and shard == h[:2] else None


def last_used(blob: storage.Blob) -> float:
    """When the chunk was last written or touched.

    GCS moves ``updated`` on every metadata patch, so the touch stamp adds nothing there;
    fake-gcs-server does not, and the stamp stands in. A stamp from a fast clock keeps a
    chunk longer, never shorter.
    """
    updated = blob.updated.timestamp()
    try:
        return max(updated, float((blob.metadata or {}).get(USED_KEY, 0)))
    except ValueError:
        return updated



def pending_marker(hashes: Iterable[str]) -> bytes:
    """An upload marker's content: the chunks the upload will reference, each once."""
    return json.dumps(sorted(set(hashes))).encode()


def parse_pending(data: bytes, url: str) -> set[str]:
    try:
        hashes = json.loads(data)
    except (ValueError, RecursionError):
        hashes = None
    if not isinstance(hashes, list) or not all(is_hash(h) for h in hashes):
        raise CorruptObject(f"{url} is not a JSON list of chunk hashes")
    return set(hashes)


def parse_manifest_chunks(data: bytes, url: str) -> set[str]:
    """The chunks a manifest's JSON names; only ``entries[].chunks`` matters to the collector."""
    try:
        entries = json.loads(data)["entries"]
        hashes = {h for entry in entries for h in entry.get("chunks", ())}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CorruptObject(f"{url} is not a manifest: its chunks cannot be told") from None
    if not all(is_hash(h) for h in hashes):
        raise CorruptObject(f"{url} names something that is not a chunk hash")
    return hashes


def is_hash(h: object) -> bool:
    return isinstance(h, str) and _HASH_RE.fullmatch(h) is not None

