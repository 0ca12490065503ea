"""The host's view of tierfs mounts: the kernel mount table and the daemons' registry.

Each daemon registers under the runtime directory (``/run/tierfs`` by default) by a key
derived from its mountpoint: ``<key>.json`` (pid, job, rank, ...), ``<key>.sock`` (its
control socket) and ``<key>.log``. The kernel's mount table stays the authority on
whether something is mounted; the registry only says who serves it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierfs.core import linux
from tierfs.core.atomic import UnsafeFile, private_dir, read_small, write_atomically
from tierfs.core.errors import UserError

FSTYPE = "fuse.tierfs"
DEFAULT_RUNTIME_DIR = Path("/run/tierfs")
# What a mount's keeper (tierfs.daemon.keeper) takes from its environment:
KEEPER_FD = "TIERFS_KEEPER_FD"  # the connection, for a keeper executed anew by an upgrade
KEEPER_SOCKET = "TIERFS_KEEPER_SOCKET"  # where a keeper offers its connection to another one
ADOPT_FROM = "TIERFS_ADOPT_FROM"  # the socket of the keeper whose connection `tierfs mount` takes
KEEPER_CGROUP = "TIERFS_KEEPER_CGROUP"  # a cgroup (v2 directory) the keeper and its daemons live in
KEEPER_WATCH = "TIERFS_KEEPER_WATCH"  # the pid of a running daemon whose keeper died, for a new keeper


def runtime_dir() -> Path:
    """Where mounted daemons register themselves (control socket, pid): one per host."""
    return Path(os.environ.get("TIERFS_RUNTIME_DIR", DEFAULT_RUNTIME_DIR))


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    fstype: str
    source: str
    minor: int
    options: tuple[str, ...] = ()  # the file system's own (mountinfo's last field)


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "surrogateescape")


def mount_table() -> list[MountEntry]:
    """Every mount in /proc/self/mountinfo, in its order (a mount comes after the one it covers)."""
    entries = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype, source, options = right.split()[:3]
            entries.append(
                MountEntry(
                    _unescape(fields[4]),
                    fstype,
                    _unescape(source),
                    int(fields[2].split(":")[1]),
                    tuple(options.split(",")),
                )
            )
    return entries


def large_folios(path: str | os.PathLike[str]) -> str | None:
    """The ``huge=`` option of the tmpfs holding ``path``, where it stores files in large folios."""
    dev = os.stat(path).st_dev
    if os.major(dev) != 0:  # tmpfs: major 0, a minor of its own
        return None
    entry = next((e for e in reversed(mount_table()) if e.fstype == "tmpfs" and e.minor == os.minor(dev)), None)
    return next((o for o in entry.options if o.startswith("huge=") and o != "huge=never"), None) if entry else None


def find_mount(mountpoint: str | os.PathLike[str]) -> MountEntry | None:
    """The topmost mount at ``mountpoint`` in /proc/self/mountinfo, if any."""
    target = os.path.abspath(mountpoint)
    found = None
    for entry in mount_table():
        if entry.mountpoint == target:
            found = entry
    return found


def is_dead(mountpoint: str | os.PathLike[str]) -> bool:
    """A FUSE mount whose daemon died answers ENOTCONN to every request that reaches it.

    statfs() always reaches the daemon; stat() may be answered from the kernel's cache.
    """
    try:
        os.statvfs(mountpoint)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


class Registration:
    """The runtime files of the daemon serving one mountpoint."""

    def __init__(self, mountpoint: str | os.PathLike[str]):
        self.mountpoint = os.path.abspath(mountpoint)
        key = hashlib.sha256(os.fsencode(self.mountpoint)).hexdigest()[:20]
        base = runtime_dir()
        self.info_path = base / f"{key}.json"
        self.socket_path = base / f"{key}.sock"
        self.log_path = base / f"{key}.log"

    def prepare(self) -> None:
        """Create the runtime directory (root-only), or check the one there: raises UserError if
        others could replace the control socket or the registration in it."""
        try:
            private_dir(self.info_path.parent, own=False)
        except UnsafeFile as e:
            raise UserError(f"unsafe runtime directory (TIERFS_RUNTIME_DIR): {e}") from None

    def write(self, info: Mapping[str, object]) -> None:
        private_dir(self.info_path.parent, own=False)
        write_atomically(self.info_path, json.dumps(info), 0o600)

    def read(self) -> dict[str, Any] | None:
        """The registration, if there is one that the daemon's user wrote (it names a pid)."""
        try:
            info: dict[str, Any] = json.loads(read_small(self.info_path, 1 << 16, private=True))  # the daemon's JSON
            return info
        except (OSError, ValueError, UnsafeFile):
            return None

    def remove(self) -> None:
        for p in (self.info_path, self.socket_path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def process_alive(pid: int) -> bool:
    """True while any thread of ``pid`` runs.

    The thread-group leader turns zombie as soon as it exits, while its other threads
    may still be tearing down and holding /dev/fuse open; only when every thread is a
    zombie (or gone) has the kernel released the process's files.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    return True
        except OSError:
            continue
    return False


def prepare_mountpoint(mountpoint: Path) -> None:
    """Check the mountpoint; clear a dead tierfs mount left by a killed daemon."""
    entry = find_mount(mountpoint)
    if entry is not None and entry.fstype.startswith("fuse"):
        if is_dead(mountpoint):
            linux.umount(str(mountpoint), linux.MNT_DETACH)
            entry = None
        else:
            info = Registration(mountpoint).read() or {}
            raise UserError(
                f"mountpoint {mountpoint} is busy: {entry.fstype} is already mounted there"
                + (f" (tierfs pid {info['pid']})" if "pid" in info else "")
                + f"; unmount it first (tierfs unmount {mountpoint})"
            )
    if not os.path.lexists(mountpoint):
        raise UserError(f"mountpoint {mountpoint} does not exist: create it first (mkdir -p {mountpoint})")
    if not mountpoint.is_dir():
        raise UserError(f"mountpoint {mountpoint} is not a directory")


def unmount(mountpoint: Path, timeout: float = 30.0) -> None:
    """Unmount and wait until the daemon has finished, so its state is on the ramdisk."""
    entry = find_mount(mountpoint)
    if entry is None:
        raise UserError(f"{mountpoint} is not mounted")
    if entry.fstype != FSTYPE:
        raise UserError(f"{mountpoint} is not a tierfs mount (it is {entry.fstype}): use umount")
    reg = Registration(mountpoint)
    info = reg.read() or {}
    try:
        linux.umount(str(mountpoint), linux.MNT_DETACH if is_dead(mountpoint) else 0)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise UserError(
                f"{mountpoint} is busy: a process still has files open there or works in it "
                f"(see: fuser -m {mountpoint}); close them and retry"
            ) from None
        raise UserError(f"could not unmount {mountpoint}: {e.strerror}") from None
    deadline = time.monotonic() + timeout
    for what, pid in (("daemon", info.get("pid")), ("keeper", info.get("keeper"))):
        while pid and process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid and process_alive(pid):
            raise UserError(f"{mountpoint} is unmounted but {what} pid {pid} has not exited after {timeout:.0f}s")
    reg.remove()
