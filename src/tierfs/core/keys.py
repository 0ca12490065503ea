"""The keys a job's secret gives: one slow stretch, then a fast key per purpose.

Outsiders see values keyed from the secret: the TLS certificate every node presents, the
handshake proofs, the MAC on every manifest in the bucket, the names and seals of its
chunks. Each of them lets whoever holds it test guesses of the secret offline, so the
secret is first stretched with scrypt (memory-hard: a guess costs :data:`SCRYPT_MEMORY`
bytes and tens of milliseconds, on a GPU too), salted with the job id so that one table
of guesses serves one job only. Everything
else comes from the stretched key with HKDF and a label of its own, so no key reveals
another.

The stretch is paid once per (job, secret) and process: a daemon derives its keys at
start, and every later connection, certificate and manifest reuses them.

A secret file (or ``TIERFS_SECRET``) may hold older secrets on later lines: they only
verify manifests written under them, so a job can rotate its secret without losing the
backups made before (docs/operations.md, "Rotating the job's secret").
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.core.bucket_seal import ChunkSeal

# scrypt's cost: 128 * R * N bytes of memory, about 50 ms on one core of a current server.
SCRYPT_N = 1 << 14
SCRYPT_R = 8
SCRYPT_P = 1
SCRYPT_MEMORY = 128 * SCRYPT_R * SCRYPT_N  # 16 MiB
SECRET_BYTES = 32  # what `tierfs secret` makes: 256 random bits

_STRETCH_LABEL = b"tierfs job secret v1\0"
_TLS_LABEL = b"tierfs peer TLS key v2"
_HANDSHAKE_LABEL = b"tierfs peer handshake v2"
_MANIFEST_LABEL = b"tierfs manifest MAC v1"
_CHANNEL_LABEL = b"tierfs peer channel v1"
_BUCKET_LABELS = (b"tierfs bucket chunk names v1", b"tierfs bucket chunk nonces v1", b"tierfs bucket chunk cipher v1")


@dataclass(frozen=True)
class JobKeys:
    """What one secret of one job keys."""

    tls_seed: bytes  # the Ed25519 private key of the job's peer certificate
    handshake: bytes  # the HMAC key of the peer handshake's proofs
    manifest: bytes  # the HMAC key of manifests
    channel: bytes  # keys each peer connection's records, with the connection's handshake nonces
    bucket: tuple[bytes, bytes, bytes]  # name, nonce and cipher keys of chunks in buckets (core.bucket_seal)


@dataclass(frozen=True)
class ManifestKeys:
    """The keys a node seals manifests with (``seal``) and accepts them under (``accept``).

    ``accept`` starts with ``seal``; older secrets add their keys after it.
    """

    job: str
    seal: bytes
    accept: tuple[bytes, ...]


def stretch(job: str, secret: bytes) -> bytes:
    """The secret stretched with scrypt, salted with the job id: the one slow step."""
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt  # noqa: PLC0415 (slow import)

    kdf = Scrypt(salt=_STRETCH_LABEL + job.encode(), length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
    return kdf.derive(secret)


@functools.lru_cache(maxsize=16)
def derive(job: str, secret: bytes) -> JobKeys:
    """Every key of ``secret`` for ``job`` (stretched once per process, then cached)."""
    root = stretch(job, secret)
    names, nonces, cipher = (_expand(root, label) for label in _BUCKET_LABELS)
    return JobKeys(
        _expand(root, _TLS_LABEL),
        _expand(root, _HANDSHAKE_LABEL),
        _expand(root, _MANIFEST_LABEL),
        _expand(root, _CHANNEL_LABEL),
        bucket=(names, nonces, cipher),
    )


def manifest_keys(job: str, secret: bytes | None, older: Sequence[bytes] = ()) -> ManifestKeys | None:
    """The manifest keys of a node holding ``secret`` (and ``older`` ones); ``None`` without a secret."""
    if not secret:
        return None
    seal = derive(job, secret).manifest
    return ManifestKeys(job, seal, (seal, *(derive(job, s).manifest for s in older if s and s != secret)))


def bucket_seals(job: str, secret: bytes | None, older: Sequence[bytes] = ()) -> tuple[ChunkSeal, ...]:
    """The seals of chunks in buckets (:mod:`tierfs.core.bucket_seal`): the current secret's
    first, which seals, then the older ones', which only open; none without a secret."""
    from tierfs.core.bucket_seal import ChunkSeal  # noqa: PLC0415 (cryptography and blake3: only with a bucket)

    if not secret:
        return ()
    return tuple(ChunkSeal(*derive(job, s).bucket) for s in (secret, *(s for s in older if s and s != secret)))


def split_secrets(text: bytes) -> tuple[bytes, tuple[bytes, ...]]:
    """A secret file's (or ``TIERFS_SECRET``'s) current secret and the older ones after it.

    One secret a line; blank lines and surrounding white space do not count.
    """
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    return (lines[0] if lines else b""), tuple(lines[1:])


def new_secret() -> str:
    """A new random secret: 256 bits as 64 hex digits."""
    return secrets.token_hex(SECRET_BYTES)


def _expand(root: bytes, label: bytes) -> bytes:
    """HKDF-Expand-SHA256 (RFC 5869): the stretched key is uniform already, so it needs no extract step."""
    from cryptography.hazmat.primitives import hashes  # noqa: PLC0415
    from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand  # noqa: PLC0415

    return HKDFExpand(hashes.SHA256(), 32, info=label).derive(root)
