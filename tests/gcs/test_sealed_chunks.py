"""What the bucket shows and takes: with the job's secret, no byte of a checkpoint, and no
object that is not the job's (:mod:`tierfs.core.bucket_seal`); a backup of the release before
sealing still restores."""

from __future__ import annotations

import os
import random
import string

import pytest

from tests.conftest import tierfs
from tests.gcs.test_backup_restore import MiB, client, objects, wait_backed_up, wait_restored, wipe
from tests.helpers import opened_manifest, sealed_key, tree_digest, write_orbax_step
from tierfs.core.manifest import Manifest

RUN = 4096


def text(n: int, seed: int) -> bytes:
    """Words, as a config or a tokenizer file holds them: what compresses."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(500)]
    out = bytearray()
    while len(out) < n:
        out += (" ".join(rng.choices(words, k=12)) + ".\n").encode()
    return bytes(out[:n])


def test_the_bucket_holds_no_run_of_the_checkpoint_and_no_name_of_it(volumes, gcs_url, gcs_bucket):
    vol = volumes(job="hide", capacity="256M", gcs=gcs_url, chunk_size="1M")
    files = {"weights.bin": os.urandom(3 * MiB + 123), "vocab.txt": text(2 * MiB, 1), "config.json": text(5000, 2)}
    write_orbax_step(vol.mountpoint, 1, files)
    wait_backed_up(vol, 1)
    stored = [
        client().bucket(gcs_bucket).blob(name).download_as_bytes() for name in objects(gcs_bucket, "backups/hide/")
    ]
    everything = b"\0".join(stored)
    assert len(stored) >= 6 and len(everything) > 3 * MiB, "the step is in the bucket"
    for name, data in files.items():
        for offset in range(0, len(data) - RUN + 1, 509):  # every 4 KiB run starting at a prime stride
            assert data[offset : offset + RUN] not in everything, f"{name} at {offset} is readable in the bucket"
        assert name.encode() not in everything, f"the bucket names {name}"


@pytest.mark.expect_log(
    'restore of step \\d+: chunk \\w+ is on no reachable tier',
    'chunk \\w+ from gcs failed',
    'read of restoring step \\d+ failed: chunk',
)
def test_a_chunk_swapped_under_another_name_is_refused(volumes, gcs_url, gcs_bucket):
    """Another chunk of the same job, sealed by it, moved under a chunk's name does not open:
    its seal names the chunk it was made for. So do bytes anyone else made."""
    vol = volumes(job="swap", capacity="256M", gcs=gcs_url, chunk_size="1M")
    good = os.urandom(MiB)
    write_orbax_step(vol.mountpoint, 1, {"a": os.urandom(2 * MiB), "b": good})
    wait_backed_up(vol, 1)
    tierfs("unmount", vol.mountpoint)
    manifest = Manifest.from_json(
        opened_manifest(
            client().bucket(gcs_bucket).blob(objects(gcs_bucket, "backups/swap/manifests/")[0]).download_as_bytes(),
            "swap",
            0,
            1,
        )
    )
    first, second = next(e for e in manifest.entries if e.path.endswith("/a")).chunks
    bucket = client().bucket(gcs_bucket)
    victim = f"backups/swap/chunks/{sealed_key('swap', first)[:2]}/{sealed_key('swap', first)}"
    other = bucket.blob(f"backups/swap/chunks/{sealed_key('swap', second)[:2]}/{sealed_key('swap', second)}")
    for planted in (other.download_as_bytes(), b"R" + os.urandom(MiB)):
        bucket.blob(victim).upload_from_string(planted)
        wipe(vol)
        again = volumes(
            job="swap", capacity="256M", gcs=gcs_url, chunk_size="1M", mountpoint=vol.mountpoint, prefetch=0
        )
        assert (again.mountpoint / "ckpt" / "1" / "b").read_bytes() == good
        with pytest.raises(OSError):
            (again.mountpoint / "ckpt" / "1" / "a").read_bytes()
        restored = again.status()["restored"]
        assert f"gs://{gcs_bucket}/{victim}" in restored["error"] and "not this job's" in restored["error"]
        tierfs("unmount", again.mountpoint)


def test_a_backup_by_the_release_before_sealing_restores(volumes, gcs_url, gcs_bucket, previous_release, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(previous_release))
    vol = volumes(job="old", capacity="256M", gcs=gcs_url, chunk_size="1M")
    files = {"weights.bin": os.urandom(2 * MiB), "vocab.txt": text(MiB, 3)}
    write_orbax_step(vol.mountpoint, 1, files)
    expected = tree_digest(vol.mountpoint / "ckpt")
    wait_backed_up(vol, 1)
    tierfs("unmount", vol.mountpoint)
    clear = [n for n in objects(gcs_bucket, "backups/old/chunks/") if len(n.rsplit("/", 1)[1]) == 32]
    assert clear, "the release before stores chunks in clear, named by their hash"

    monkeypatch.delenv("PYTHONPATH")
    wipe(vol)
    again = volumes(job="old", capacity="256M", gcs=gcs_url, chunk_size="1M", mountpoint=vol.mountpoint)
    assert tree_digest(again.mountpoint / "ckpt") == expected
    assert wait_restored(again)["restored"]["step"] == 1
    # Its next step is sealed, beside the old one's chunks, and both stay restorable.
    write_orbax_step(again.mountpoint, 2, {"weights.bin": os.urandom(MiB)})
    wait_backed_up(again, 2)
    assert any(len(n.rsplit("/", 1)[1]) == 64 for n in objects(gcs_bucket, "backups/old/chunks/"))
