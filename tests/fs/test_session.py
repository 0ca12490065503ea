"""tierfs' own FUSE session, mounted in this process: the engine choice, passthrough
bookkeeping, the daemon path it falls back to, and requests served concurrently.

The session runs in the test's trio loop; the file system is used from threads and
processes, as the kernel requires (a request waits for this very loop).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import random
import stat
import sys
import textwrap
from pathlib import Path

import pyfuse3
import pytest
import trio

from tests.helpers import cpu_latency_limit
from tierfs.config import DataPath, Engine
from tierfs.core import linux
from tierfs.fs import Operations, abi, engine, poller
from tierfs.fs.session import KernelSession
from tierfs.ramtier import SpaceAccount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
MiB = 1 << 20


class Mounted:
    def __init__(self, session: KernelSession, ops: Operations, mountpoint: Path, tree: Path):
        self.session, self.ops, self.mountpoint, self.tree = session, ops, mountpoint, tree

    async def run(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args)


@pytest.fixture
async def mounted(shm_dir, nursery):
    """Factory: mount ``ops_class`` over a fresh tree with a session; unmounted afterwards."""
    made: list[KernelSession] = []

    async def mount(
        want_passthrough: bool = True,
        ops_class=Operations,
        wake_cpus: bool = True,
        capacity: int | None = None,
        writers: int = 1,
    ) -> Mounted:
        tree, mountpoint = shm_dir("tierfs-tree"), shm_dir("tierfs-mnt")
        os.chmod(tree, 0o1777)
        ops = ops_class(tree, SpaceAccount(capacity, tree))
        session = KernelSession(ops, want_passthrough=want_passthrough, wake_cpus=wake_cpus, writers=writers)
        session.mount(str(mountpoint), "test")
        made.append(session)

        async def serve():
            with ops.writes:  # the write-behind workers live as long as the request loop, as in the daemon
                await session.run()

        nursery.start_soon(serve)
        await trio.to_thread.run_sync(os.stat, mountpoint)  # INIT is done once this answers
        return Mounted(session, ops, mountpoint, tree)

    try:
        yield mount
    finally:
        for session in made:
            session.terminate()
            session.close(unmount=True)
            session.ops.close()


def test_auto_falls_back_to_the_daemon_path_with_the_reason(monkeypatch):
    monkeypatch.setattr(engine.platform, "release", lambda: "6.8.12-generic")
    path, why = engine.choose_data_path(DataPath.AUTO)
    assert path == DataPath.DAEMON and "6.8.12" in why and "6.9" in why
    with pytest.raises(ValueError, match="6.9"):
        engine.choose_data_path(DataPath.PASSTHROUGH)
    assert engine.choose_data_path(DataPath.DAEMON)[0] == DataPath.DAEMON
    assert engine.kernel_version("6.18.0-rc1") == (6, 18)


def test_pyfuse3_takes_over_the_daemon_path_only_where_the_own_engine_may_not_mount(shm_dir):
    tree = shm_dir()
    ops = Operations(tree, SpaceAccount(None, tree))
    refused = OSError(errno.EPERM, os.strerror(errno.EPERM))
    try:
        own = engine.make_engine(ops, DataPath.DAEMON, Engine.AUTO)
        assert isinstance(own, KernelSession) and not own.want_passthrough
        assert isinstance(engine.fallback_engine(own, Engine.AUTO, refused), engine.Pyfuse3Engine)
        assert engine.fallback_engine(own, Engine.TIERFS, refused) is None  # asked for by name: the error stands
        assert engine.fallback_engine(own, Engine.AUTO, OSError(errno.ENODEV, "no /dev/fuse")) is None
        passthrough = engine.make_engine(ops, DataPath.PASSTHROUGH, Engine.AUTO)
        assert engine.fallback_engine(passthrough, Engine.AUTO, refused) is None  # pyfuse3 cannot pass through
        passthrough.close(unmount=False)
        assert isinstance(engine.make_engine(ops, DataPath.DAEMON, Engine.PYFUSE3), engine.Pyfuse3Engine)
    finally:
        ops.close()


def test_this_machine_can_pass_through():
    assert engine.passthrough_obstacle() is None
    assert engine.choose_data_path(DataPath.AUTO) == (DataPath.PASSTHROUGH, None)


def test_the_daemon_engine_logs_a_reply_the_kernel_dropped_only_at_debug(caplog):
    """An unmount aborts the RELEASEs of files closed just before it; pyfuse3's
    'reply failed with ENOENT' for them is no error of the volume's."""
    engine.Pyfuse3Engine(ops=None)
    pyfuse3_log = logging.getLogger("pyfuse3")
    with caplog.at_level(logging.INFO, logger="pyfuse3"):
        pyfuse3_log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
        pyfuse3_log.error("fuse_write(): fuse_reply_* failed with %s", os.strerror(errno.EINVAL))
    assert [r.getMessage() for r in caplog.records] == [
        f"fuse_write(): fuse_reply_* failed with {os.strerror(errno.EINVAL)}"
    ]
    with caplog.at_level(logging.DEBUG, logger="pyfuse3"):
        pyfuse3_log.error("fuse_release(): fuse_reply_* failed with %s", os.strerror(errno.ENOENT))
    assert caplog.records[-1].levelname == "DEBUG"


