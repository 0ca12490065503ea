#!/usr/bin/env python3
"""How fast a committed step is hashed: the chunk hasher alone, on tmpfs, no mount.

Every replication and backup starts by naming a step's chunks, and on a node of two cores
that hashing shares them with the sending beside it. This times ``hash_file`` of each
source tree given (this checkout by default; another one, e.g. a ``git worktree`` of an
earlier commit, to compare) on the same files under ``--dir``, hashed by two threads as the
daemon does (:data:`tierfs.core.describe.HASH_THREADS` on this machine), each tree in a
fresh interpreter, in alternating order, round after round; prints the median GiB/s.

    .venv/bin/python scripts/bench_hash.py --trees before=/work/wt-old,after=. --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import BenchError, parse_size, progress, render_table, write_json

MiB = 1 << 20
SHAPES = {"16 files of 64 MiB": (16, 64 * MiB), "1,024 files of 1 MiB": (1024, MiB)}

# Run in a fresh interpreter per tree and round: the tree's own tierfs, nothing cached.
TIMED = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
from tierfs.core.chunks import hash_file
paths, chunk_size = json.loads(sys.argv[2]), int(sys.argv[3])
for p in paths[:2]:
    hash_file(p, chunk_size)  # warm: imports, the thread's buffer
start = time.perf_counter()
with ThreadPoolExecutor(2) as pool:
    list(pool.map(lambda p: hash_file(p, chunk_size), paths))
print(time.perf_counter() - start)
"""


def make_files(directory: Path, count: int, size: int) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = directory / f"f{i:04d}"
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(os.urandom(size))
        paths.append(str(path))
    return paths


def hash_seconds(tree: str, paths: list[str], chunk_size: int) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", TIMED, str(Path(tree) / "src"), json.dumps(paths), str(chunk_size)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BenchError(f"hashing with {tree} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return float(proc.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--trees",
        default=".",
        help="comma-separated source trees to compare, each PATH or LABEL=PATH (default: this one)",
    )
    p.add_argument("--rounds", type=int, default=7, help="rounds; medians are taken over them (default 7)")
    p.add_argument("--chunk-size", type=parse_size, default=4 * MiB, help="default 4M, the volume's")
    p.add_argument("--dir", default="/dev/shm/tierfs-bench-hash", help="a tmpfs directory for the files")
    p.add_argument("--json", metavar="PATH", help="write the raw and median numbers")
    args = p.parse_args()
    trees = dict(t.split("=", 1) if "=" in t else (t, t) for t in args.trees.split(","))  # label -> path
    base = Path(args.dir)
    try:
        files = {shape: make_files(base / str(i), *dims) for i, (shape, dims) in enumerate(SHAPES.items())}
        sizes = {shape: sum(os.path.getsize(x) for x in paths) for shape, paths in files.items()}
        rates: dict[str, dict[str, list[float]]] = {shape: {t: [] for t in trees} for shape in SHAPES}
        for r in range(args.rounds):
            for shape, paths in files.items():
                for tree in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                    seconds = hash_seconds(trees[tree], paths, args.chunk_size)
                    rates[shape][tree].append(sizes[shape] / (1 << 30) / seconds)
            progress(f"round {r + 1}/{args.rounds} done")
    except BenchError as e:
        print(f"bench_hash: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
    medians = {shape: {t: statistics.median(v) for t, v in by_tree.items()} for shape, by_tree in rates.items()}
    print(
        render_table(
            ("step", *(f"{t} GiB/s" for t in trees)),
            [(shape, *(f"{medians[shape][t]:.2f}" for t in trees)) for shape in SHAPES],
        )
    )
    if args.json:
        write_json(args.json, {"settings": vars(args), "raw": rates, "medians": medians})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
