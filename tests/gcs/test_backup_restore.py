"""Backup to a real GCS emulator through real mounts, and restore onto an empty RAM tier."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from tests.conftest import tierfs
from tests.helpers import opened_manifest, sealed_key, tree_digest, wait_for, write_orbax_step
from tierfs.core.manifest import Manifest
from tierfs.ramtier.tmpfs import unmount_beneath

MiB = 1 << 20


def step_state(vol, step: int) -> dict | None:
    return next((s for s in vol.status()["steps"] if s["step"] == step), None)


def wait_backed_up(vol, step: int, timeout: float = 60) -> dict:
    return wait_for(
        lambda: (s := step_state(vol, step)) and s["backed_up"] and s, timeout, f"step {step} to be backed up"
    )


def wait_restored(vol) -> dict:
    """The volume's status once its restore has every byte (reads can finish just before)."""
    return wait_for(lambda: (s := vol.status())["restored"]["state"] == "done" and s, 30, "the restore to finish")


def wipe(vol) -> None:
    """Lose the node's RAM: the whole rank directory goes (with its own tmpfs, if it has one)."""
    unmount_beneath(vol.ramdisk / vol.job / f"rank-{vol.rank}")
    shutil.rmtree(vol.ramdisk / vol.job / f"rank-{vol.rank}")


def client() -> storage.Client:
    return storage.Client(credentials=AnonymousCredentials(), project="test")


def objects(bucket: str, prefix: str) -> list[str]:
    return sorted(b.name for b in client().list_blobs(bucket, prefix=prefix))


def test_round_trip_through_gcs_onto_an_empty_ram_tier(volumes, gcs_url):
    vol = volumes(job="rt", capacity="1G", gcs=gcs_url)
    files = {f"shard-{i}": os.urandom(3 * MiB + i * 4097) for i in range(6)}
    files["zeros"] = bytes(9 * MiB)  # compresses, and repeats one chunk
    files["meta/empty"] = b""
    files["meta/config.json"] = b'{"lr": 0.1}' * 100

    def prepare(tmp: Path) -> None:
        os.symlink("shard-0", tmp / "latest-shard")
        os.chmod(tmp / "meta" / "config.json", 0o640)
        os.chmod(tmp / "meta", 0o750)
        os.chown(tmp / "shard-2", 1000, 1000)  # a pod running as another user

    write_orbax_step(vol.mountpoint, 10, files, prepare=prepare)
    expected = tree_digest(vol.mountpoint / "ckpt")
    state = wait_backed_up(vol, 10)
    assert state["backup"]["bytes"] == sum(map(len, files.values()))
    assert state["backup"]["stored_bytes"] < state["backup"]["uploaded_bytes"], "zeros must compress"
    text = tierfs("status", vol.mountpoint).stdout
    assert "step  10" in text and "in GCS after" in text and "UNAUTHENTICATED" not in text

    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="rt", capacity="1G", gcs=gcs_url, mountpoint=vol.mountpoint)
    assert tree_digest(again.mountpoint / "ckpt") == expected
    status = wait_restored(again)
    assert status["restored"]["step"] == 10 and status["restored"]["from"] == gcs_url
    assert [(s["step"], s["source"], s["backed_up"]) for s in status["steps"]] == [(10, "gcs", True)]
    assert "restore step 10 (done) from " + gcs_url in tierfs("status", again.mountpoint).stdout
    # The restored step is frozen like any commit: changing it does not touch what GCS holds.
    (again.mountpoint / "ckpt" / "10" / "shard-1").write_bytes(b"changed")
    assert not any(not s["backed_up"] for s in again.status()["steps"])


def test_dedup_across_steps_uploads_only_changed_chunks(volumes, gcs_url):
    vol = volumes(job="dd", capacity="1G", gcs=gcs_url, chunk_size="1M")
    shards = [os.urandom(4 * MiB) for _ in range(10)]
    write_orbax_step(vol.mountpoint, 1, {f"s{i}": d for i, d in enumerate(shards)})
    first = wait_backed_up(vol, 1)["backup"]
    assert first["uploaded_bytes"] == 40 * MiB and first["dedup_bytes"] == 0
    shards[3] = os.urandom(4 * MiB)  # 10% of the bytes change
    write_orbax_step(vol.mountpoint, 2, {f"s{i}": d for i, d in enumerate(shards)})
    second = wait_backed_up(vol, 2)["backup"]
    print(f"step 2 uploaded {second['uploaded_bytes'] / MiB:.1f} MiB of {second['bytes'] / MiB:.1f} MiB")
    assert second["uploaded_bytes"] == 4 * MiB
    assert second["dedup_bytes"] == 36 * MiB