async def test_whole_files_pass_through_and_share_one_backing_file(mounted):
    m = await mounted()
    assert m.session.data_path == "passthrough"
    path = m.mountpoint / "f"

    def use() -> tuple[int, int, bytes]:
        path.write_bytes(b"a" * 100_000)
        first = os.open(path, os.O_RDWR)
        second = os.open(path, os.O_RDONLY)
        try:
            os.pwrite(first, b"b" * 10, 0)
            opens = m.ops.hooks.backing.opens(os.stat(m.tree / "f").st_ino)
            return opens, len(m.ops.hooks.backing), os.pread(second, 12, 0)
        finally:
            os.close(first)
            os.close(second)

    opens, handles, head = await m.run(use)
    assert (opens, handles) == (2, 2)  # both opens of the inode use one backing id
    assert head == b"b" * 10 + b"aa"
    await trio.sleep(0.2)  # releases reach the daemon after close() returns
    assert len(m.ops.hooks.backing) == 0 and m.ops.counters["passthrough_opens"] == 3
    assert m.ops.counters["bytes_written"] == 0  # the kernel wrote, not the daemon


async def test_a_session_without_passthrough_serves_every_byte(mounted):
    m = await mounted(want_passthrough=False)
    assert m.session.data_path == "daemon" and m.ops.hooks.backing is None
    data = os.urandom(3 << 20)

    def use():
        (m.mountpoint / "d").mkdir()
        (m.mountpoint / "d" / "f").write_bytes(data)
        os.truncate(m.mountpoint / "d" / "f", 1 << 20)
        os.setxattr(m.mountpoint / "d" / "f", "user.k", b"v")
        os.symlink("f", m.mountpoint / "d" / "l")
        os.rename(m.mountpoint / "d", m.mountpoint / "e")
        return (
            (m.mountpoint / "e" / "l").read_bytes(),
            os.getxattr(m.mountpoint / "e" / "f", "user.k"),
            sorted(os.listdir(m.mountpoint / "e")),
            os.statvfs(m.mountpoint).f_bsize,
        )

    content, xattr, names, bsize = await m.run(use)
    assert content == data[: 1 << 20] and xattr == b"v" and names == ["f", "l"] and bsize == 4096
    assert (m.tree / "e" / "f").read_bytes() == data[: 1 << 20]
    assert m.ops.counters["bytes_written"] == len(data) and m.ops.counters["passthrough_opens"] == 0


