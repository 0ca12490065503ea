"""A bucket writer without the job's secret cannot make a step: manifests are sealed.

Anyone who can create objects in the job's bucket can write a well-formed manifest under
the exact name of a newer step, with chunks of their own. These tests plant such manifests
in a real GCS emulator next to real daemons' backups: the daemons neither restore them nor
let them push real steps (and their chunks) out of retention. Rotation of the secret is
checked the same way, through real restores.
"""

from __future__ import annotations

import logging
import os
import secrets
import uuid
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.gcs.test_backup_restore import objects, wait_backed_up, wipe
from tests.helpers import opened_manifest, sealed_key, write_orbax_step
from tests.security.test_untrusted_bytes import manifest_name, plant, read_object
from tierfs.core.chunks import chunk_hash, encode
from tierfs.core.manifest import Entry, Manifest

PLANTED = 50  # a newer step than any the job commits here
FORGED = 60  # the same, with a MAC line the planter made up


def secret_file(directory: Path, *lines: str) -> Path:
    path = directory / f"secret-{uuid.uuid4().hex[:6]}"
    path.write_text("".join(f"{line}\n" for line in lines))
    path.chmod(0o600)
    return path


def planted_manifest(job: str, step: int, data: bytes, chunk_size: int) -> Manifest:
    """What a planter writes: well formed, the right job, rank and name, its own bytes."""
    common = dict(mode=0o755, uid=0, gid=0, mtime_ns=0)
    return Manifest(
        job=job,
        rank=0,
        step=step,
        chunk_size=chunk_size,
        roots=[f"ckpt/{step}"],
        created=0.0,
        entries=[
            Entry("ckpt", "dir", size=0, **common),
            Entry(f"ckpt/{step}", "dir", size=0, **common),
            Entry(f"ckpt/{step}/a", "file", size=len(data), chunks=[chunk_hash(data)], **common),
        ],
    )


@pytest.mark.expect_log(
    f"WARNING tierfs.tiers.gcs_store: ignoring gs://.*/step-0*{PLANTED}\\.json: it is not sealed",
    f"WARNING tierfs.tiers.gcs_store: ignoring gs://.*/step-0*{FORGED}\\.json: its MAC does not verify",
)
def test_a_planted_newer_manifest_is_neither_restored_nor_a_reason_to_delete(volumes, gcs_bucket, shm_dir):
    job = f"plant-{uuid.uuid4().hex[:6]}"
    url = f"gs://{gcs_bucket}/b"
    key = secret_file(shm_dir("tierfs-secret"), secrets.token_hex(32))
    options = dict(job=job, capacity="256M", gcs=url, keep=2, gc_grace=0, secret_file=key)
    vol = volumes(**options)
    real = {step: os.urandom(100_000 + step) for step in (1, 2, 3)}
    for step in (1, 2):
        write_orbax_step(vol.mountpoint, step, {"a": real[step]})
        wait_backed_up(vol, step)

    # The planter: two newer steps of rank 0 (one unsealed, one with a made-up MAC), with a chunk.
    evil = b"the planter's bytes " * 5000
    plant(gcs_bucket, f"b/{job}/chunks/{chunk_hash(evil)[:2]}/{chunk_hash(evil)}", encode(evil))
    stored = opened_manifest(read_object(gcs_bucket, manifest_name(job, 0, 2)), job, 0, 2, key.read_text())
    chunk_size = Manifest.from_json(stored).chunk_size
    plant(gcs_bucket, manifest_name(job, 0, PLANTED), planted_manifest(job, PLANTED, evil, chunk_size).to_json())
    forged = planted_manifest(job, FORGED, evil, chunk_size).to_json()
    plant(
        gcs_bucket, manifest_name(job, 0, FORGED), forged + b"\nhmac-sha256 " + secrets.token_hex(32).encode() + b"\n"
    )

    # Rank 0's retention after step 3 keeps the 2 newest *real* steps, and their chunks.
    write_orbax_step(vol.mountpoint, 3, {"a": real[3]})
    wait_backed_up(vol, 3)
    manifests = objects(gcs_bucket, f"b/{job}/manifests/")
    assert manifest_name(job, 0, 2) in manifests and manifest_name(job, 0, 3) in manifests, manifests
    assert manifest_name(job, 0, 1) not in manifests, manifests
    chunks = objects(gcs_bucket, f"b/{job}/chunks/")
    for step in (2, 3):
        k = sealed_key(job, chunk_hash(real[step]), key.read_text())
        assert f"b/{job}/chunks/{k[:2]}/{k}" in chunks, f"step {step}'s chunk was collected"

    # A restart restores the real newest step, not the planted ones.
    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(**options, mountpoint=vol.mountpoint)
    assert again.status()["restored"]["step"] == 3
    assert (again.mountpoint / "ckpt" / "3" / "a").read_bytes() == real[3]
    assert not (again.mountpoint / "ckpt" / str(PLANTED)).exists()
    assert not (again.mountpoint / "ckpt" / str(FORGED)).exists()


