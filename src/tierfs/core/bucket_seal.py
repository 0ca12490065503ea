"""Chunks sealed for a bucket: encrypted, authenticated and named under keys of the job's secret.

Anyone who can read the checkpoint bucket (every pod on a node pool's service account)
could otherwise read every job's model, and anyone who can write it could swap a chunk's
bytes: chunk names are xxh3-128, which claims no resistance to collisions, and a manifest's
seal covers only the names it lists. So a node holding the job's secret stores each chunk
in a bucket as

- an object named by a keyed BLAKE3 of the chunk's name (:meth:`ChunkSeal.object_key`):
  without the key, a name tells nothing of the content, and no one can tell which object
  a manifest needs or test a guess of a chunk's bytes;
- holding ``S``, a 12-byte nonce and the frame (:mod:`tierfs.core.chunks`) encrypted with
  AES-256-GCM, the chunk's name as associated data: without the key nothing of the bytes
  can be read, and nothing can be made that opens, including another chunk's object
  moved under this name.

Manifests are sealed the same way (their rank and step as associated data), so the bucket
shows no path, size or chunk name either.

The nonce is a keyed BLAKE3 of the frame itself, so sealing is deterministic: the same frame
gives the same object on every node, which keeps deduplication across steps and twins and
lets an uploader prove an object by its MD5 alone; two frames share a nonce only if they are
the same frame (with the chance of a 96-bit collision). Keys come from the job's secret
(:mod:`tierfs.core.keys`), one seal per secret: after a rotation, chunks sealed under an older
secret still open, and a manifest names the seal its chunks are under (``chunk_seal``).

Both ciphers are maintained libraries' compiled code (``cryptography``'s AES-GCM with AES-NI,
``blake3``), run in worker threads like every other chunk computation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierfs.core.chunks import CorruptChunk

TAG = b"S"  # never a codec's tag (chunks.RAW, ZSTD, PLANES): a sealed object is never read as a frame
NONCE = 12
OVERHEAD = len(TAG) + NONCE + 16  # tag byte, nonce, GCM tag
_AD = b"tierfs bucket chunk v1\0"
_ID = b"tierfs bucket seal id v1"


@dataclass(frozen=True)
class ChunkSeal:
    """The keys that seal one job's chunks in buckets under one secret."""

    name_key: bytes
    nonce_key: bytes
    cipher_key: bytes

    @property
    def id(self) -> str:
        """What a manifest names this seal by: 16 hex digits that reveal nothing of the keys."""
        return blake3.blake3(_ID, key=self.name_key).hexdigest(length=8)

    def object_key(self, h: str) -> str:
        """The bucket's name for chunk ``h``: 64 hex digits, a keyed BLAKE3 of the chunk's name."""
        return blake3.blake3(h.encode(), key=self.name_key).hexdigest()

    def seal(self, h: str, frame: bytes) -> bytes:
        nonce = blake3.blake3(frame, key=self.nonce_key).digest(length=NONCE)
        return TAG + nonce + AESGCM(self.cipher_key).encrypt(nonce, frame, _AD + h.encode())

    def open(self, h: str, body: bytes) -> bytes:
        """The frame sealed in ``body`` for chunk ``h``; CorruptChunk if it is not that."""
        frame = self._open(body, _AD + h.encode())
        if frame is None:
            raise CorruptChunk(f"chunk {h}: its seal does not open (not sealed by this job, or changed)")
        return frame

    def seal_manifest(self, rank: int, step: int, data: bytes) -> bytes:
        """A manifest as a bucket holds it: encrypted too, so that no reader of the bucket
        learns the checkpoint's paths, sizes or chunk names. Its nonce is random (manifests
        are never deduplicated); its MAC line (core.manifest.seal) stays inside."""
        nonce = os.urandom(NONCE)
        return TAG + nonce + AESGCM(self.cipher_key).encrypt(nonce, data, _manifest_ad(rank, step))

    def open_manifest(self, rank: int, step: int, body: bytes) -> bytes | None:
        """The manifest sealed in ``body`` as (rank, step); None if this seal does not open it."""
        return self._open(body, _manifest_ad(rank, step))

    def _open(self, body: bytes, ad: bytes) -> bytes | None:
        if len(body) < OVERHEAD or body[:1] != TAG:
            return None
        try:
            return AESGCM(self.cipher_key).decrypt(body[1 : 1 + NONCE], body[1 + NONCE :], ad)
        except InvalidTag:
            return None


def _manifest_ad(rank: int, step: int) -> bytes:
    return b"tierfs bucket manifest v1\0%d\0%d" % (rank, step)
