"""Erasure coding of one stripe: P parity parts from D data parts, and any P lost parts rebuilt.

The code is systematic Reed-Solomon over GF(2^8) (polynomial 0x11d): data parts are kept as
they are, and parity part ``j`` is ``sum_i C[j][i] * data[i]``, byte by byte. ``C`` is a
Cauchy matrix, whose every square submatrix is invertible, which is what makes any D of the
D+P parts enough to rebuild the rest. Its rows and columns are scaled (which keeps that
property) so that its first row and first column are all ones: parity part 0 is the XOR of
the data parts, so with P=1 the code is plain XOR, and one lost data part is rebuilt from
the other data parts and parity part 0 by XOR alone, the cheapest case and the most common.

Every rebuilt part, data or parity, is a linear combination of D surviving parts, so a
:class:`RepairPlan` is just its coefficients: survivors can pass one running sum along a
chain, each adding ``coefficient * its part`` (:func:`accumulate`), and every link sends one
part's worth of bytes whatever D is. Computing parity along a chain of data givers is the
same thing: the plan for a parity slot from the D data slots has ``C[j]`` as coefficients.

Data parts may differ in length. A stripe is as long as its longest data part and shorter
parts are padded with zeros that are never materialised: a zero adds nothing to a sum, so a
short part simply contributes to a prefix of the result.

The arithmetic is numpy's: multiplication by a constant is a lookup in a 65,536-entry table
indexed by two bytes at once, a cache-sized block at a time. pyeclib's ISA-L kernels are
faster, but pyeclib takes one buffer cut into equal fragments with headers of its own and
keeps its coefficients to itself: no chain of partial sums, and unequal parts padded for
real. scripts/bench_erasure.py times both.

Everything here is synchronous CPU work on large buffers: callers run it in worker threads,
never on the event loop. numpy releases the GIL inside each block, so threads encode in
parallel.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from tierfs.core.stripes import MAX_SHARD, Group

Bytes: TypeAlias = bytes | bytearray | memoryview
_U8: TypeAlias = npt.NDArray[np.uint8]
_U16: TypeAlias = npt.NDArray[np.uint16]

POLYNOMIAL = 0x11D  # x^8 + x^4 + x^3 + x^2 + 1: the usual primitive polynomial of Reed-Solomon codes
_BLOCK = 128 << 10  # bytes of every part worked on at a time: a block of each part stays in the core's cache


def _exp_log() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Powers of the generator 2 (twice over, so a sum of two logs needs no reduction) and their logs."""
    exp = [0] * 510
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = exp[i + 255] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= POLYNOMIAL
    return tuple(exp), tuple(log)


_EXP, _LOG = _exp_log()


def gf_mul(a: int, b: int) -> int:
    """The product of two elements of GF(2^8)."""
    return 0 if a == 0 or b == 0 else _EXP[_LOG[a] + _LOG[b]]


def gf_inv(a: int) -> int:
    """The multiplicative inverse of a non-zero element of GF(2^8)."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return _EXP[255 - _LOG[a]]


class Undecodable(Exception):
    """Fewer than D parts of a stripe survive: what is lost cannot be rebuilt."""


class BadPart(ValueError):
    """A part given to the codec that cannot belong to the stripe: a slot out of range, or the wrong length."""


@dataclass(frozen=True)
class Term:
    """One survivor's share of a rebuilt part: ``coefficient`` times the part in ``slot``."""

    slot: int
    coefficient: int


@dataclass(frozen=True)
class RepairPlan:
    """How to rebuild the part in slot ``lost``: the sum of every term's coefficient times its part.

    Survivors whose coefficient is zero are left out: they need not send anything.
    """

    lost: int
    terms: tuple[Term, ...]

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(t.slot for t in self.terms)


