"""Random operations on one file, each checked against a model of its bytes.

Run as a script (standard library only, so that any user's system python3 can run it):

    python3 random_ops.py FILE --seed S --ops N [--initial REF] [--lazy K] [--unsupported fallocate]

A seeded sequence of opens, closes, reads, writes, ``pread``/``pwrite`` at random offsets
(past the end too), ``ftruncate`` up and down, ``mmap`` reads and writes (mappings live
across operations, so the file is truncated while mapped), ``fallocate``, punched holes,
``copy_file_range``, ``fsync``, ``lseek`` and ``O_APPEND`` writes, on up to four
descriptors at once. After every operation the file's size (``fstat`` of the descriptor
used and of a second one kept open throughout, now and then ``stat`` of the path) and its
contents (``pread`` of the whole file from both, and a live mapping's view) must be those
of the model, a bytearray to which every operation is applied as tmpfs would.

The sequence depends on the seed alone, never on what the file system answered, so a
seed replays the same operations on every file system. A mismatch prints the seed, the
index of the operation and the operations before it, and exits with status 1.

``--initial REF``: FILE exists and must start with the bytes of REF (a file of a step
being restored). ``--lazy K``: the first K operations only read, and check only what they
read and the size, so that they reach chunks not restored yet (an open for writing waits
for the whole file, and a check of the whole file reads all of it).
``--unsupported OP``: the file system may refuse OP with EOPNOTSUPP (then nothing changes).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import errno
import json
import mmap
import os
import random
import sys

PAGE = 4096
MAX_END = 384 << 10  # writes and truncates start below this, so the file stays small and a check reads little
MAX_FDS = 4
MAX_MAPS = 2
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
SEEK_DATA, SEEK_HOLE = 3, 4

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class Mismatch(Exception):
    """The file system and the model disagree."""


class Fd:
    __slots__ = ("fd", "flags", "pos")

    def __init__(self, fd: int, flags: int):
        self.fd, self.flags, self.pos = fd, flags, 0

    @property
    def readable(self) -> bool:
        return self.flags & os.O_ACCMODE != os.O_WRONLY

    @property
    def writable(self) -> bool:
        return self.flags & os.O_ACCMODE != os.O_RDONLY

    @property
    def append(self) -> bool:
        return bool(self.flags & os.O_APPEND)

    def __repr__(self) -> str:
        mode = {os.O_RDONLY: "r", os.O_WRONLY: "w", os.O_RDWR: "rw"}[self.flags & os.O_ACCMODE]
        return f"fd{self.fd}:{mode}{'a' if self.append else ''}"


class Map:
    __slots__ = ("m", "length", "writable", "name")

    def __init__(self, m: mmap.mmap, length: int, writable: bool, name: str):
        self.m, self.length, self.writable, self.name = m, length, writable, name

    def __repr__(self) -> str:
        return f"map{self.name}[{self.length}{',w' if self.writable else ''}]"


class Run:
    """One seeded sequence on one file."""

    def __init__(
        self,
        path: str,
        seed: int,
        initial: bytes | None,
        lazy: int,
        unsupported: set[str],
        source_path: str | None = None,
        progress: int = 0,
    ):
        self.path, self.seed, self.lazy, self.unsupported = path, seed, lazy, unsupported
        self.progress = progress
        self.rng = random.Random(seed)
        self.model = bytearray(initial or b"")
        self.fds: list[Fd] = []
        self.maps: list[Map] = []
        self.map_names = 0
        self.counts: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.log: list[str] = []
        self.index = -1
        if initial is None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self.fds.append(Fd(fd, os.O_RDWR))
        else:
            self.fds.append(Fd(os.open(path, os.O_RDONLY | os.O_CLOEXEC), os.O_RDONLY))
        # The second descriptor, kept open throughout: it must see every change at once.
        self.checker = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        # A file that copy_file_range copies from, beside FILE.
        self.source = self.rng.randbytes(96 << 10)
        self.source_path = source_path or f"{path}.source"
        with open(self.source_path, "wb") as f:
            f.write(self.source)
        self.source_fd = os.open(self.source_path, os.O_RDONLY | os.O_CLOEXEC)

    # -- choosing -------------------------------------------------------------------------

    def offset(self) -> int:
        """An offset: inside the file, just past its end, at a page boundary, or far past it."""
        size, r = len(self.model), self.rng.random()
        if r < 0.45:
            return self.rng.randrange(size + 1)
        if r < 0.65:
            return min(MAX_END - 1, size + self.rng.randrange(1, 3 * PAGE))
        if r < 0.85:
            return max(0, self.rng.randrange(MAX_END // PAGE) * PAGE + self.rng.randrange(-3, 4))
        return self.rng.randrange(MAX_END)

    def length(self) -> int:
        r = self.rng.random()
        if r < 0.35:
            return self.rng.randrange(1, 64)
        if r < 0.8:
            return self.rng.randrange(1, 3 * PAGE)
        return self.rng.randrange(1, 96 << 10)

    def data(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def fd(self, want: str = "any") -> Fd | None:
        if want == "writable_at":  # writes at an offset of our choosing
            choices = [f for f in self.fds if f.writable and not f.append]
        else:
            choices = [f for f in self.fds if want == "any" or getattr(f, want)]
        return self.rng.choice(choices) if choices else None

    # -- the model --------------------------------------------------------------------------

    def put(self, offset: int, data: bytes) -> None:
        if offset > len(self.model):
            self.model.extend(bytes(offset - len(self.model)))
        self.model[offset : offset + len(data)] = data

    def resize(self, size: int) -> None:
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))

    def expect(self, what: str, got, want) -> None:
        if got != want:
            if isinstance(got, (bytes, bytearray)) and isinstance(want, (bytes, bytearray)):
                raise Mismatch(f"{what}: {describe_difference(bytes(got), bytes(want))}")
            raise Mismatch(f"{what}: got {got!r}, expected {want!r}")

    # -- operations -------------------------------------------------------------------------

    def op_open(self):
        if len(self.fds) >= MAX_FDS:
            return self.op_close()
        if self.index < self.lazy:
            flags = os.O_RDONLY
        else:
            flags = self.rng.choice(
                [os.O_RDWR, os.O_RDWR, os.O_RDONLY, os.O_WRONLY, os.O_RDWR | os.O_APPEND, os.O_WRONLY | os.O_APPEND]
            )
            if flags & os.O_ACCMODE != os.O_RDONLY and self.rng.random() < 0.04:
                flags |= os.O_TRUNC
        f = Fd(os.open(self.path, flags | os.O_CLOEXEC), flags & ~os.O_TRUNC)
        if flags & os.O_TRUNC:
            self.resize(0)
        self.fds.append(f)
        return f"open({flags:#o}) -> {f}", f

    def op_close(self):
        if len(self.fds) <= 1:
            return self.op_open()
        f = self.fds.pop(self.rng.randrange(len(self.fds)))
        os.close(f.fd)
        return f"close({f})", None

    def op_pwrite(self):
        f = self.fd("writable")
        if f is None:
            return self.op_open()
        off, data = self.offset(), self.data(self.length())
        where = len(self.model) if f.append else off  # Linux: pwrite on O_APPEND appends
        self.expect("pwrite returned", os.pwrite(f.fd, data, off), len(data))
        self.put(where, data)
        return f"pwrite({f}, {len(data)} @ {off})", f

    def op_write(self):
        f = self.fd("writable")
        if f is None:
            return self.op_open()
        data = self.data(self.length())
        if f.append:
            f.pos = len(self.model)
        self.expect("write returned", os.write(f.fd, data), len(data))
        self.put(f.pos, data)
        f.pos += len(data)
        return f"write({f}, {len(data)} @ pos {f.pos - len(data)})", f

    def op_pread(self):
        f = self.fd("readable")
        if f is None:
            return self.op_open()
        off, n = self.offset(), self.length()
        self.expect(f"pread({f}, {n} @ {off})", os.pread(f.fd, n, off), self.model[off : off + n])
        return f"pread({f}, {n} @ {off})", f

    def op_read(self):
        f = self.fd("readable")
        if f is None:
            return self.op_open()
        n = self.length()
        want = self.model[f.pos : f.pos + n]
        self.expect(f"read({f}, {n} @ pos {f.pos})", os.read(f.fd, n), want)
        f.pos += len(want)
        return f"read({f}, {n} @ pos {f.pos - len(want)})", f

    def op_seek(self):
        f = self.fd()
        whence = self.rng.choice([os.SEEK_SET, os.SEEK_SET, os.SEEK_CUR, os.SEEK_END])
        if whence == os.SEEK_SET:
            delta, want = self.offset(), None
        else:
            base = f.pos if whence == os.SEEK_CUR else len(self.model)
            delta = self.rng.randrange(-min(base, 2 * PAGE), 2 * PAGE)
            want = base + delta
        got = os.lseek(f.fd, delta, whence)
        self.expect(f"lseek({f}, {delta}, {whence})", got, delta if want is None else want)
        f.pos = got
        return f"lseek({f}, {delta}, {whence})", f

    def op_seek_data_hole(self):
        """SEEK_DATA and SEEK_HOLE: exact answers depend on how the file system keeps holes,
        but never on more than the file's size and that holes read as zeros."""
        f, whence = self.fd(), self.rng.choice([SEEK_DATA, SEEK_HOLE])
        off, size = self.offset(), len(self.model)
        name = f"lseek({f}, {off}, {'SEEK_DATA' if whence == SEEK_DATA else 'SEEK_HOLE'})"
        try:
            got = os.lseek(f.fd, off, whence)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            if off < size and (whence == SEEK_HOLE or any(self.model[off:])):
                raise Mismatch(f"{name}: ENXIO, but the file is {size} bytes long") from None
            got = None
        if got is not None:
            if off >= size:
                raise Mismatch(f"{name} = {got}: expected ENXIO past the end ({size})")
            if not off <= got <= size or (whence == SEEK_DATA and got == size):
                raise Mismatch(f"{name} = {got}: outside [{off}, {size}]")
            if whence == SEEK_DATA and any(self.model[off:got]):
                raise Mismatch(f"{name} = {got}: data before it")
            if whence == SEEK_HOLE and got < size and any(self.model[got : min(size, (got // PAGE + 1) * PAGE)]):
                raise Mismatch(f"{name} = {got}: not a hole")
        os.lseek(f.fd, f.pos, os.SEEK_SET)  # the position stays the model's, whatever the answer
        return name, f

    def op_ftruncate(self):
        f = self.fd("writable")
        if f is None:
            return self.op_open()
        size = self.rng.choice([0, self.offset(), self.offset(), max(0, len(self.model) - self.length())])
        os.ftruncate(f.fd, size)
        self.resize(size)
        return f"ftruncate({f}, {size})", f

    def op_truncate_path(self):
        size = self.offset()
        os.truncate(self.path, size)
        self.resize(size)
        return f"truncate(path, {size})", None

    def op_fallocate(self):
        f = self.fd("writable_at")
        if f is None:
            return self.op_open()
        mode = self.rng.choice(
            [
                0,
                0,
                FALLOC_FL_KEEP_SIZE,
                FALLOC_FL_KEEP_SIZE,
                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                FALLOC_FL_ZERO_RANGE,
                FALLOC_FL_PUNCH_HOLE,
            ]
        )
        off, n = self.offset(), self.length()
        name = f"fallocate({f}, mode {mode}, {n} @ {off})"
        # tmpfs has no ZERO_RANGE, and a hole punched must keep the size (vfs_fallocate)
        refused_by_tmpfs = mode in (FALLOC_FL_ZERO_RANGE, FALLOC_FL_PUNCH_HOLE)
        try:
            fallocate(f.fd, mode, off, n)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP or not (refused_by_tmpfs or "fallocate" in self.unsupported):
                raise
            self.refused["fallocate"] = self.refused.get("fallocate", 0) + 1
            return name + " refused", f
        if refused_by_tmpfs:
            raise Mismatch(f"{name}: succeeded, but tmpfs refuses it with EOPNOTSUPP")
        if mode & FALLOC_FL_PUNCH_HOLE:
            end = min(off + n, len(self.model))
            if off < end:
                self.model[off:end] = bytes(end - off)
        elif not mode & FALLOC_FL_KEEP_SIZE and off + n > len(self.model):
            self.resize(off + n)
        return name, f

    def op_copy_file_range(self):
        dst = self.fd("writable_at")
        if dst is None:
            return self.op_open()
        n = self.length()
        src = self.fd("readable") if self.rng.random() < 0.5 else None
        if src is None:  # from the other file
            src_fd, src_data, src_name = self.source_fd, bytes(self.source), "source"
            off_src, off_dst = self.rng.randrange(len(self.source) + PAGE), self.offset()
        else:  # within the file, from inside it (a copy that extends the file extends its source)
            if not self.model:
                return self.op_pwrite()
            src_fd, src_data, src_name = src.fd, bytes(self.model), repr(src)
            off_src = self.rng.randrange(len(self.model))
            n = min(n, len(self.model) - off_src)
            off_dst = self.offset()  # and the two ranges must not overlap
            if off_dst < off_src + n and off_src < off_dst + n:
                off_dst = off_src + n + self.rng.randrange(PAGE)
        want = max(0, min(n, len(src_data) - off_src))
        name = f"copy_file_range({src_name} @ {off_src} -> {dst} @ {off_dst}, {n})"
        done = 0
        while got := os.copy_file_range(src_fd, dst.fd, n - done, off_src + done, off_dst + done):
            done += got
            if done == n:
                break
        self.expect(f"{name} copied", done, want)
        if want:
            self.put(off_dst, src_data[off_src : off_src + want])
        return name, dst

    def op_fsync(self):
        f = self.fd()
        (os.fdatasync if self.rng.random() < 0.5 else os.fsync)(f.fd)
        return f"fsync({f})", f

    def op_mmap(self):
        if len(self.maps) >= MAX_MAPS:
            return self.op_munmap()
        f = self.fd("readable")
        if f is None or not self.model:
            return self.op_pwrite()
        writable = f.flags & os.O_ACCMODE == os.O_RDWR
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = Map(mmap.mmap(f.fd, len(self.model), mmap.MAP_SHARED, prot), len(self.model), writable, str(self.map_names))
        self.map_names += 1
        self.maps.append(m)
        return f"mmap({f}, {m})", f

    def op_munmap(self):
        if not self.maps:
            return self.op_mmap()
        m = self.maps.pop(self.rng.randrange(len(self.maps)))
        m.m.close()
        return f"munmap({m})", None

    def _mapped_range(self, writable: bool):
        maps = [m for m in self.maps if m.writable or not writable]
        if not maps:
            return None
        m = self.rng.choice(maps)
        end = min(m.length, len(self.model))  # past the end of the file is SIGBUS
        if end == 0:
            return None
        off = self.rng.randrange(end)
        return m, off, min(end - off, self.length())

    def op_mmap_read(self):
        picked = self._mapped_range(writable=False)
        if picked is None:
            return self.op_mmap()
        m, off, n = picked
        self.expect(f"{m} read {n} @ {off}", m.m[off : off + n], self.model[off : off + n])
        return f"{m} read {n} @ {off}", None

    def op_mmap_write(self):
        picked = self._mapped_range(writable=True)
        if picked is None:
            return self.op_mmap()
        m, off, n = picked
        data = self.data(n)
        m.m[off : off + n] = data
        self.put(off, data)
        if self.rng.random() < 0.3:
            m.m.flush()
        return f"{m} write {n} @ {off}", None

    WRITING = [
        (op_pwrite, 14),
        (op_write, 8),
        (op_pread, 10),
        (op_read, 5),
        (op_seek, 3),
        (op_seek_data_hole, 3),
        (op_ftruncate, 8),
        (op_truncate_path, 2),
        (op_fallocate, 5),
        (op_copy_file_range, 5),
        (op_fsync, 2),
        (op_open, 5),
        (op_close, 4),
        (op_mmap, 3),
        (op_munmap, 2),
        (op_mmap_read, 5),
        (op_mmap_write, 6),
    ]
    READING = [
        (op_pread, 10),
        (op_read, 5),
        (op_seek, 2),
        (op_seek_data_hole, 2),
        (op_open, 2),
        (op_close, 2),
        (op_mmap, 2),
        (op_munmap, 1),
        (op_mmap_read, 6),
    ]

    # -- checking ---------------------------------------------------------------------------

    def check(self, used: Fd | None) -> None:
        size = len(self.model)
        self.expect("fstat size of the second descriptor", os.fstat(self.checker).st_size, size)
        if self.index < self.lazy:  # what the operation read was checked: leave the rest unread
            return
        self.expect("contents through the second descriptor", os.pread(self.checker, size + PAGE, 0), self.model)
        if used is not None and used in self.fds:
            self.expect(f"fstat size of {used}", os.fstat(used.fd).st_size, size)
            if used.readable:
                self.expect(f"contents through {used}", os.pread(used.fd, size + PAGE, 0), self.model)
        for m in self.maps[:1]:
            end = min(m.length, size)
            self.expect(f"contents through {m}", m.m[:end], self.model[:end])
        if self.index % 16 == 0:
            self.expect("stat size of the path", os.stat(self.path).st_size, size)
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                self.expect("contents through a new open", os.pread(fd, size + PAGE, 0), self.model)
            finally:
                os.close(fd)

    # -- running ----------------------------------------------------------------------------

    def step(self) -> None:
        table = self.READING if self.index < self.lazy else self.WRITING
        op = self.rng.choices([t[0] for t in table], [t[1] for t in table])[0]
        self.log.append(f"#{self.index} {op.__name__[3:]}")
        os.write(2, f"{self.log[-1]}\n".encode())  # survives a SIGBUS, which nothing can catch
        name, used = op(self)
        self.log[-1] = f"#{self.index} {name}"
        self.counts[op.__name__[3:]] = self.counts.get(op.__name__[3:], 0) + 1
        self.check(used)

    def run(self, ops: int) -> None:
        self.check(None)
        for self.index in range(ops):
            self.step()
            if self.progress and self.index % self.progress == self.progress - 1:
                print(f"progress {self.index + 1}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for m in self.maps:
            m.m.close()
        for f in self.fds:
            os.close(f.fd)
        os.close(self.checker)
        os.close(self.source_fd)


def describe_difference(got: bytes, want: bytes) -> str:
    if len(got) != len(want):
        return f"{len(got)} bytes, expected {len(want)}"
    first = next(i for i in range(len(got)) if got[i] != want[i])
    last = next(i for i in reversed(range(len(got))) if got[i] != want[i])
    return (
        f"bytes {first}..{last} of {len(got)} differ "
        f"(got {got[first : first + 8].hex()}, expected {want[first : first + 8].hex()})"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--ops", type=int, required=True)
    p.add_argument("--initial", help="a file holding the bytes PATH starts with (PATH exists)")
    p.add_argument("--lazy", type=int, default=0, help="operations that only read, at first")
    p.add_argument("--unsupported", action="append", default=[], choices=["fallocate"])
    p.add_argument("--source", help="where to create the file copy_file_range copies from (PATH.source)")
    p.add_argument("--progress", type=int, default=0, help="print 'progress N' on stderr every N operations")
    args = p.parse_args(argv)
    initial = None
    if args.initial:
        with open(args.initial, "rb") as f:
            initial = f.read()
    run = Run(args.path, args.seed, initial, args.lazy, set(args.unsupported), args.source, args.progress)
    try:
        run.run(args.ops)
    except (Mismatch, OSError, ValueError) as e:
        what = "mismatch" if isinstance(e, Mismatch) else f"unexpected {type(e).__name__}"
        print(f"FAILED seed={args.seed} op={run.index} of {args.ops} ({what}): {e}")
        print("operations before it:\n  " + "\n  ".join(run.log[-25:]))
        return 1
    run.close()
    print(json.dumps({"seed": args.seed, "ops": args.ops, "counts": run.counts, "refused": run.refused}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