def test_the_store_reads_each_manifest_once_and_logs_each_unsealed_one_once(gcs_bucket, caplog):
    from tierfs.core.keys import manifest_keys
    from tierfs.tiers.gcs_store import GcsStore

    keys = manifest_keys("job1", secrets.token_hex(32).encode())
    store = GcsStore(f"gs://{gcs_bucket}/p", "job1", keys=keys)
    for step in (1, 2, 3):
        m = planted_manifest("job1", step, b"real %d" % step, 1 << 20)
        store.put_manifest(0, step, m.sealed(keys))
    m = planted_manifest("job1", PLANTED, b"planted", 1 << 20)
    plant(gcs_bucket, manifest_name("job1", 0, PLANTED).replace("b/", "p/", 1), m.to_json())
    reads = []
    read = store.get_manifest
    store.get_manifest = lambda *a: reads.append(a[:2]) or read(*a)  # counts reads, changes nothing
    caplog.set_level(logging.WARNING, logger="tierfs.tiers.gcs_store")
    for _ in range(3):
        assert store.list_steps(0) == [1, 2, 3]
    assert sorted(reads) == [(0, 1), (0, 2), (0, 3), (0, PLANTED)], "each object read once to check its seal"
    result = store.collect_garbage(keep_newest=2, grace=0)
    assert result["manifests_deleted"] == 1 and store.list_manifests() == {0: [2, 3]}
    assert manifest_name("job1", 0, PLANTED).replace("b/", "p/", 1) in objects(gcs_bucket, "p/job1/manifests/")
    (warned,) = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert f"step-{PLANTED:012d}.json" in warned and "not sealed" in warned and "\n" not in warned


@pytest.mark.expect_log(
    "WARNING tierfs.tiers.gcs_store: ignoring gs://.*/step-0*1\\.json: .* is sealed, but by no secret"
)
def test_a_rotated_secret_still_restores_steps_made_under_the_old_one(volumes, gcs_bucket, shm_dir):
    from tierfs.core.keys import manifest_keys
    from tierfs.core.manifest import Unauthenticated, authenticate

    job = f"rot-{uuid.uuid4().hex[:6]}"
    url = f"gs://{gcs_bucket}/b"
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    keys = shm_dir("tierfs-secret")
    vol = volumes(job=job, capacity="256M", gcs=url, secret_file=secret_file(keys, old))
    write_orbax_step(vol.mountpoint, 1, {"a": b"made under the old secret"})
    wait_backed_up(vol, 1)
    tierfs("unmount", vol.mountpoint)
    wipe(vol)

    # Rotating: the new secret first, the old one on the next line.
    again = volumes(
        job=job, capacity="256M", gcs=url, secret_file=secret_file(keys, new, old), mountpoint=vol.mountpoint
    )
    assert again.status()["restored"]["step"] == 1
    assert (again.mountpoint / "ckpt" / "1" / "a").read_bytes() == b"made under the old secret"
    write_orbax_step(again.mountpoint, 2, {"a": b"made under the new secret"})
    wait_backed_up(again, 2)
    stored = opened_manifest(read_object(gcs_bucket, manifest_name(job, 0, 2)), job, 0, 2, new)
    authenticate(stored, manifest_keys(job, new.encode()), 0, 2)  # sealed with the new secret only
    with pytest.raises(Unauthenticated):
        authenticate(stored, manifest_keys(job, old.encode()), 0, 2)
    tierfs("unmount", again.mountpoint)
    wipe(again)

    # Once a step made under the new secret is backed up, the old line can go.
    last = volumes(job=job, capacity="256M", gcs=url, secret_file=secret_file(keys, new), mountpoint=vol.mountpoint)
    assert last.status()["restored"]["step"] == 2
    assert (last.mountpoint / "ckpt" / "2" / "a").read_bytes() == b"made under the new secret"


@pytest.mark.expect_log("WARNING tierfs: GCS objects in .* are neither encrypted nor authenticated")
def test_without_a_secret_the_daemon_says_once_that_the_bucket_decides(volumes, gcs_bucket, shm_dir):
    log = shm_dir("tierfs-log") / "daemon.log"
    vol = volumes(job=f"open-{uuid.uuid4().hex[:6]}", capacity="256M", gcs=f"gs://{gcs_bucket}/b", log_file=log)
    write_orbax_step(vol.mountpoint, 1, {"a": b"backed up as before"})
    wait_backed_up(vol, 1)
    (line,) = [line for line in log.read_text().splitlines() if "neither encrypted nor authenticated" in line]
    assert "TIERFS_SECRET" in line and "--secret-file" in line, line
    second = tierfs("status", vol.mountpoint).stdout.splitlines()[1]
    assert "UNAUTHENTICATED BUCKET" in second and f"gs://{gcs_bucket}/b" in second, second