@dataclass(frozen=True)
class Code:
    """The code of a D+P group's stripes: slots 0..D-1 hold data parts, D..D+P-1 parity parts."""

    group: Group

    @property
    def d(self) -> int:
        return self.group.d

    @property
    def p(self) -> int:
        return self.group.p

    @cached_property
    def parity_matrix(self) -> tuple[tuple[int, ...], ...]:
        """``C``: parity part ``j`` is ``sum_i C[j][i] * data[i]``."""
        return _parity_matrix(self.d, self.p)

    def encode(self, data: Sequence[Bytes]) -> list[bytearray]:
        """The stripe's P parity parts, each as long as its longest data part."""
        arrays = self._data(data)
        parity = [bytearray(max(len(a) for a in arrays)) for _ in range(self.p)]
        self._encode(arrays, [_write(out) for out in parity])
        return parity

    def encode_into(self, data: Sequence[Bytes], parity: Sequence[bytearray | memoryview]) -> None:
        """Write the stripe's P parity parts over ``parity``, buffers exactly as long as its longest data part.

        For a caller encoding stripe after stripe into the same buffers: a new buffer of a
        few MiB costs the page faults of its first use, about as much as encoding into it.
        """
        arrays = self._data(data)
        length = max(len(a) for a in arrays)
        if len(parity) != self.p:
            raise BadPart(f"{len(parity)} parity buffers for a {self.d}+{self.p} code")
        outs = [_write(out) for out in parity]
        if any(len(out) != length for out in outs):
            raise BadPart(f"parity buffers of {[len(out) for out in outs]} bytes for a stripe of {length}")
        for out in outs:
            out.fill(0)
        self._encode(arrays, outs)

    def repair_plan(self, survivors: Iterable[int], lost: int) -> RepairPlan:
        """How to rebuild slot ``lost`` from the parts in ``survivors``.

        Data slots are preferred to parity slots and parity slot D (the XOR) to the others:
        the plan then reads the fewest parts with the cheapest coefficients. More than D
        survivors are fine; the rest are not used.
        """
        alive = frozenset(survivors)
        self._check_slots(alive | {lost})
        if lost in alive:
            raise BadPart(f"slot {lost} is among the survivors: nothing to rebuild")
        if len(alive) < self.d:
            missing = self.d + self.p - len(alive)
            raise Undecodable(
                f"{missing} of the stripe's {self.d + self.p} parts are lost: a {self.d}+{self.p} code "
                f"rebuilds at most {self.p}"
            )
        return _repair_plan(self.d, self.p, tuple(sorted(alive)[: self.d]), lost)

    def reconstruct(
        self, parts: Mapping[int, Bytes], lengths: Sequence[int], lost: Iterable[int]
    ) -> dict[int, bytearray]:
        """The parts in the slots ``lost``, rebuilt from the surviving ``parts`` (slot to bytes).

        ``lengths`` are the D data parts' lengths (:func:`tierfs.core.stripes.data_lengths`):
        a rebuilt data part ends where it really ends, not where its stripe's padding does,
        and every surviving part is checked against them, so nothing is sized from a length
        that no part given here has.
        """
        if len(lengths) != self.d:
            raise BadPart(f"{len(lengths)} data part lengths for a {self.d}+{self.p} code")
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_SHARD:
                raise BadPart(f"data part length {n!r} is not a whole number of bytes in 0..{MAX_SHARD}")
        stripe = max(lengths)
        wanted = set(lost)
        self._check_slots(set(parts) | wanted)
        arrays = {slot: _read(part) for slot, part in parts.items()}
        for slot, array in arrays.items():
            expected = lengths[slot] if slot < self.d else stripe
            if len(array) != expected:
                kind = "data" if slot < self.d else "parity"
                raise BadPart(f"the {kind} part in slot {slot} is {len(array)} bytes, not {expected}")
        # One part at a time, data parts first, each from the survivors and the parts rebuilt
        # before it: once all other data parts are back, the last one is the XOR of them and
        # parity part 0, which halves the work of rebuilding two.
        rebuilt: dict[int, bytearray] = {}
        sums = []
        for slot in sorted(wanted):
            plan = self.repair_plan(arrays, slot)
            out = rebuilt[slot] = bytearray(lengths[slot] if slot < self.d else stripe)
            sums.append((_write(out), [(arrays[t.slot][: len(out)], t.coefficient) for t in plan.terms]))
            arrays[slot] = sums[-1][0]
        _combine(sums)
        return rebuilt

    def _data(self, data: Sequence[Bytes]) -> list[_U8]:
        if len(data) != self.d:
            raise BadPart(f"{len(data)} data parts for a {self.d}+{self.p} code")
        return [_read(part) for part in data]

    def _encode(self, data: list[_U8], parity: list[_U8]) -> None:
        rows = zip(parity, self.parity_matrix, strict=True)
        _combine([(out, [(a, c) for a, c in zip(data, row, strict=True) if c]) for out, row in rows])

    def _check_slots(self, slots: Iterable[int]) -> None:
        for slot in slots:
            if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.d + self.p:
                raise BadPart(f"slot {slot!r} is not in 0..{self.d + self.p - 1} (a {self.d}+{self.p} code)")


def accumulate(acc: bytearray | memoryview, part: Bytes, coefficient: int) -> None:
    """Add ``coefficient * part`` into the running sum ``acc``: one link of a repair or encoding chain.

    The part may be shorter than the sum (it is padded with zeros, which add nothing) but not
    longer: a link that sends more bytes than the part it helps rebuild has sent too many.
    """
    if not 0 <= coefficient <= 255:
        raise BadPart(f"coefficient {coefficient} is not an element of GF(2^8)")
    target, source = _write(acc), _read(part)
    if len(source) > len(target):
        raise BadPart(f"a part of {len(source)} bytes does not fit a sum of {len(target)}")
    if coefficient:
        _combine([(target, [(source, coefficient)])])


def _read(buffer: Bytes) -> _U8:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise BadPart("parts must be contiguous buffers")
    return np.frombuffer(view.cast("B"), dtype=np.uint8)


def _write(buffer: bytearray | memoryview) -> _U8:
    array = _read(buffer)
    if not array.flags.writeable:
        raise BadPart("a running sum must be a writable buffer (a bytearray)")
    return array


