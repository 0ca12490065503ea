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

A keeper can also hand its connection to another keeper, one of another build in another
container (the CSI plugin's rollout): with ``TIERFS_KEEPER_SOCKET`` it listens on that unix
socket, and a ``tierfs mount`` run with ``TIERFS_ADOPT_FROM`` naming it asks for the
connection (:func:`adopt`): the daemon stops as for an upgrade, the descriptor goes over the
socket (``SCM_RIGHTS``), and this keeper exits. With ``TIERFS_KEEPER_CGROUP`` the keeper
moves itself (and so its daemons) into that cgroup first: out of a container's, whose
crash then ends the plugin but not the mounts.

The keeper does nothing else, so that it has nothing to fail on: no threads, no event
loop, no network, no access to the mount. Should it die all the same, its daemon starts a
new keeper (:func:`replace_keeper`), which watches the running daemon (``TIERFS_KEEPER_WATCH``)
as the first one did, though not as its parent. It ends when its daemon exits cleanly (the
mount was unmounted) or when the connection is gone; SIGTERM and SIGINT are passed on to
the daemon, which unmounts. A successor that keeps dying before it serves is started
again with a growing pause, and given up after :data:`MAX_FAILED_STARTS` tries: the keeper
then closes the connection, and the mount answers ENOTCONN as a dead FUSE mount does.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable

from tierfs.config import Config
from tierfs.core import linux, mounts

log = logging.getLogger("tierfs.keeper")

HANDOVER = 75  # a daemon's exit status when it stopped serving so that a new build takes over
HANDED_OVER = -1000  # run()'s own: the connection went to another keeper
CANNOT_TAKE_OVER = 76  # a successor's exit status when its predecessor's record is unusable
FD_ENV, SOCKET_ENV, ADOPT_ENV, CGROUP_ENV = (
    mounts.KEEPER_FD,
    mounts.KEEPER_SOCKET,
    mounts.ADOPT_FROM,
    mounts.KEEPER_CGROUP,
)
WATCH_ENV = mounts.KEEPER_WATCH
HANDOVER_TIMEOUT = 120.0  # seconds a keeper waits for its daemon to stop for another keeper
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
    """The connection a keeper executed by an upgrade (or started by its orphaned daemon) was handed."""
    value = os.environ.pop(FD_ENV, None)
    return int(value) if value and value.isdigit() else None


def replace_keeper(fuse_fd: int) -> int:
    """From a daemon whose keeper died: start a keeper that watches this daemon; its pid.

    The new keeper runs the command that mounted the volume, as a keeper executed by an
    upgrade does, in a session of its own; the daemon's log is its output."""
    env = {**os.environ, FD_ENV: str(fuse_fd), WATCH_ENV: str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tierfs", *sys.argv[1:]],
        env=env,
        pass_fds=[fuse_fd],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    proc.returncode = 0  # never waited for: a keeper outlives the daemon that started it
    return proc.pid


def adopt(path: str) -> int:
    """The FUSE connection of the keeper listening at ``path``, which stops its daemon, hands
    the descriptor over and exits. Raises OSError if it cannot."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(HANDOVER_TIMEOUT + 10)
        s.connect(path)
        s.sendall(b"handover\n")
        msg, fds, _, _ = socket.recv_fds(s, 256, 1)
    if not fds:
        raise OSError(
            errno.EPROTO, f"the keeper at {path} refused: {msg.decode(errors='replace').strip() or 'no answer'}"
        )
    return fds[0]


def join_cgroup(path: str) -> None:
    """Move this process into the cgroup ``path`` (created if missing): its children follow.

    From the host's cgroup namespace (PID 1's, which a container sees with ``hostPID``):
    the kernel moves a process only between cgroups below its namespace's root, and a
    container's own namespace has its cgroup as the root."""
    try:
        fd = os.open("/proc/1/ns/cgroup", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = None  # no PID 1 to ask: stay in this namespace
    if fd is not None:
        try:
            linux.setns(fd, linux.CLONE_NEWCGROUP)
        finally:
            os.close(fd)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


class Keeper:
    """One mount's keeper; :meth:`run` returns the exit status of the last daemon."""

    def __init__(
        self,
        cfg: Config,
        daemon_main: DaemonMain,
        fuse_fd: int | None = None,
        offer_at: str | None = None,
        watch: int | None = None,
    ):
        self.cfg = cfg
        self._watch = watch  # a running daemon this keeper did not start (its keeper died)
        self._daemon_main = daemon_main
        self.takeover = fuse_fd is not None
        if fuse_fd is None:
            fuse_fd = os.open("/dev/fuse", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.fuse_fd = fuse_fd
        self._child: int | None = None
        self._upgrade = False
        self._stopping = False
        self._listener: socket.socket | None = None
        self._taker: socket.socket | None = None  # the keeper the connection goes to
        if offer_at:
            self._listen(offer_at)

    def _listen(self, path: str) -> None:
        try:
            os.unlink(path)  # a keeper before this one left it, or handed its connection here
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        os.fchmod(s.fileno(), 0o600)  # before bind: root's alone from the moment it exists
        s.bind(path)
        s.listen(4)
        self._listener = s

    def run(self, ready_fd: int | None = None) -> int:
        """Run daemons until the mount ends; the first one's readiness goes to ``ready_fd``."""
        signal.signal(signal.SIGTERM, self._pass_on)
        signal.signal(signal.SIGINT, self._pass_on)
        signal.signal(signal.SIGHUP, self._hand_over)
        failed = 0
        if self._watch is not None:
            self._wait_for(self._watch)
            self.takeover = True
            if self._taker is not None:
                return self._give_connection(self._taker, 0)
            if self._upgrade:
                self._execute_anew()
            if self._stopping or not connected(self.fuse_fd):
                return 0
            log.warning("the daemon of %s (pid %d) is gone: starting a successor", self.cfg.mountpoint, self._watch)
        while True:
            started = time.monotonic()
            pid, report = self._start(ready_fd)
            ready = report.startswith(b"ok")
            if ready_fd is not None:  # the first daemon's word goes to `tierfs mount`
                os.write(ready_fd, report)
                os.close(ready_fd)
                ready_fd = None
            code = self._wait(pid)
            if self._taker is not None:
                return self._give_connection(self._taker, code)
            if code == HANDOVER:
                self._execute_anew()
            if code == 0 or self._stopping or not connected(self.fuse_fd):
                return code
            failed = 0 if ready else failed + 1
            if failed >= MAX_FAILED_STARTS or code == CANNOT_TAKE_OVER:
                log.error(
                    "%s: giving the connection up (the mount answers ENOTCONN; tierfs mount again to recover it)",
                    f"{failed} successors in a row died before serving {self.cfg.mountpoint}"
                    if code != CANNOT_TAKE_OVER
                    else f"no successor can take {self.cfg.mountpoint} over",
                )
                return code or 1
            pause = min(MAX_PAUSE, 0.05 * 2**failed) if failed else 0.0
            log.warning(
                "the daemon of %s (pid %d) %s after %.1f s: %s",
                self.cfg.mountpoint,
                pid,
                _how(code),
                time.monotonic() - started,
                f"starting a successor in {pause:.2f} s" if pause else "starting a successor",
            )
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
                if self._listener is not None:  # the keeper's: its number is free for the daemon
                    self._listener.close()
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
        """Wait for the daemon to exit, meanwhile answering a keeper that asks for the connection."""
        if self._listener is not None:
            self._wait_for(pid)
        _, status = os.waitpid(pid, 0)
        self._child = None
        return os.waitstatus_to_exitcode(status)

    def _wait_for(self, pid: int) -> None:
        """Until process ``pid`` (a child or not) ends, answer a keeper that asks for the connection."""
        self._child = pid
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            if self._listener is not None:
                poller.register(self._listener, select.POLLIN)
            while not any(fd == pidfd for fd, _ in poller.poll()):
                if self._listener is not None:  # the only other descriptor polled
                    self._answer(self._listener)
        finally:
            os.close(pidfd)
            if pid == self._watch:
                self._child = None

    def _answer(self, listener: socket.socket) -> None:
        """A keeper asks for the connection: stop the daemon for it (it is given once the daemon is gone)."""
        conn, _ = listener.accept()
        try:
            conn.settimeout(5)
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if (
                uid != 0
                or conn.recv(64) != b"handover\n"
                or self._taker is not None
                or self._child is None
                or not connected(self.fuse_fd)
            ):  # nothing to hand over (pyfuse3 keeps its own)
                conn.close()
                return
        except OSError:
            conn.close()
            return
        log.info("another keeper asks for %s: the daemon stops for it", self.cfg.mountpoint)
        self._taker = conn
        self._signal_daemon(signal.SIGUSR1)

    def _give_connection(self, taker: socket.socket, code: int) -> int:
        """The daemon is gone: the descriptor goes to the keeper that asked (``taker``), and this one ends."""
        with taker:
            taker.settimeout(HANDOVER_TIMEOUT)
            socket.send_fds(taker, [b"ok\n"], [self.fuse_fd])
        log.info("%s handed over to another keeper (the daemon %s)", self.cfg.mountpoint, _how(code))
        if self._listener is not None:  # always: the taker came through it
            self._listener.close()
        return HANDED_OVER

    def _pass_on(self, signum: int, frame) -> None:
        self._stopping = True
        self._signal_daemon(signum)

    def _hand_over(self, signum: int, frame) -> None:
        if self._child is not None and not self._upgrade and connected(self.fuse_fd):
            log.info("upgrade asked for: the daemon hands %s over to a new keeper", self.cfg.mountpoint)
            self._upgrade = True
            self._signal_daemon(signal.SIGUSR1)

    def _signal_daemon(self, signum: int) -> None:
        """Signal the daemon, unless it is gone already (reaped a moment before this handler ran)."""
        if self._child is not None:
            try:
                os.kill(self._child, signum)
            except ProcessLookupError:
                pass

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
