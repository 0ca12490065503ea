"""The keeper: holds a mount's FUSE connection for as long as the mount lives, and runs its
daemon as a child, starting a successor whenever the daemon dies.

The kernel keeps a FUSE connection while any descriptor of its ``/dev/fuse`` file is open,
and a request it sent stays queued, not failed, while nobody answers it. So a daemon's
death need not reach the job: the keeper opens ``/dev/fuse`` before the first daemon
mounts with it, and every daemon it starts inherits that descriptor. When a daemon dies
(a crash, a bug, the OOM killer, ``kill -9``) while the connection lives, the keeper
forks a successor at once; the successor takes the connection over from the record its
predecessor kept (:mod:`tierfs.fs.recovery`), asks the kernel to send again what was left
unanswered, and serves on. The job sees a pause.

``tierfs upgrade`` sends the keeper SIGHUP: the keeper asks its daemon to stop serving
(SIGUSR1; it exits with :data:`HANDOVER`), then executes the installed ``tierfs`` anew,
keeping the descriptor, and that keeper starts a successor of the new build.

The keeper does nothing else, so that it has nothing to fail on: no threads, no event
loop, no network, no access to the mount. It ends when its daemon exits cleanly (the
mount was unmounted) or when the connection is gone; SIGTERM and SIGINT are passed on to
the daemon, which unmounts. A successor that keeps dying before it serves is started
again with a growing pause, and given up after :data:`MAX_FAILED_STARTS` tries: the keeper
then closes the connection, and the mount answers ENOTCONN as a dead FUSE mount does.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from typing import Callable

from tierfs.config import Config

log = logging.getLogger("tierfs.keeper")

HANDOVER = 75  # a daemon's exit status when it stopped serving so that a new build takes over
CANNOT_TAKE_OVER = 76  # a successor's exit status when its predecessor's record is unusable
FD_ENV = "TIERFS_KEEPER_FD"  # the connection, for a keeper executed anew by an upgrade
MAX_FAILED_STARTS = 10
MAX_PAUSE = 5.0  # seconds between failed starts, at most

# The daemon's part, run in each child: (config, ready descriptor, /dev/fuse descriptor,
# whether it takes over a live connection) -> exit status.
DaemonMain = Callable[[Config, int, int, bool], int]


def connected(fd: int) -> bool:
    """Whether the FUSE connection of ``fd`` lives: mounted, and neither unmounted nor aborted
    (the device reports POLLERR then, and for a descriptor that was never mounted)."""
    p = select.poll()
    p.register(fd, 0)
    return not any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in p.poll(0))


def inherited_connection() -> int | None:
    """The connection a keeper executed by an upgrade was handed, if this is one."""
    value = os.environ.pop(FD_ENV, None)
    return int(value) if value and value.isdigit() else None


class Keeper:
    """One mount's keeper; :meth:`run` returns the exit status of the last daemon."""

    def __init__(self, cfg: Config, daemon_main: DaemonMain, fuse_fd: int | None = None):
        self.cfg = cfg
        self._daemon_main = daemon_main
        self.takeover = fuse_fd is not None
        if fuse_fd is None:
            fuse_fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.fuse_fd = fuse_fd
        self._child: int | None = None
        self._upgrade = False
        self._stopping = False

    def run(self, ready_fd: int | None = None) -> int:
        """Run daemons until the mount ends; the first one's readiness goes to ``ready_fd``."""
        signal.signal(signal.SIGTERM, self._pass_on)
        signal.signal(signal.SIGINT, self._pass_on)
        signal.signal(signal.SIGHUP, self._hand_over)
        failed = 0
        while True:
            started = time.monotonic()
            pid, report = self._start(ready_fd)
            ready = report.startswith(b"ok")
            if ready_fd is not None:  # the first daemon's word goes to `tierfs mount`
                os.write(ready_fd, report)
                os.close(ready_fd)
                ready_fd = None
            code = self._wait(pid)
            if code == HANDOVER:
                self._execute_anew()
            if code == 0 or self._stopping or not connected(self.fuse_fd):
                return code
            failed = 0 if ready else failed + 1
            if failed >= MAX_FAILED_STARTS or code == CANNOT_TAKE_OVER:
                log.error("%s: giving the connection up (the mount answers ENOTCONN; tierfs mount again to "
                          "recover it)", f"{failed} successors in a row died before serving {self.cfg.mountpoint}"
                          if code != CANNOT_TAKE_OVER else f"no successor can take {self.cfg.mountpoint} over")
                return code or 1
            pause = min(MAX_PAUSE, 0.05 * 2 ** failed) if failed else 0.0
            log.warning("the daemon of %s (pid %d) %s after %.1f s: %s", self.cfg.mountpoint, pid,
                        _how(code), time.monotonic() - started,
                        f"starting a successor in {pause:.2f} s" if pause else "starting a successor")
            time.sleep(pause)
            self.takeover = True

    def _start(self, ready_fd: int | None) -> tuple[int, bytes]:
        """Fork a daemon; its pid and what it reported once mounted (or b"" if it died first).
        ``ready_fd`` is the keeper's to write, never the daemon's to hold open."""
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read_fd)
                if ready_fd is not None:
                    os.close(ready_fd)
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_DFL)
                code = self._daemon_main(self.cfg, write_fd, self.fuse_fd, self.takeover)
            except BaseException:  # noqa: BLE001 (a bug: its traceback, in the log)
                import traceback  # noqa: PLC0415

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self._child = pid
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as f:
            report = f.read()
        return pid, report

    def _wait(self, pid: int) -> int:
        _, status = os.waitpid(pid, 0)
        self._child = None
        return os.waitstatus_to_exitcode(status)

    def _pass_on(self, signum: int, frame) -> None:
        self._stopping = True
        if self._child is not None:
            os.kill(self._child, signum)

    def _hand_over(self, signum: int, frame) -> None:
        if self._child is not None and not self._upgrade:
            log.info("upgrade asked for: the daemon hands %s over to a new keeper", self.cfg.mountpoint)
            self._upgrade = True
            os.kill(self._child, signal.SIGUSR1)

    def _execute_anew(self) -> None:
        """Become the installed build's keeper, handing it the connection (never returns)."""
        os.set_inheritable(self.fuse_fd, True)
        os.environ[FD_ENV] = str(self.fuse_fd)
        argv = [sys.executable, "-m", "tierfs", *sys.argv[1:]]
        log.info("executing %s to take %s over", " ".join(argv), self.cfg.mountpoint)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, argv)


def _how(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