def _combine(targets: Sequence[tuple[_U8, Sequence[tuple[_U8, int]]]]) -> None:
    """For every ``(sum, terms)``: ``sum[:len(part)] ^= coefficient * part`` for each term.

    Block by block across all of them, so that a block of each part is read from memory
    once while every sum it feeds is updated, instead of every part streaming through once
    per sum. A sum may be a part of a later one: each block of it is complete before the
    later sum reads that block.
    """
    longest = max((len(acc) for acc, _ in targets), default=0)
    scratch = np.empty(_BLOCK // 2, dtype=np.uint16)
    for start in range(0, longest, _BLOCK):
        stop = start + _BLOCK
        for acc, terms in targets:
            for part, coefficient in terms:
                if start < len(part):
                    _mul_xor(acc[start:stop], part[start:stop], coefficient, scratch)


def _mul_xor(acc: _U8, part: _U8, coefficient: int, scratch: _U16) -> None:
    """``acc[:len(part)] ^= coefficient * part``, for a part of at most one block."""
    n = len(part)
    if coefficient == 1:
        np.bitwise_xor(acc[:n], part, out=acc[:n])
        return
    even = n & ~1
    words = part[:even].view(np.uint16)
    products = scratch[: len(words)]
    # Every uint16 indexes the 65,536-entry table: "clip" skips a bounds check that cannot fail.
    np.take(_table16(coefficient), words, out=products, mode="clip")
    target = acc[:even].view(np.uint16)
    np.bitwise_xor(target, products, out=target)
    if n & 1:
        acc[n - 1] ^= _table8(coefficient)[part[n - 1]]


@functools.lru_cache(maxsize=256)
def _table8(coefficient: int) -> _U8:
    """``coefficient * b`` for every byte ``b``."""
    table = np.array([gf_mul(coefficient, b) for b in range(256)], dtype=np.uint8)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=128)
def _table16(coefficient: int) -> _U16:
    """``coefficient`` times both bytes of every two-byte word (128 KiB: 128 of them fit any cache size here).

    Each byte maps on its own, so the table is the same whichever byte order reads the word.
    """
    products = _table8(coefficient).astype(np.uint16)
    words = np.arange(1 << 16, dtype=np.uint16)
    table: _U16 = (products[words >> 8] << 8) | products[words & 0xFF]
    table.flags.writeable = False
    return table


@functools.cache
def _parity_matrix(d: int, p: int) -> tuple[tuple[int, ...], ...]:
    """A P x D Cauchy matrix ``1 / (x_j + y_i)`` (x_j = j, y_i = P + i: all distinct), scaled so row 0
    and column 0 are all ones.

    Scaling a row or a column by a non-zero element scales every minor through it by that
    element, so every square submatrix stays invertible; with D+P <= 36 the points fit the
    field many times over. For a given P the matrix of a smaller D is the first D columns of
    a larger one's.
    """
    cauchy = [[gf_inv(j ^ (p + i)) for i in range(d)] for j in range(p)]
    columns = [gf_inv(cauchy[0][i]) for i in range(d)]
    scaled = [[gf_mul(c, columns[i]) for i, c in enumerate(row)] for row in cauchy]
    rows = [gf_inv(row[0]) for row in scaled]
    return tuple(tuple(gf_mul(rows[j], c) for c in scaled[j]) for j in range(p))


@functools.lru_cache(maxsize=4096)
def _repair_plan(d: int, p: int, survivors: tuple[int, ...], lost: int) -> RepairPlan:
    """The plan for ``lost`` from exactly D ``survivors``: its generator row times the inverse of theirs.

    The survivors' parts are ``M @ data`` for their rows ``M`` of the generator ``[I; C]``,
    so ``data = M^-1 @ parts`` and the lost part, ``g @ data``, is ``(g @ M^-1) @ parts``.
    """
    generator = _generator(d, p)
    inverse = _invert([list(generator[s]) for s in survivors])
    row = generator[lost]
    coefficients = [0] * d
    for k, g in enumerate(row):
        if g:
            for i, v in enumerate(inverse[k]):
                coefficients[i] ^= gf_mul(g, v)
    return RepairPlan(lost, tuple(Term(s, c) for s, c in zip(survivors, coefficients, strict=True) if c))


def _generator(d: int, p: int) -> tuple[tuple[int, ...], ...]:
    identity = tuple(tuple(int(i == k) for k in range(d)) for i in range(d))
    return identity + _parity_matrix(d, p)


def _invert(matrix: list[list[int]]) -> list[list[int]]:
    """The inverse of a square matrix over GF(2^8), by Gauss-Jordan elimination."""
    n = len(matrix)
    rows = [row[:] + [int(i == k) for k in range(n)] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col]), None)
        if pivot is None:
            raise Undecodable("the surviving parts' rows are not independent")  # never, for a Cauchy code
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = gf_inv(rows[col][col])
        rows[col] = [gf_mul(scale, v) for v in rows[col]]
        for r in range(n):
            factor = rows[r][col]
            if r != col and factor:
                rows[r] = [v ^ gf_mul(factor, w) for v, w in zip(rows[r], rows[col], strict=True)]
    return [row[n:] for row in rows]