def unaligned(data: bytes) -> memoryview:
    """``data`` in a buffer that starts 100 bytes into a page (a direct write's request then
    touches one page more than its size)."""
    buf = bytearray(len(data) + 4096)
    start = 100 - (ctypes.addressof(ctypes.c_char.from_buffer(buf)) % 4096) % 4096
    start %= 4096
    view = memoryview(buf)[start : start + len(data)]
    view[:] = data
    return view


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR], ids=["direct", "page-cache"])
async def test_daemon_path_writes_are_spliced_whole_from_several_writers_at_once(mounted, flags):
    """Writes of every size up to past the largest request, from buffers on and off page
    boundaries, at random offsets, by four writers at once: every byte lands in the RAM
    tier. (Write-only opens are direct I/O, the writer's own pages in the pipe;
    read-write ones go through the page cache.)"""
    m = await mounted(want_passthrough=False, writers=2)
    assert m.session.transfer == "writes spliced by 2 threads" and m.session.max_write < 1 << 20
    rng = random.Random(11)
    plans = [
        [
            (rng.randrange(0, 4 << 20), rng.choice([1, 4096, 65536, m.session.max_write, 1 << 20, 3 << 20]))
            for _ in range(40)
        ]
        for _ in range(4)
    ]

    def write(w: int) -> bytes:
        model = bytearray()
        fd = os.open(m.mountpoint / f"w{w}", os.O_CREAT | flags, 0o644)
        try:
            for i, (offset, size) in enumerate(plans[w]):
                data = bytes([(w * 40 + i) % 251 + 1]) * size
                assert os.pwrite(fd, unaligned(data) if i % 2 else data, offset) == size
                model[len(model) :] = bytes(max(0, offset + size - len(model)))
                model[offset : offset + size] = data
        finally:
            os.close(fd)
        return bytes(model)

    async with trio.open_nursery() as writers:
        models = {}

        async def writer(w):
            models[w] = await trio.to_thread.run_sync(write, w)

        for w in range(4):
            writers.start_soon(writer, w)
    for w, model in models.items():
        assert (m.tree / f"w{w}").read_bytes() == model
        assert await m.run((m.mountpoint / f"w{w}").read_bytes) == model  # read back through the mount
    assert m.ops.counters["bytes_written"] == sum(size for plan in plans for _, size in plan)


class CountingReads(Operations):
    """Counts the reads that reach the daemon."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = 0

    def read_size(self, fh, off, size):  # a read spliced from the file
        self.reads += 1
        return super().read_size(fh, off, size)

    def read(self, fh, off, size):  # a read copied through the daemon
        self.reads += 1
        return super().read(fh, off, size)


async def test_the_page_cache_is_kept_while_valid_and_dropped_after_a_direct_write(mounted):
    """On the daemon path, what a read-write open wrote through the page cache is read back
    from it by the next open, without the daemon; a write-only open's writes bypass it (direct
    I/O), so the next open drops it and reads the new bytes."""
    m = await mounted(want_passthrough=False, ops_class=CountingReads)
    path = m.mountpoint / "f"
    first, second = os.urandom(4 << 20), os.urandom(4 << 20)

    def write(flags: int, data: bytes) -> None:
        fd = os.open(path, os.O_CREAT | flags, 0o644)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)

    await m.run(write, os.O_RDWR, first)
    assert await m.run(path.read_bytes) == first
    assert m.ops.reads == 0
    await m.run(write, os.O_WRONLY, second)
    assert await m.run(path.read_bytes) == second
    assert m.ops.reads > 0


class CountingOperations(Operations):
    """Counts the fallocate and lseek requests that reach the daemon."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = {"fallocate": 0, "lseek": 0}

    async def fallocate(self, fh, mode, offset, length, ctx):
        self.calls["fallocate"] += 1
        return await super().fallocate(fh, mode, offset, length, ctx)

    async def lseek(self, fh, offset, whence):
        self.calls["lseek"] += 1
        return await super().lseek(fh, offset, whence)