def test_identical_data_on_two_ranks_is_stored_once(volumes, gcs_url, gcs_bucket):
    data = {f"w{i}": os.urandom(2 * MiB) for i in range(4)}
    vols = [volumes(job="dp", rank=r, nodes=2, capacity="256M", gcs=gcs_url, chunk_size="1M") for r in (0, 1)]
    for v in vols:
        write_orbax_step(v.mountpoint, 5, data)
    backups = [wait_backed_up(v, 5)["backup"] for v in vols]
    assert sum(b["uploaded_bytes"] for b in backups) == 8 * MiB, backups
    chunk_objects = objects(gcs_bucket, "backups/dp/chunks/")
    assert len(chunk_objects) == 8
    assert objects(gcs_bucket, "backups/dp/manifests/") == [
        "backups/dp/manifests/rank-0/step-000000000005.json",
        "backups/dp/manifests/rank-1/step-000000000005.json",
    ]


@pytest.mark.expect_log('gcs: step \\d+ (delayed, retrying|did not reach gcs)')
def test_outage_delays_backup_without_blocking_work_and_snapshot_holds(volumes, gcs_url, gcs_emulator):
    vol = volumes(job="out", capacity="512M", gcs=gcs_url)
    write_orbax_step(vol.mountpoint, 1, {"a": os.urandom(MiB)})
    wait_backed_up(vol, 1)
    gcs_emulator.stop()
    try:
        committed = {"a": os.urandom(3 * MiB), "b": os.urandom(MiB)}
        final = write_orbax_step(vol.mountpoint, 2, committed)
        # The job goes on: it rewrites and deletes committed files while GCS is away.
        started = time.monotonic()
        (final / "a").write_bytes(b"rewritten after commit")
        (final / "b").unlink()
        write_orbax_step(vol.mountpoint, 3, {"c": os.urandom(MiB)}, base="other")
        assert time.monotonic() - started < 5, "local work must not wait for GCS"
        gcs = wait_for(
            lambda: (g := vol.status()["gcs"])["state"] == "unavailable" and g, 30, "the outage to show in status"
        )
        assert gcs["error"] and gcs["lag_s"] > 0
        assert not step_state(vol, 3)["backed_up"]
    finally:
        gcs_emulator.start()
    wait_backed_up(vol, 3, timeout=90)
    assert vol.status()["gcs"]["state"] == "ok"

    # Step 2 was superseded before GCS came back: the newest step is what comes back.
    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="out", capacity="512M", gcs=gcs_url, mountpoint=vol.mountpoint)
    assert again.status()["restored"]["step"] == 3
    assert (again.mountpoint / "other" / "3" / "c").stat().st_size == MiB


def test_a_step_changed_during_its_backup_is_uploaded_as_committed(volumes, gcs_url, gcs_emulator):
    vol = volumes(job="iso", capacity="512M", gcs=gcs_url)
    gcs_emulator.stop()  # hold the backup back so the job's changes surely come first
    try:
        committed = {"a": os.urandom(5 * MiB), "b": os.urandom(MiB), "c": b"c" * 1000}
        final = write_orbax_step(vol.mountpoint, 7, committed)
        with open(final / "a", "r+b") as f:
            f.seek(MiB)
            f.write(b"X" * MiB)
        (final / "b").write_bytes(b"new b")
        os.rename(final / "c", vol.mountpoint / "c-moved")
        shutil.rmtree(final)
        assert not step_state(vol, 7)["backed_up"]
    finally:
        gcs_emulator.start()
    wait_backed_up(vol, 7, timeout=90)
    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="iso", capacity="512M", gcs=gcs_url, mountpoint=vol.mountpoint)
    for name, data in committed.items():
        assert (again.mountpoint / "ckpt" / "7" / name).read_bytes() == data


@pytest.mark.expect_log(
    'restore of step \\d+: chunk \\w+ is on no reachable tier',
    'chunk \\w+ from gcs failed',
    'read of restoring step \\d+ failed: chunk',
)
def test_corrupt_or_missing_chunk_fails_only_its_reads_and_is_named(volumes, gcs_url, gcs_bucket):
    vol = volumes(job="bad", capacity="256M", gcs=gcs_url, chunk_size="1M")
    good = os.urandom(MiB)
    write_orbax_step(vol.mountpoint, 1, {"a": os.urandom(3 * MiB), "b": good})
    wait_backed_up(vol, 1)
    tierfs("unmount", vol.mountpoint)
    manifest = Manifest.from_json(
        opened_manifest(
            client().bucket(gcs_bucket).blob(objects(gcs_bucket, "backups/bad/manifests/")[0]).download_as_bytes(),
            "bad",
            0,
            1,
        )
    )
    damaged_hash = next(e for e in manifest.entries if e.path.endswith("/a")).chunks[1]
    (name,) = [n for n in objects(gcs_bucket, "backups/bad/chunks/") if n.endswith(sealed_key("bad", damaged_hash))]
    bucket = client().bucket(gcs_bucket)
    bucket.blob(name).upload_from_string(b"R" + os.urandom(MiB))  # a valid frame, wrong bytes

    for damage in ("corrupt", "missing"):
        if damage == "missing":
            bucket.blob(name).delete()
        wipe(vol)
        again = volumes(job="bad", capacity="256M", gcs=gcs_url, chunk_size="1M", mountpoint=vol.mountpoint, prefetch=0)
        step = again.mountpoint / "ckpt" / "1"
        assert (step / "b").read_bytes() == good  # the rest of the step is there
        with pytest.raises(OSError) as err:
            (step / "a").read_bytes()
        assert err.value.errno == errno.EIO  # never zeros, never another chunk's bytes
        restored = again.status()["restored"]
        assert f"gs://{gcs_bucket}/{name}" in restored["error"] and damage in restored["error"]
        assert restored["state"] != "done" and not again.status()["steps"], "a partial step is never committed"
        tierfs("unmount", again.mountpoint)


