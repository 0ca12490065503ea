"""Capacity: the RAM a volume may use is bounded, and space comes back on delete."""

from __future__ import annotations

import errno
import os

import pytest

MiB = 1 << 20


def fill(path, nbytes: int, block: int = MiB) -> int:
    """Write until ``nbytes`` or ENOSPC; returns bytes written."""
    done = 0
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        while done < nbytes:
            done += os.write(fd, b"\xab" * min(block, nbytes - done))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return done


def test_write_past_capacity_fails_with_enospc_and_damages_nothing(volumes):
    vol = volumes(capacity="32M")
    keep = os.urandom(8 * MiB)
    (vol.mountpoint / "keep").write_bytes(keep)
    written = fill(vol.mountpoint / "big", 64 * MiB)
    assert 16 * MiB <= written <= 24 * MiB
    with pytest.raises(OSError) as e:
        (vol.mountpoint / "more").write_bytes(b"x" * MiB)
    assert e.value.errno == errno.ENOSPC
    assert (vol.mountpoint / "keep").read_bytes() == keep
    assert os.path.getsize(vol.mountpoint / "big") == written
    assert vol.status()["tiers"]["ram"]["used"] <= 32 * MiB


def test_space_comes_back_after_delete(volumes):
    vol = volumes(capacity="16M")
    assert fill(vol.mountpoint / "a", 12 * MiB) == 12 * MiB
    assert fill(vol.mountpoint / "b", 12 * MiB) < 12 * MiB
    os.unlink(vol.mountpoint / "a")
    os.unlink(vol.mountpoint / "b")
    assert fill(vol.mountpoint / "c", 12 * MiB) == 12 * MiB


def test_space_of_open_unlinked_file_returns_at_close(volumes):
    vol = volumes(capacity="16M")
    fill(vol.mountpoint / "a", 12 * MiB)
    fd = os.open(vol.mountpoint / "a", os.O_RDONLY)
    os.unlink(vol.mountpoint / "a")
    assert vol.status()["tiers"]["ram"]["used"] >= 12 * MiB  # still held, as on tmpfs
    os.close(fd)
    assert fill(vol.mountpoint / "c", 12 * MiB) == 12 * MiB


def test_overwrite_in_place_and_replace_by_rename_near_full(volumes):
    vol = volumes(capacity="16M")
    p = vol.mountpoint / "f"
    assert fill(p, 10 * MiB) == 10 * MiB
    with open(p, "r+b") as f:  # rewriting allocated bytes needs no new space
        f.write(b"\0" * 10 * MiB)
    (vol.mountpoint / "new").write_bytes(b"n" * 4 * MiB)
    os.replace(vol.mountpoint / "new", p)  # the replaced 10 MiB are freed
    assert fill(vol.mountpoint / "g", 10 * MiB) == 10 * MiB


def test_hard_links_count_once_and_truncate_frees(volumes):
    vol = volumes(capacity="16M")
    fill(vol.mountpoint / "a", 8 * MiB)
    os.link(vol.mountpoint / "a", vol.mountpoint / "b")
    assert vol.status()["tiers"]["ram"]["used"] == 8 * MiB
    os.unlink(vol.mountpoint / "a")
    assert vol.status()["tiers"]["ram"]["used"] == 8 * MiB
    os.truncate(vol.mountpoint / "b", MiB)
    assert vol.status()["tiers"]["ram"]["used"] == MiB
    os.truncate(vol.mountpoint / "b", 100 * MiB)  # a hole: no space, as on tmpfs
    assert vol.status()["tiers"]["ram"]["used"] == MiB


def test_a_full_ramdisk_fails_the_write_itself_without_capacity(volumes, small_tmpfs):
    """Without --capacity the ramdisk's own size is the limit, and ENOSPC is still the
    answer of the write that passes it: writes are answered before they are copied only
    while they surely fit."""
    ramdisk = small_tmpfs(24 * MiB)
    vol = volumes(ramdisk_dir=ramdisk)
    keep = os.urandom(4 * MiB)
    (vol.mountpoint / "keep").write_bytes(keep)
    written = fill(vol.mountpoint / "big", 64 * MiB)
    assert 16 * MiB <= written < 24 * MiB
    assert os.path.getsize(vol.mountpoint / "big") == written
    assert (vol.mountpoint / "keep").read_bytes() == keep


def test_a_volume_on_a_large_folio_ramdisk_has_large_folios_and_an_exact_capacity(small_tmpfs, volumes):
    """The rank's --capacity tmpfs takes the ramdisk's huge= option; status says so."""
    large = volumes(ramdisk_dir=small_tmpfs(256 * MiB, "huge=within_size"), capacity="32M")
    assert large.status()["tiers"]["ram"]["large_folios"]
    data = os.urandom(8 * MiB)
    (large.mountpoint / "keep").write_bytes(data)
    assert (large.mountpoint / "keep").read_bytes() == data
    assert 16 * MiB <= fill(large.mountpoint / "big", 64 * MiB) <= 24 * MiB

    plain = volumes(capacity="32M", job="plain")
    assert not plain.status()["tiers"]["ram"]["large_folios"]
