"""Scripts run as other users on a tmpfs directory and on a tierfs mount prepared alike.

The permission tests say what tierfs must do by what tmpfs does: the same script runs on
both sides, as root or as a user of the volume, records each result under a key, and every
key must come out the same. The script's prelude, the running and the comparison are the
same for every such test, so they are here once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # readable by every user, unlike a venv under /root

# What every script starts with: its arguments (the directory first), ``out`` for its
# results, and helpers recording a call's result (``t``) or a path's mode and owner (``s``).
PRELUDE = r'''
import errno, json, os, stat, subprocess, sys
root = sys.argv[1]
out = {}
def P(*a): return os.path.join(root, *a)
def t(key, fn, *a, **k):
    try:
        r = fn(*a, **k)
        out[key] = "ok" if r is None or isinstance(r, int) else r
    except OSError as e:
        out[key] = errno.errorcode[e.errno]
def s(key, path):
    try:
        st = os.lstat(path)
        out[key] = [stat.filemode(st.st_mode), st.st_uid, st.st_gid]
    except OSError as e:
        out[key] = errno.errorcode[e.errno]
def write(path, data=b"x", flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode=0o666):
    fd = os.open(path, flags, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
def read(path):
    with open(path, "rb") as f:
        return f.read().decode()
'''


def run_script(body: str, root: Path, *args: str, **credentials) -> dict:
    """Run ``body`` after :data:`PRELUDE` on ``root`` (further arguments: ``args``) with
    umask 022, as ``credentials`` (``user``, ``group``, ``extra_groups`` of
    :func:`subprocess.run`; none: as root). Its results, by key."""
    script = PRELUDE + body + "print(json.dumps(out, sort_keys=True))\n"
    proc = subprocess.run(
        [PYTHON, "-c", script, str(root), *args], capture_output=True, text=True, timeout=60, umask=0o022, **credentials
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def differences(got: dict, expected: dict) -> dict:
    """The results of tierfs (``got``) that differ from tmpfs' (``expected``): key -> (tierfs', tmpfs')."""
    return {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