def test_retention_keeps_newest_steps_and_only_their_chunks(volumes, gcs_url, gcs_bucket):
    vol = volumes(job="ret", capacity="256M", gcs=gcs_url, keep=2, gc_grace=0, chunk_size="1M")
    shared = os.urandom(MiB)
    for step in range(1, 5):
        write_orbax_step(vol.mountpoint, step, {"shared": shared, "own": os.urandom(MiB)})
        wait_backed_up(vol, step)
    manifests = "backups/ret/manifests/rank-0/"
    wait_for(
        lambda: (
            objects(gcs_bucket, manifests)
            == [manifests + "step-000000000003.json", manifests + "step-000000000004.json"]
        ),
        30,
        "retention to delete steps 1 and 2",
    )
    wait_for(
        lambda: len(objects(gcs_bucket, "backups/ret/chunks/")) == 3,
        30,
        "chunks only steps 1 and 2 used to be collected",
    )
    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="ret", capacity="256M", gcs=gcs_url, mountpoint=vol.mountpoint)
    assert (again.mountpoint / "ckpt" / "4" / "shared").read_bytes() == shared


def test_backup_interval_backs_up_the_newest_step_at_most_that_often(volumes, gcs_url, gcs_bucket):
    vol = volumes(job="iv", capacity="256M", gcs=gcs_url, backup_interval="4s")
    write_orbax_step(vol.mountpoint, 1, {"a": b"1"})
    first = wait_backed_up(vol, 1)["backup"]
    write_orbax_step(vol.mountpoint, 2, {"a": b"2"})
    write_orbax_step(vol.mountpoint, 3, {"a": b"3"})
    third = wait_backed_up(vol, 3, timeout=30)["backup"]
    assert third["at"] - first["at"] >= 4 - 0.1
    assert objects(gcs_bucket, "backups/iv/manifests/") == [
        "backups/iv/manifests/rank-0/step-000000000001.json",
        "backups/iv/manifests/rank-0/step-000000000003.json",
    ], "step 2 was superseded within the interval and is never uploaded"


@pytest.mark.expect_log('GCS bucket gs://\\S+ does not exist')
def test_missing_bucket_is_a_one_line_error(volumes, gcs_emulator, shm_dir):
    mp = shm_dir("tierfs-mnt")
    proc = tierfs("mount", mp, "--ramdisk", shm_dir("tierfs-ram"), "--gcs", "gs://no-such-bucket-here/x", check=False)
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert "no-such-bucket-here" in line and "does not exist" in line


@pytest.mark.slow
def test_one_gib_checkpoint_survives_losing_the_ram_tier(volumes, gcs_url):
    vol = volumes(job="gib", capacity="3G", gcs=gcs_url)
    tmp = vol.mountpoint / "ckpt" / "1000.orbax-checkpoint-tmp"
    for i in range(16):  # 16 layers x 64 MiB, written without holding 1 GiB in this process
        (tmp / f"layer-{i:02d}").mkdir(parents=True)
        with open(tmp / f"layer-{i:02d}" / "shard", "wb") as f:
            for _ in range(16):
                f.write(os.urandom(4 * MiB))
    os.rename(tmp, vol.mountpoint / "ckpt" / "1000")
    expected = tree_digest(vol.mountpoint / "ckpt")
    backup = wait_backed_up(vol, 1000, timeout=600)["backup"]
    assert backup["bytes"] == 1 << 30
    print(f"1 GiB backed up in {backup['seconds']:.1f}s, {backup['lag_s']:.1f}s after the commit")
    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="gib", capacity="3G", gcs=gcs_url, mountpoint=vol.mountpoint)
    assert tree_digest(again.mountpoint / "ckpt") == expected
    restored = wait_restored(again)["restored"]
    assert (restored["step"], restored["from"], restored["bytes"]) == (1000, gcs_url, 1 << 30)
    print(f"1 GiB restored in {restored['seconds']:.1f}s")
