"""A training job as the takeover tests see it: it keeps descriptors open across the daemon's
deaths and checks every result against a model of what it wrote.

Run as ``python3 takeover_job.py ROOT CONTROL``: in ROOT (a directory in the volume) it holds
a file open for reading, one for appending, a shared mapping and a directory listing in
progress, and it loops: names made and removed (every request that must not run twice), a
few more lines appended, mapped bytes written and read back, a few more entries of the
listing read, and, once the file CONTROL/<N> says step N is safe on every tier, the next
checkpoint step written and committed (Orbax's rename) and the one before read back. Any
system call that fails, or any byte that differs from the model, ends it with status 1 and
one line on stderr. It prints the number of each loop done, and stops after the loop in
which the file CONTROL/stop appeared, with a last check of everything.
"""

import mmap
import os
import sys

root, control = sys.argv[1], sys.argv[2]
stop = os.path.join(control, "stop")
HELD = os.path.join(root, "held")
CKPT = os.path.join(root, "ckpt")
ENTRIES = 1500  # names long enough that a listing takes several getdents calls
MAP_SIZE = 1 << 20


def in_root(*parts):
    return os.path.join(root, *parts)


def content(step, k):
    size = (1 << 10) << (3 * k)  # 1 KiB, 8 KiB, 64 KiB
    return (b"%06d-%d|" % (step, k)) * (size // 9)


def fail(what):
    sys.stderr.write(f"FAIL: {what}\n")
    sys.exit(1)


def check_step(step):
    for k in range(3):
        with open(os.path.join(CKPT, str(step), f"shard-{k}"), "rb") as f:
            if f.read() != content(step, k):
                fail(f"step {step} shard {k} differs")


def main():
    os.makedirs(HELD)
    os.makedirs(CKPT)
    os.makedirs(os.path.join(HELD, "dir"))
    names = {f"entry-{i:05d}-" + "x" * 100 for i in range(ENTRIES)}
    for name in names:
        open(os.path.join(HELD, "dir", name), "w").close()
    readme = b"".join(b"%08d\n" % i for i in range(100_000))
    with open(os.path.join(HELD, "read.bin"), "wb") as f:
        f.write(readme)
    reader = open(os.path.join(HELD, "read.bin"), "rb", buffering=0)
    log_fd = os.open(os.path.join(HELD, "log.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    logged = bytearray()
    map_fd = os.open(os.path.join(HELD, "map.bin"), os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(map_fd, MAP_SIZE)
    mapped = mmap.mmap(map_fd, MAP_SIZE)
    model = bytearray(MAP_SIZE)
    dir_fd = os.open(os.path.join(HELD, "dir"), os.O_RDONLY | os.O_DIRECTORY)
    listing, seen = None, set()

    loop = step = 0
    while True:
        stopping = os.path.exists(stop)
        loop += 1
        # A checkpoint step, committed by Orbax's rename, once the one before is safe.
        if step == 0 or os.path.exists(os.path.join(control, str(step))):
            step += 1
            tmp = os.path.join(CKPT, f"{step}.orbax-checkpoint-tmp")
            os.mkdir(tmp)
            for k in range(3):
                with open(os.path.join(tmp, f"shard-{k}"), "wb") as f:
                    f.write(content(step, k))
            os.rename(tmp, os.path.join(CKPT, str(step)))
            if step > 1:
                check_step(step - 1)
        # Names made and removed: the requests a successor must not run twice.
        scratch = in_root(f"scratch-{loop}")
        os.mkdir(scratch)
        fd = os.open(os.path.join(scratch, "f"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"scratch %d" % loop)
        os.close(fd)
        os.link(os.path.join(scratch, "f"), os.path.join(scratch, "g"))
        os.symlink("f", os.path.join(scratch, "s"))
        os.rename(os.path.join(scratch, "g"), os.path.join(scratch, "h"))
        if os.readlink(os.path.join(scratch, "s")) != "f" or os.stat(os.path.join(scratch, "h")).st_nlink != 2:
            fail(f"loop {loop}: the scratch names are not as made")
        for name in ("f", "h", "s"):
            os.unlink(os.path.join(scratch, name))
        os.rmdir(scratch)
        # The held descriptors.
        for _ in range(20):
            line = b"%08d\n" % len(logged)
            if os.write(log_fd, line) != len(line):
                fail("short append")
            logged += line
        at = (loop * 4160) % (MAP_SIZE - 64)
        value = b"%063d\n" % loop
        mapped[at : at + 64] = value
        model[at : at + 64] = value
        if mapped[at : at + 64] != value:
            fail("mapped bytes differ")
        offset = (loop * 7919 * 9) % len(readme)
        if os.pread(reader.fileno(), 4096, offset) != readme[offset : offset + 4096]:
            fail(f"read at {offset} differs")
        if listing is None:
            os.lseek(dir_fd, 0, os.SEEK_SET)
            listing, seen = os.scandir(dir_fd), set()
        for _ in range(100):
            entry = next(listing, None)
            if entry is None:
                if seen != names:
                    fail(f"the listing lost {len(names - seen)} and invented {len(seen - names)} entries")
                listing = None
                break
            seen.add(entry.name)
        print(loop, flush=True)
        if stopping:
            break
    # Everything once more, through the same descriptors and through new ones.
    mapped.flush()
    with open(os.path.join(HELD, "map.bin"), "rb") as f:
        if f.read() != bytes(model) or mapped[:] != bytes(model):
            fail("the mapped file differs from the model")
    with open(os.path.join(HELD, "log.bin"), "rb") as f:
        if f.read() != bytes(logged):
            fail("the appended file differs from the model")
    for s in range(1, step + 1):
        check_step(s)
    if sorted(os.listdir(CKPT)) != sorted(str(s) for s in range(1, step + 1)):
        fail(f"the checkpoint directory holds {sorted(os.listdir(CKPT))}")
    print(f"steps {step}", flush=True)


main()
