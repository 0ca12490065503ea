"""``tierfs steps``: a mount's steps on every tier it reaches, a bucket's without a mount, and the one-line errors."""

from __future__ import annotations

import json
import os
import secrets

from tierfs_testing import crash, free_port

from tests.cli.test_cli import one_line_error
from tests.conftest import tierfs
from tests.helpers import wait_for, write_orbax_step
from tierfs.core import mounts

MiB = 1 << 20
SIZES = {1: 3 * MiB + 11, 2: 2 * MiB + 7, 3: MiB + 5}  # bytes each step writes


def listed(*args, env: dict | None = None) -> list[dict]:
    return json.loads(tierfs("steps", *args, "--json", env=env).stdout)


def backed_up(vol, step: int) -> bool:
    return any(s["step"] == step and s["backed_up"] for s in vol.status()["steps"])


def test_a_mount_lists_its_steps_in_ram_and_gcs_and_the_bucket_lists_them_without_it(volumes, gcs_bucket, monkeypatch):
    secret = secrets.token_hex(32)
    monkeypatch.setenv("TIERFS_SECRET", secret)
    url = f"gs://{gcs_bucket}/steps"
    vol = volumes(job="stp", capacity="256M", gcs=url, keep_every=2)
    for step, size in SIZES.items():
        write_orbax_step(vol.mountpoint, step, {"params": os.urandom(size - 100), "meta": b"m" * 100})
        wait_for(lambda: backed_up(vol, step), 30, f"step {step} in GCS")

    steps = listed(vol.mountpoint)
    assert [s["step"] for s in steps] == [3, 2, 1]  # newest first
    for s in steps:
        assert "gcs" in s["tiers"] and s["complete"] == 1 and s["nodes"] == 1 and s["missing_ranks"] == []
        assert s["size"] == SIZES[s["step"]], s
        assert s["age_s"] is not None and 0 <= s["age_s"] < 120
        assert s["milestone"] == (s["step"] == 2)
    assert steps[0]["tiers"] == ["ram", "gcs"]  # the newest stays in RAM (--keep-local 1)
    text = tierfs("steps", vol.mountpoint).stdout.splitlines()
    assert text[0].split() == ["STEP", "TIERS", "COMPLETE", "SIZE", "AGE", "MILESTONE"]
    assert text[1].split()[:3] == ["3", "ram,gcs", "1/1"] and text[2].split()[-1] == "yes"

    # From a machine without a mount: the bucket alone, verified with the job's secret.
    bucket = listed("--job", "stp", "--gcs", url, "--keep-every", "2")
    assert [(s["step"], s["tiers"], s["complete"], s["nodes"], s["size"], s["milestone"]) for s in bucket] == [
        (step, ["gcs"], 1, 1, SIZES[step], step == 2) for step in (3, 2, 1)
    ]
    two = listed("--job", "stp", "--gcs", url, "--nodes", "2")
    assert [(s["complete"], s["nodes"], s["missing_ranks"]) for s in two] == [(1, 2, [1])] * 3
    # Without it the manifests cannot be verified: one line says so, and no size is guessed.
    env = {k: v for k, v in os.environ.items() if k != "TIERFS_SECRET"}
    proc = tierfs("steps", "--job", "stp", "--gcs", url, "--json", env=env)
    assert [(s["step"], s["size"]) for s in json.loads(proc.stdout)] == [(3, None), (2, None), (1, None)]
    assert len(proc.stderr.strip().splitlines()) == 1 and "sealed" in proc.stderr and "TIERFS_SECRET" in proc.stderr
    # Under another secret none of them is the job's: left out, and one line says so.
    other = {**env, "TIERFS_SECRET": secrets.token_hex(32)}
    proc = tierfs("steps", "--job", "stp", "--gcs", url, "--json", env=other)
    assert json.loads(proc.stdout) == [] and len(proc.stderr.strip().splitlines()) == 1
    assert "left out" in proc.stderr and "(and 2 more like it)" in proc.stderr, proc.stderr
    # Another job's name in the same bucket holds nothing.
    assert listed("--job", "other", "--gcs", url) == []


def test_bad_input_is_one_line(volumes, gcs_emulator, tmp_path):
    one_line_error(tierfs("steps", check=False), "MOUNTPOINT", "--gcs")
    one_line_error(tierfs("steps", tmp_path, check=False), "is not a tierfs mount")
    one_line_error(tierfs("steps", "--job", "j", "--gcs", "s3://b/p", check=False), "invalid GCS URL")
    one_line_error(tierfs("steps", "--gcs", "gs://some-bucket/p", check=False), "--job")
    one_line_error(tierfs("steps", tmp_path, "--job", "j", check=False), "--job", "--gcs")
    one_line_error(tierfs("steps", "--job", "j", "--gcs", "gs://no-such-bucket-here/p", check=False), "does not exist")
    nowhere = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{free_port()}"}
    one_line_error(
        tierfs("steps", "--job", "j", "--gcs", "gs://some-bucket/p", check=False, env=nowhere),
        "cannot reach gs://some-bucket/p",
    )
    vol = volumes(job="gone")
    assert listed(vol.mountpoint) == []
    assert tierfs("steps", vol.mountpoint).stdout.strip() == "no steps on any tier"
    crash(mounts.Registration(vol.mountpoint).read())
    one_line_error(tierfs("steps", vol.mountpoint, check=False), "gone", "tierfs mount")