@pytest.mark.parametrize("want_passthrough", [True, False], ids=["passthrough", "daemon-path"])
async def test_fallocate_and_seek_holes_are_served_on_the_backing_file(mounted, want_passthrough):
    """The own engine serves FUSE_FALLOCATE and FUSE_LSEEK on the open file's backing file;
    a preallocation is held to the space account (the tree here is no tmpfs of that size)."""
    m = await mounted(want_passthrough=want_passthrough, ops_class=CountingOperations, capacity=16 * MiB)
    assert m.session.data_path == ("passthrough" if want_passthrough else "daemon")
    keep, punch = linux.FALLOC_FL_KEEP_SIZE, linux.FALLOC_FL_PUNCH_HOLE | linux.FALLOC_FL_KEEP_SIZE

    def attempt(fd, mode, offset, length):
        try:
            linux.fallocate(fd, mode, offset, length)
        except OSError as e:
            return errno.errorcode[e.errno]
        return "ok"

    def use():
        out = {}
        p = m.mountpoint / "f"
        fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
        reader = os.open(p, os.O_RDONLY)
        try:
            out["too big"] = attempt(fd, 0, 0, 32 * MiB), os.fstat(fd).st_size, os.fstat(fd).st_blocks
            out["fits"] = attempt(fd, 0, 0, 8 * MiB), os.fstat(fd).st_size, m.ops.space.used
            out["keep size too big"] = attempt(fd, keep, 8 * MiB, 9 * MiB), os.fstat(fd).st_blocks
            os.pwrite(fd, b"d" * MiB, 2 * MiB)
            out["punch"] = attempt(fd, punch, 0, 2 * MiB + 4096), m.ops.space.used
            out["read"] = os.pread(reader, 8, 2 * MiB + 4092), os.pread(reader, 4, 3 * MiB - 4)
            out["seek"] = (
                os.lseek(reader, 0, os.SEEK_DATA),
                os.lseek(reader, 2 * MiB + 4096, os.SEEK_HOLE),
                os.lseek(fd, 3 * MiB, os.SEEK_HOLE),
            )
            out["keep size fits"] = attempt(fd, keep, 8 * MiB, 9 * MiB), os.fstat(reader).st_size
        finally:
            os.close(fd)
        try:  # no writer left that could have pages in the kernel's cache: tmpfs' holes
            out["seek closed"] = (os.lseek(reader, 0, os.SEEK_DATA), os.lseek(reader, 2 * MiB + 4096, os.SEEK_HOLE))
        finally:
            os.close(reader)
        return out

    out = await m.run(use)
    assert out["too big"] == ("ENOSPC", 0, 0)
    assert out["fits"] == ("ok", 8 * MiB, 8 * MiB)
    assert out["keep size too big"] == ("ENOSPC", 8 * MiB // 512)
    assert out["punch"] == ("ok", 6 * MiB - 4096)
    assert out["read"] == (bytes(4) + b"dddd", b"dddd")
    # preallocated pages are holes to tmpfs; on the daemon path the kernel first writes back
    # what a read-write open may have dirtied through a mapping
    assert out["seek"] == (2 * MiB + 4096, 3 * MiB, 3 * MiB)
    assert out["seek closed"] == (2 * MiB + 4096, 3 * MiB)
    assert out["keep size fits"] == ("ok", 8 * MiB)
    assert m.ops.calls["fallocate"] == 5 and m.ops.calls["lseek"] == 5
    assert os.stat(m.tree / "f").st_blocks * 512 == m.ops.space.used == 15 * MiB - 4096


class StallingOperations(Operations):
    """Fault injection: the first ``statfs`` waits until released, as a read of a chunk
    from a dead peer would."""

    def __init__(self, *args):
        super().__init__(*args)
        self.release_stall = trio.Event()
        self.stalled = trio.Event()

    async def statfs(self, ctx):
        if not self.stalled.is_set():
            self.stalled.set()
            await self.release_stall.wait()
            raise pyfuse3.FUSEError(errno.ENOLINK)
        return await super().statfs(ctx)


WRITER = textwrap.dedent("""
    import os, sys
    top = sys.argv[1]
    os.mkdir(top + ".tmp")
    for i in range(1000):
        fd = os.open(f"{top}.tmp/{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x" * 65536)
        os.close(fd)
    os.rename(top + ".tmp", top)
""")


async def test_eight_writers_are_not_held_up_by_a_stalled_request(mounted):
    m = await mounted(ops_class=StallingOperations)

    def stalled_call():
        try:
            os.statvfs(m.mountpoint)
        except OSError as e:
            return e.errno

    async with trio.open_nursery() as nursery:
        result = {}

        async def stall():
            result["errno"] = await trio.to_thread.run_sync(stalled_call)

        nursery.start_soon(stall)
        await m.ops.stalled.wait()
        with trio.fail_after(120):  # the stall lasts until every writer is done
            async with trio.open_nursery() as writers:
                for w in range(8):
                    writers.start_soon(trio.run_process, [sys.executable, "-c", WRITER, str(m.mountpoint / f"w{w}")])
        assert not result, "the stalled request must still be waiting"
        m.ops.release_stall.set()
    assert result["errno"] == errno.ENOLINK

    def check(w: int) -> bool:
        files = list((m.mountpoint / f"w{w}").iterdir())
        return len(files) == 1000 and all(f.stat().st_size == 65536 for f in files[:50])

    for w in range(8):
        assert await m.run(check, w)
    assert m.session._workers >= 2  # a second worker took over while the first one waited


async def test_a_daemon_path_open_keeps_later_opens_off_passthrough(mounted):
    """The kernel refuses to mix I/O modes on an inode: while a file is read through the
    daemon (it was still being restored), new opens of it stay on the daemon path."""

    class Restoring:
        def __init__(self):
            self.ino = None

        def pending(self, ino):
            return ino == self.ino

        async def wait_range(self, ino, offset, size):
            pass

        async def wait_file(self, ino):
            pass

    m = await mounted()
    (m.tree / "f").write_bytes(b"z" * 8192)
    m.ops.hooks.restoring = restoring = Restoring()
    restoring.ino = os.stat(m.tree / "f").st_ino

    def use():
        first = os.open(m.mountpoint / "f", os.O_RDONLY)  # pending: daemon path
        restoring.ino = None  # the restore finished meanwhile
        second = os.open(m.mountpoint / "f", os.O_RDONLY)  # must not pass through yet
        data = os.pread(second, 10, 0), os.pread(first, 10, 8190)
        os.close(first)
        os.close(second)
        return data

    assert await m.run(use) == (b"z" * 10, b"zz")
    assert m.ops.counters["passthrough_opens"] == 0
    await trio.sleep(0.2)
    assert await m.run(lambda: (m.mountpoint / "f").read_bytes()) == b"z" * 8192
    assert m.ops.counters["passthrough_opens"] == 1  # all closed: the next open passes through
    assert stat.S_ISREG(os.stat(m.tree / "f").st_mode)


async def test_no_other_task_sees_a_release_half_done(mounted):
    """A release waits until nothing else is queued (the next open's lookups are answered
    first), but is done before anything else in the daemon runs."""
    m = await mounted()

    def write_then_look_up():
        with open(m.mountpoint / "f", "wb") as f:
            f.write(b"x" * 4096)
        return os.path.exists(m.mountpoint / "g")  # queued right behind the release

    assert await m.run(write_then_look_up) is False
    # no sleep: this task could not run before the release was done
    assert len(m.ops.hooks.backing) == 0 and m.ops.writing_inodes() == set()
    assert m.ops.counters["passthrough_opens"] == 1


def _request(opcode: int, nodeid: int, body: bytes, unique: int = 1) -> memoryview:
    header = abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, nodeid, 0, 0, os.getpid(), 0, 0)
    return memoryview(header + body)


