"""Which engine serves the mount, and so which data path file bytes take.

- ``passthrough``: our own FUSE session (:mod:`tierfs.fs.session`) hands every whole
  file's RAM-tier file to the kernel, which then reads, writes and maps it directly.
- ``daemon``: every byte through the daemon, for kernels without passthrough (Linux < 6.9),
  without ``CAP_SYS_ADMIN`` in the initial user namespace, or when asked for. Served by the
  same own session without passthrough: requests read through a pipe and written bytes
  spliced into their files by worker threads (never copied through Python), and the
  kernel's page cache kept between opens while it is valid. pyfuse3 (libfuse) serves it
  only where the own session cannot mount (``mount(2)`` refused) or when asked for
  (``--engine pyfuse3``).

Both engines call the same :class:`~tierfs.fs.operations.Operations`, so the volume's
semantics do not depend on the choice, with one exception: POSIX ACLs. The own session
negotiates ``FUSE_POSIX_ACL`` with ``FUSE_DONT_MASK``; pyfuse3 can ask for the first but not
the second, and without it the kernel would apply the umask where a default ACL should
decide, so on pyfuse3 the volume refuses ACLs as a file system without them does.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
from typing import TYPE_CHECKING

import pyfuse3

from tierfs.config import DataPath, Engine
from tierfs.fs.pyfuse3_faces import Pyfuse3Volume
from tierfs.fs.session import KernelSession

if TYPE_CHECKING:
    from tierfs.fs.operations import Operations

log = logging.getLogger(__name__)

PASSTHROUGH_KERNEL = (6, 9)  # FUSE_PASSTHROUGH first shipped in Linux 6.9
CAP_SYS_ADMIN = 21
# min/max concurrent request tasks of pyfuse3; only reads of files being restored await,
# so a few spare tasks keep the mount answering while reads wait for chunks.
PYFUSE3_TASKS = (1, 32)
# Threads writing spliced bytes into the RAM tier on the daemon path: one per core, within
# reason (each copies at memory speed; more than the cores only take turns).
WRITERS = max(1, min(4, os.cpu_count() or 1))


class _GoneReplies(logging.Filter):
    """Demotes pyfuse3's error for a reply the kernel no longer waits for.

    The kernel drops a request it has handed out when its caller is interrupted or when
    the mount goes away (an unmount aborts the RELEASEs of files closed just before it);
    writing the reply then fails with ENOENT. libfuse itself ignores that errno, but
    pyfuse3 logs it as an error. Nothing is lost: the handler has already run.
    """

    GONE = f"fuse_reply_* failed with {os.strerror(errno.ENOENT)}"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.getMessage().endswith(self.GONE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class Pyfuse3Engine:
    """pyfuse3's request loop behind the same life cycle as :class:`KernelSession`."""

    name = Engine.PYFUSE3
    data_path = DataPath.DAEMON
    wake_cpus = "off (daemon engine)"
    transfer = "writes copied by 1 thread"
    _gone_replies = _GoneReplies()

    def __init__(self, ops: Operations):
        self.ops = ops
        logging.getLogger("pyfuse3").addFilter(self._gone_replies)  # added once, however many engines

    def mount(self, mountpoint: str, fsname: str, read_only: bool = False) -> None:
        self.ops.writes.threads = 1  # its writes are answered before they are applied: in order
        options = {f"fsname={fsname}", "subtype=tierfs", "allow_other", "default_permissions"}
        try:
            pyfuse3.init(Pyfuse3Volume(self.ops), mountpoint, options | ({"ro"} if read_only else set()))
        except RuntimeError as e:
            raise OSError(f"{e} (is /dev/fuse available?)") from None

    async def run(self) -> None:
        await pyfuse3.main(*PYFUSE3_TASKS)

    def terminate(self) -> None:
        pyfuse3.terminate()

    def close(self, unmount: bool) -> None:
        pyfuse3.close(unmount=unmount)


FuseEngine = KernelSession | Pyfuse3Engine  # what serves the mount


def kernel_version(release: str | None = None) -> tuple[int, int]:
    numbers = (release or platform.release()).split("-")[0].split(".")
    return int(numbers[0]), int(numbers[1]) if len(numbers) > 1 and numbers[1].isdigit() else 0


def passthrough_obstacle() -> str | None:
    """Why this process cannot serve a mount by passthrough, or None if it can.

    The kernel has the last word at INIT; this answers what can be known before mounting.
    """
    if kernel_version() < PASSTHROUGH_KERNEL:
        return f"Linux {platform.release()} has no FUSE passthrough (it needs {'.'.join(map(str, PASSTHROUGH_KERNEL))})"
    try:
        with open("/proc/self/status") as f:
            caps = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
        with open("/proc/self/uid_map") as f:
            initial_ns = f.read().split() == ["0", "0", "4294967295"]
    except (OSError, StopIteration, ValueError) as e:
        return f"cannot read this process's capabilities ({e})"
    if not caps & (1 << CAP_SYS_ADMIN) or not initial_ns:
        return "passthrough needs CAP_SYS_ADMIN in the initial user namespace"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not available"
    return None


def choose_data_path(requested: DataPath) -> tuple[DataPath, str | None]:
    """The data path for ``requested`` (never ``auto``), and why it is not passthrough when it is not.

    Raises ValueError when passthrough is demanded but impossible here.
    """
    if requested == DataPath.DAEMON:
        return DataPath.DAEMON, "--data-path daemon was asked for"
    obstacle = passthrough_obstacle()
    if obstacle is None:
        return DataPath.PASSTHROUGH, None
    if requested == DataPath.PASSTHROUGH:
        raise ValueError(obstacle)
    return DataPath.DAEMON, obstacle


def make_engine(ops: Operations, data_path: DataPath, engine: Engine, wake_cpus: bool = True) -> FuseEngine:
    """The engine serving ``ops`` on ``data_path``, as ``engine`` asks."""
    if engine == Engine.PYFUSE3:
        return Pyfuse3Engine(ops)
    if data_path == DataPath.PASSTHROUGH:
        return KernelSession(ops, wake_cpus=wake_cpus)
    return KernelSession(ops, want_passthrough=False, wake_cpus=wake_cpus, writers=WRITERS)


def fallback_engine(engine: FuseEngine, requested: Engine, error: OSError) -> Pyfuse3Engine | None:
    """pyfuse3 in place of ``engine``, the own session, when its ``mount(2)`` was refused
    (no ``CAP_SYS_ADMIN``: pyfuse3 mounts with the setuid helper ``fusermount3``); None when
    that does not apply."""
    if requested != Engine.AUTO or not isinstance(engine, KernelSession) or engine.want_passthrough:
        return None
    if error.errno not in (errno.EPERM, errno.EACCES):
        return None
    log.warning("the own FUSE engine cannot mount here (%s): pyfuse3 serves the volume instead", error.strerror)
    engine.close(unmount=False)
    return Pyfuse3Engine(engine.ops)
