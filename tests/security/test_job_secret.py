"""What a stranger learns from the job's secret: nothing a fast guess can check.

Anyone who reaches a peer port gets the job's TLS certificate and the server's handshake
proof; anyone who reads the bucket gets sealed manifests. Each is keyed from the secret, so
each lets a guess of the secret be tested offline. These tests connect to a real peer
service as a stranger and check that both answers come from the scrypt-stretched secret
(the documented parameters), not from a fast HKDF or HMAC of the secret itself, and that
secrets are made, read and rotated as documented.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import socket
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.kdf.hkdf import HKDF, HKDFExpand
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from tests.conftest import tierfs
from tests.peers.test_peer_service import JOB, SECRET
from tests.security.test_peer_protocol import ThreadedServer, recv_frame
from tierfs.peers import tls, wire

# As docs/peer-protocol.md documents them.
SCRYPT = dict(n=1 << 14, r=8, p=1)
STRETCH_SALT = b"tierfs job secret v1\0"


def stretched(secret: bytes, job: str = JOB) -> bytes:
    return Scrypt(salt=STRETCH_SALT + job.encode(), length=32, **SCRYPT).derive(secret)


def expand(root: bytes, label: bytes) -> bytes:
    return HKDFExpand(hashes.SHA256(), 32, info=label).derive(root)


def raw_public(seed: bytes) -> bytes:
    return (
        ed25519.Ed25519PrivateKey.from_private_bytes(seed)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )


def test_the_certificate_a_stranger_gets_costs_a_scrypt_per_guess(tmp_path):
    with ThreadedServer(tmp_path / "replicas", tls.from_secret(JOB, SECRET)) as server:
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        stranger.check_hostname, stranger.verify_mode = False, ssl.CERT_NONE
        with stranger.wrap_socket(socket.create_connection(server.address, timeout=5)) as sock:
            der = sock.getpeercert(binary_form=True)
    public = (
        x509.load_der_x509_certificate(der)
        .public_key()
        .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    )
    fast = HKDF(hashes.SHA256(), 32, salt=b"tierfs peer TLS key v1", info=JOB.encode()).derive(SECRET)
    assert public != raw_public(fast), "the certificate is a fast HKDF of the secret: guesses are cheap"
    assert public == raw_public(expand(stretched(SECRET), b"tierfs peer TLS key v2"))


def test_the_handshake_proof_a_stranger_gets_costs_a_scrypt_per_guess(tmp_path):
    with (
        ThreadedServer(tmp_path / "replicas", None) as server,
        socket.create_connection(server.address, timeout=5) as sock,
    ):
        nonce = wire.new_nonce()
        sock.sendall(wire.encode_header({"op": "hello", "version": wire.VERSION, "job": JOB, "nonce": nonce}))
        challenge = recv_frame(sock)
    message = f"server|{JOB}|{nonce}|{challenge['nonce']}".encode()
    assert challenge["proof"] != hmac.new(SECRET, message, hashlib.sha256).hexdigest()
    key = expand(stretched(SECRET), b"tierfs peer handshake v2")
    assert challenge["proof"] == hmac.new(key, message, hashlib.sha256).hexdigest()


def test_the_stretch_costs_at_least_what_is_documented():
    from tierfs.core import keys

    assert keys.SCRYPT_N >= SCRYPT["n"] and keys.SCRYPT_R >= SCRYPT["r"] and keys.SCRYPT_P >= SCRYPT["p"]
    assert keys.SCRYPT_MEMORY == 128 * keys.SCRYPT_R * keys.SCRYPT_N >= 16 << 20
    assert keys.stretch(JOB, SECRET) == stretched(SECRET)
    assert keys.stretch("other-job", SECRET) != stretched(SECRET), "the job id salts the stretch"
    manifest_key = keys.derive(JOB, SECRET).manifest
    assert manifest_key == expand(stretched(SECRET), b"tierfs manifest MAC v1")
    assert len({manifest_key, keys.derive(JOB, SECRET).handshake, keys.derive(JOB, SECRET).tls_seed}) == 3


def test_older_secrets_only_verify_manifests():
    from tierfs.config import Config
    from tierfs.core.keys import manifest_keys
    from tierfs.core.manifest import Unauthenticated, authenticate, seal

    old, new = b"o" * 32, b"n" * 32
    cfg = Config.build(mountpoint="/mnt/x", job=JOB, secret=b"\n" + new + b"\n  " + old + b"  \n\n")
    assert (cfg.secret, cfg.older_secrets) == (new, (old,))
    body = b'{"a manifest":1}'
    made_before = seal(body, manifest_keys(JOB, old), 3, 7)
    assert authenticate(made_before, cfg.manifest_keys, 3, 7) == body
    with pytest.raises(Unauthenticated):  # bound to its rank and step
        authenticate(made_before, cfg.manifest_keys, 3, 8)
    with pytest.raises(Unauthenticated):  # the old line gone: no longer accepted
        authenticate(made_before, manifest_keys(JOB, new), 3, 7)
    made_now = seal(body, cfg.manifest_keys, 3, 7)
    assert made_now == seal(body, manifest_keys(JOB, new), 3, 7), "new manifests are sealed with the first secret"
    with pytest.raises(Unauthenticated):
        authenticate(body, cfg.manifest_keys, 3, 7)  # unsealed: never used with a secret


def test_tierfs_secret_prints_a_new_256_bit_secret_each_time():
    first, second = (tierfs("secret").stdout for _ in range(2))
    assert re.fullmatch(r"[0-9a-f]{64}\n", first) and re.fullmatch(r"[0-9a-f]{64}\n", second)
    assert first != second