def test_a_release_is_done_before_any_request_that_could_tell(shm_dir):
    """The kernel queues a release before what the caller does next; the daemon may answer
    lookups first, but a create (which the commit rules must not see before the close) or
    anything else comes after the release. Driven with requests built here: the kernel only
    rarely queues a create right behind a release."""
    tree = shm_dir("tierfs-tree")

    class Recorder:
        def __init__(self):
            self.seen: list[tuple[str, bool]] = []

        def file_done(self, path):
            self.seen.append((path, (tree / "late").exists()))

        def dir_renamed(self, path):
            pass

    ops = Operations(tree, SpaceAccount(None, tree), events=(recorder := Recorder()))
    session = KernelSession(ops)
    session.fd = os.open("/dev/null", os.O_WRONLY)  # the answers go nowhere
    try:
        flags = os.O_WRONLY | os.O_CREAT
        create = abi.CREATE_IN.pack(flags, stat.S_IFREG | 0o644, 0o022, 0)
        assert session._serve(_request(abi.CREATE, pyfuse3.ROOT_INODE, create + b"marker\0")) is None
        (fh,) = list(ops.handles.files)
        os.pwrite(fh, b"done", 0)
        session._serve(_request(abi.RELEASE, pyfuse3.ROOT_INODE, abi.RELEASE_IN.pack(fh, flags, 0, 0)))
        session._serve(_request(abi.GETATTR, pyfuse3.ROOT_INODE, abi.GETATTR_IN.pack(0, 0, 0)))
        session._serve(_request(abi.LOOKUP, pyfuse3.ROOT_INODE, b"late\0"))
        assert recorder.seen == [] and ops.writing_inodes(), "lookups go ahead of the release"
        session._serve(_request(abi.CREATE, pyfuse3.ROOT_INODE, create + b"late\0"))
        assert recorder.seen == [("marker", False)], "the close was seen before the create"
    finally:
        os.close(session.fd)
        ops.close()


