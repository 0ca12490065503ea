#!/usr/bin/env python3
"""How fast one core erasure-codes stripes: encode, rebuild and a chain link, next to a plain copy.

For each D+P shape it makes D random data parts of ``--part-size`` bytes and times, on one
thread of this process:

- ``memcpy``: each data part copied into a buffer made beforehand (numpy), what the memory
  moves at;
- ``copy``: each data part copied into a new buffer (``bytearray(part)``), the floor for
  anything that produces new bytes from the same input, as the codec does;
- ``encode``: the P parity parts of the stripe (:meth:`tierfs.core.erasure.Code.encode`);
- ``rebuild 1``: one lost data part, with parity part 0 surviving (the XOR case);
- ``rebuild P``: P lost data parts, from the other data parts and all the parity;
- ``link``: one link of a repair chain, ``coefficient * part`` added into a running sum
  (:func:`tierfs.core.erasure.accumulate`) with a coefficient other than 1.

Every rate is GiB/s of the stripe's data (D parts) per core, except ``link``'s, which is of
the one part it adds. Where pyeclib is importable, its ISA-L Reed-Solomon backend is timed
on the same shapes too (``pyeclib`` rows; it takes one buffer of D parts and adds headers,
and that buffer is built outside the timing). Each measurement is warmed up, then taken
``--rounds`` times in alternating order, and the median is printed: a VM's memory balloon
makes single runs lie.

    .venv/bin/python scripts/bench_erasure.py --rounds 31 --json /tmp/erasure.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
from benchlib import parse_size, progress, render_table, size_label, write_json

from tierfs.core.erasure import Code, accumulate
from tierfs.core.stripes import BadGroup, parse_shape

GiB = 1 << 30
OPERATIONS = ("memcpy", "copy", "encode", "rebuild 1", "rebuild P", "link")
LINK_COEFFICIENT = 0x53  # any but 0 and 1 (which skip the multiplication) costs the same table lookup


def codec_operations(shape: str, part: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Each operation on one stripe of ``shape``, and the bytes its rate is counted in."""
    code = Code(parse_shape(shape))
    d, p = code.d, code.p
    data = [os.urandom(part) for _ in range(d)]
    full = dict(enumerate(data + code.encode(data)))
    lengths = [part] * d
    one = {s: b for s, b in full.items() if s != 0}
    lost = list(range(min(p, d)))
    many = {s: b for s, b in full.items() if s not in lost}
    running = bytearray(part)
    return {
        "memcpy": memcpy(data),
        "copy": (lambda: [bytearray(b) for b in data], d * part),
        "encode": (lambda: code.encode(data), d * part),
        "rebuild 1": (lambda: code.reconstruct(one, lengths, [0]), d * part),
        "rebuild P": (lambda: code.reconstruct(many, lengths, lost), d * part),
        "link": (lambda: accumulate(running, data[0], LINK_COEFFICIENT), part),
    }


def pyeclib_operations(shape: str, part: int) -> dict[str, tuple[Callable[[], object], int]] | None:
    """The same stripe through pyeclib's ISA-L backend, or None where it is not importable."""
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError:
        return None
    group = parse_shape(shape)
    d, p = group.d, group.p
    driver = ECDriver(k=d, m=p, ec_type="isa_l_rs_vand")
    data = [os.urandom(part) for _ in range(d)]
    joined = b"".join(data)
    fragments = driver.encode(joined)
    lost = list(range(min(p, d)))
    return {
        "memcpy": memcpy(data),
        "copy": (lambda: [bytearray(b) for b in data], d * part),
        "encode": (lambda: driver.encode(joined), d * part),
        "rebuild 1": (lambda: driver.reconstruct(fragments[1:], [0]), d * part),
        "rebuild P": (lambda: driver.reconstruct(fragments[len(lost) :], lost), d * part),
    }


def memcpy(data: list[bytes]) -> tuple[Callable[[], object], int]:
    sources = [np.frombuffer(b, dtype=np.uint8) for b in data]
    targets = [np.empty_like(a) for a in sources]
    return lambda: [np.copyto(t, a) for t, a in zip(targets, sources, strict=True)], sum(map(len, data))


def seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4+1,4+2,8+2", help="comma-separated D+P shapes (default 4+1,4+2,8+2)")
    p.add_argument("--part-size", type=parse_size, default=4 << 20, help="bytes per part (default 4M)")
    p.add_argument("--rounds", type=int, default=15, help="rounds; medians are taken over them (default 15)")
    p.add_argument("--no-pyeclib", action="store_true", help="leave pyeclib out even where it is importable")
    p.add_argument("--json", metavar="PATH", help="write the settings, raw rates and medians")
    args = p.parse_args()
    try:
        shapes = [str(parse_shape(s).d) + "+" + str(parse_shape(s).p) for s in args.shapes.split(",")]
    except BadGroup as e:
        print(f"bench_erasure: {e}", file=sys.stderr)
        return 2

    subjects: dict[str, dict[str, tuple[Callable[[], object], int]]] = {}
    for shape in shapes:
        subjects[shape] = codec_operations(shape, args.part_size)
        if not args.no_pyeclib and (ops := pyeclib_operations(shape, args.part_size)) is not None:
            subjects[f"{shape} pyeclib"] = ops
    runs = [(subject, op) for subject, ops in subjects.items() for op in ops]
    for subject, op in runs:
        subjects[subject][op][0]()  # warm: tables, plans, the allocator's pages
    rates: dict[str, dict[str, list[float]]] = {subject: {op: [] for op in ops} for subject, ops in subjects.items()}
    for r in range(args.rounds):
        for subject, op in runs if r % 2 == 0 else runs[::-1]:
            run, nbytes = subjects[subject][op]
            rates[subject][op].append(nbytes / GiB / seconds(run))
        progress(f"round {r + 1}/{args.rounds} done")

    medians = {subject: {op: statistics.median(v) for op, v in ops.items()} for subject, ops in rates.items()}
    print(f"# GiB/s per core, median of {args.rounds} rounds, parts of {size_label(args.part_size)}")
    print(
        render_table(
            ("stripe", *OPERATIONS),
            [
                (subject, *(f"{medians[subject][op]:.2f}" if op in medians[subject] else "-" for op in OPERATIONS))
                for subject in subjects
            ],
        )
    )
    if args.json:
        write_json(args.json, {"settings": vars(args), "raw": rates, "medians": medians})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