def test_the_last_release_of_an_unlinked_file_frees_its_space_at_once(shm_dir):
    """tmpfs frees an unlinked file's space at its last close; the daemon's release of it
    cannot wait for an idle moment, since what the caller does next may need that space."""
    tree = shm_dir("tierfs-tree")
    space = SpaceAccount(None, tree)
    ops = Operations(tree, space)
    session = KernelSession(ops)
    session.fd = os.open("/dev/null", os.O_WRONLY)  # the answers go nowhere
    try:
        flags = os.O_WRONLY | os.O_CREAT
        create = abi.CREATE_IN.pack(flags, stat.S_IFREG | 0o644, 0o022, 0)
        for name in (b"kept", b"gone"):
            session._serve(_request(abi.CREATE, pyfuse3.ROOT_INODE, create + name + b"\0"))
        kept, gone = sorted(ops.handles.files)
        for fh in (kept, gone):
            os.pwrite(fh, b"x" * (1 << 20), 0)  # as the kernel's passthrough writes do
            space.update(os.fstat(fh))
        used = space.used
        trio.run(ops.unlink, pyfuse3.ROOT_INODE, b"gone", None)
        session._serve(_request(abi.RELEASE, pyfuse3.ROOT_INODE, abi.RELEASE_IN.pack(kept, flags, 0, 0)))
        assert kept in ops.handles.files, "a linked file's release waits for an idle moment"
        session._serve(_request(abi.RELEASE, pyfuse3.ROOT_INODE, abi.RELEASE_IN.pack(gone, flags, 0, 0)))
        assert gone not in ops.handles.files and space.used <= used - (1 << 20)
    finally:
        os.close(session.fd)
        ops.close()


@pytest.mark.skipif(not os.access(poller.CPU_LATENCY, os.W_OK), reason="needs /dev/cpu_dma_latency")
@pytest.mark.parametrize("wake_cpus", [True, False], ids=["on", "off"])
async def test_idle_cpus_are_kept_awake_while_the_daemon_polls_in_a_burst(mounted, monkeypatch, wake_cpus):
    before = cpu_latency_limit()
    if before == 0:
        pytest.skip("another process keeps idle CPUs awake already")
    monkeypatch.setattr(poller, "BUSY_PERCENT", float("inf"))  # however busy the machine is
    m = await mounted(wake_cpus=wake_cpus)
    assert m.session.wake_cpus == ("on" if wake_cpus else "off")

    def burst() -> set[int]:
        limits = set()
        for i in range(200):
            (m.mountpoint / f"f{i}").write_bytes(b"x" * 65536)
            limits.add(cpu_latency_limit())
        return limits

    limits = await m.run(burst)
    assert (0 in limits) == wake_cpus and limits <= {0, before}
    await trio.sleep(0.1)  # polls last 1 ms at most
    assert cpu_latency_limit() == before, "let go once the burst is over"
