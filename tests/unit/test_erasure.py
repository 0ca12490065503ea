"""The stripe codec (tierfs.core.erasure): XOR for P=1, Reed-Solomon over GF(2^8) beyond, any P
lost parts rebuilt, unequal parts padded virtually, and repairs that run as chains of partial sums."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.core import erasure
from tierfs.core.erasure import BadPart, Code, RepairPlan, Undecodable, accumulate, gf_inv, gf_mul
from tierfs.core.stripes import Group, data_lengths, parts

SHAPES = [(3, 1), (4, 2), (8, 2), (6, 3), (5, 4), (1, 1), (1, 4), (4, 1)]


def reference_mul(a: int, b: int) -> int:
    """Carry-less multiplication reduced by x^8 + x^4 + x^3 + x^2 + 1, a bit at a time."""
    product = 0
    while b:
        if b & 1:
            product ^= a
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
        b >>= 1
    return product


def scaled(part: bytes, coefficient: int) -> bytes:
    return bytes(reference_mul(coefficient, b) for b in part)


def xor(*parts: bytes) -> bytes:
    out = bytearray(max(map(len, parts), default=0))
    for part in parts:
        for i, b in enumerate(part):
            out[i] ^= b
    return bytes(out)


def random_parts(rng: random.Random, lengths: list[int]) -> list[bytes]:
    return [rng.randbytes(n) for n in lengths]


def stripe(code: Code, data: list[bytes]) -> dict[int, bytes]:
    """Every slot of the stripe: the data parts, then their parity."""
    return dict(enumerate(data + [bytes(p) for p in code.encode(data)]))


def test_field_arithmetic_is_multiplication_modulo_the_polynomial():
    for a in range(256):
        for b in range(256):
            assert gf_mul(a, b) == reference_mul(a, b)
    for a in range(1, 256):
        assert gf_mul(a, gf_inv(a)) == 1
    with pytest.raises(ZeroDivisionError):
        gf_inv(0)


def _invertible(matrix: list[list[int]]) -> bool:
    rows = [row[:] for row in matrix]
    for col in range(len(rows)):
        pivot = next((r for r in range(col, len(rows)) if rows[r][col]), None)
        if pivot is None:
            return False
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inverse = gf_inv(rows[col][col])
        for r in range(col + 1, len(rows)):
            factor = gf_mul(rows[r][col], inverse)
            rows[r] = [v ^ gf_mul(factor, w) for v, w in zip(rows[r], rows[col], strict=True)]
    return True


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_square_submatrix_of_the_parity_matrix_is_invertible(p):
    """What makes any D of the D+P parts enough. Every smaller D's matrix is a part of the largest's."""
    d = 32
    matrix = Code(Group(d, p)).parity_matrix
    assert all(c == 1 for c in matrix[0]) and all(row[0] == 1 for row in matrix)
    assert Code(Group(5, p)).parity_matrix == tuple(row[:5] for row in matrix)
    for size in range(1, p + 1):
        for rows in itertools.combinations(range(p), size):
            for cols in itertools.combinations(range(d), size):
                assert _invertible([[matrix[r][c] for c in cols] for r in rows]), (rows, cols)


def test_with_one_parity_part_the_code_is_xor():
    rng = random.Random(1)
    for d in (1, 3, 8, 32):
        data = random_parts(rng, [rng.randrange(0, 300) for _ in range(d)])
        (parity,) = Code(Group(d, 1)).encode(data)
        assert bytes(parity) == xor(*data)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}+{s[1]}")
def test_any_p_lost_parts_are_rebuilt_from_the_others(shape):
    code = Code(Group(*shape))
    rng = random.Random(shape[0] * 10 + shape[1])
    lengths = [rng.choice([0, 1, 17, 256, 1001, 1001]) for _ in range(code.d)]
    lengths[0] = 1001  # the stripe's length
    full = stripe(code, random_parts(rng, lengths))
    assert all(len(full[code.d + j]) == 1001 for j in range(code.p))
    for count in range(1, code.p + 1):
        for lost in itertools.combinations(range(code.d + code.p), count):
            survivors = {slot: part for slot, part in full.items() if slot not in lost}
            rebuilt = code.reconstruct(survivors, lengths, lost)
            assert {slot: bytes(part) for slot, part in rebuilt.items()} == {slot: full[slot] for slot in lost}


def test_parts_longer_than_a_block_are_rebuilt_across_block_boundaries():
    code = Code(Group(4, 2))
    rng = random.Random(7)
    lengths = [2 * erasure._BLOCK + 3, erasure._BLOCK - 1, 0, 2 * erasure._BLOCK + 2]
    full = stripe(code, random_parts(rng, lengths))
    for lost in [(0, 1), (0, 3), (1, 4), (3, 5), (4, 5)]:
        rebuilt = code.reconstruct({s: p for s, p in full.items() if s not in lost}, lengths, lost)
        assert all(bytes(rebuilt[s]) == full[s] for s in lost)


@pytest.mark.parametrize("shape", [(4, 2), (8, 2), (3, 1)], ids=lambda s: f"{s[0]}+{s[1]}")
def test_a_group_survives_the_loss_of_any_p_members(shape):
    """The layout and the code together: every lost member's shard and parity come back from the others."""
    group = Group(*shape)
    code = Code(group)
    rng = random.Random(sum(shape))
    lengths = [rng.choice([0, 1, 5, 333, 1000, 1024]) for _ in range(group.size)]
    lengths[-1], lengths[0] = 0, 1024  # an empty shard, and the longest
    shards = random_parts(rng, lengths)
    per_stripe = data_lengths(group, lengths)
    given = {s: [b""] * group.d for s in range(group.size)}
    for m, shard in enumerate(shards):
        for part in parts(group, m, len(shard)):
            given[part.stripe][part.slot] = shard[part.start : part.end]
    held = {
        (s, group.member(s, slot)): part for s in range(group.size) for slot, part in stripe(code, given[s]).items()
    }

    for count in range(1, group.p + 1):
        for lost in itertools.combinations(range(group.size), count):
            rebuilt: dict[tuple[int, int], bytes] = {}
            for s in range(group.size):
                survivors = {group.slot(s, m): held[s, m] for m in range(group.size) if m not in lost}
                out = code.reconstruct(survivors, per_stripe[s], [group.slot(s, m) for m in lost])
                rebuilt.update({(s, group.member(s, slot)): bytes(part) for slot, part in out.items()})
            for m in lost:
                assert b"".join(rebuilt[p.stripe, m] for p in parts(group, m, lengths[m])) == shards[m]
                assert all(rebuilt[s, m] == held[s, m] for s in group.parity_stripes(m))


@settings(max_examples=150, deadline=None)
@given(shape=st.sampled_from(SHAPES), seed=st.integers(0, 2**32), data=st.data())
def test_a_chain_of_partial_sums_rebuilds_what_a_full_decode_does(shape, seed, data):
    code = Code(Group(*shape))
    rng = random.Random(seed)
    lengths = [rng.choice([0, 1, 2, 31, 64, 99]) for _ in range(code.d)]
    full = stripe(code, random_parts(rng, lengths))
    lost = data.draw(st.sets(st.integers(0, code.d + code.p - 1), min_size=1, max_size=code.p))
    survivors = {slot: part for slot, part in full.items() if slot not in lost}
    decoded = code.reconstruct(survivors, lengths, lost)
    for slot in lost:
        plan = code.repair_plan(survivors, slot)
        assert len(set(plan.slots)) == len(plan.slots) <= code.d and set(plan.slots) <= set(survivors)
        size = lengths[slot] if slot < code.d else max(lengths)
        running = bytearray(size)
        for term in data.draw(st.permutations(plan.terms)):  # any order: the sum is the same
            sent = bytes(running)  # each link passes on one buffer of the lost part's size
            assert len(sent) == size
            running = bytearray(sent)
            accumulate(running, memoryview(survivors[term.slot])[:size], term.coefficient)
        assert running == decoded[slot] == full[slot]


def test_parity_computed_along_a_chain_of_data_givers_is_the_encoded_parity():
    code = Code(Group(8, 2))
    rng = random.Random(3)
    data = random_parts(rng, [rng.randrange(0, 500) for _ in range(8)])
    parity = code.encode(data)
    for j in range(code.p):
        plan = code.repair_plan(range(code.d), code.d + j)
        assert plan == RepairPlan(code.d + j, tuple(erasure.Term(i, c) for i, c in enumerate(code.parity_matrix[j])))
        running = bytearray(len(parity[j]))
        for term in plan.terms:
            accumulate(running, data[term.slot], term.coefficient)
        assert running == parity[j]


def test_one_lost_data_part_is_rebuilt_by_xor_when_the_first_parity_survives():
    code = Code(Group(8, 2))
    for lost in range(8):
        survivors = [s for s in range(10) if s != lost]
        plan = code.repair_plan(survivors, lost)
        assert plan.slots == tuple(s for s in range(9) if s != lost)
        assert {t.coefficient for t in plan.terms} == {1}


@pytest.mark.parametrize("shape", [(4, 2), (8, 2), (3, 1), (5, 4)], ids=lambda s: f"{s[0]}+{s[1]}")
def test_more_than_p_lost_parts_are_refused(shape):
    code = Code(Group(*shape))
    n = code.d + code.p
    full = stripe(code, [b"x" * 10] * code.d)
    for lost in itertools.combinations(range(n), code.p + 1):
        survivors = {slot: part for slot, part in full.items() if slot not in lost}
        message = (
            rf"{code.p + 1} of the stripe's {n} parts are lost: a {code.d}\+{code.p} code rebuilds at most {code.p}"
        )
        with pytest.raises(Undecodable, match=message):
            code.reconstruct(survivors, [10] * code.d, lost)
        with pytest.raises(Undecodable, match=message):
            code.repair_plan(survivors, lost[0])


@settings(max_examples=300, deadline=None)
@given(
    acc=st.binary(max_size=80), part=st.binary(max_size=80), offset=st.integers(0, 3), coefficient=st.integers(0, 255)
)
def test_a_link_adds_coefficient_times_its_part_into_the_sum(acc, part, offset, coefficient):
    part = part[: max(len(acc) - offset, 0)]
    running = bytearray(acc)
    view = memoryview(running)[offset:]  # sums and parts need not start on an aligned address
    accumulate(view, memoryview(b"?" + part)[1:], coefficient)
    expected = acc[:offset] + xor(acc[offset:], scaled(part, coefficient))
    assert bytes(running) == expected


def test_parity_encoded_into_reused_buffers_overwrites_them():
    code = Code(Group(8, 2))
    rng = random.Random(4)
    buffers = [bytearray(b"\xff" * 1000), bytearray(b"\x17" * 1000)]
    for _ in range(3):
        data = random_parts(rng, [rng.randrange(0, 1001) for _ in range(7)] + [1000])
        code.encode_into(data, [memoryview(buffers[0]), buffers[1]])
        assert buffers == code.encode(data)
    with pytest.raises(BadPart, match="1 parity buffers"):
        code.encode_into(data, [bytearray(1000)])
    with pytest.raises(BadPart, match=r"parity buffers of \[1000, 999\] bytes for a stripe of 1000"):
        code.encode_into(data, [bytearray(1000), bytearray(999)])
    with pytest.raises(BadPart, match="writable"):
        code.encode_into(data, [bytearray(1000), bytes(1000)])


def test_empty_stripes_encode_to_empty_parity():
    code = Code(Group(4, 2))
    assert code.encode([b""] * 4) == [bytearray(), bytearray()]
    assert code.reconstruct({2: b"", 3: b"", 4: b"", 5: b""}, [0] * 4, [0, 1]) == {0: bytearray(), 1: bytearray()}


def test_threads_encode_the_same_parity():
    code = Code(Group(8, 2))
    rng = random.Random(5)
    data = random_parts(rng, [300_000] * 8)
    expected = code.encode(data)
    with ThreadPoolExecutor(4) as pool:
        assert all(got == expected for got in pool.map(lambda _: code.encode(data), range(8)))


def test_parts_that_cannot_belong_to_the_stripe_are_refused():
    code = Code(Group(4, 2))
    full = stripe(code, [b"a" * 10, b"b" * 10, b"c" * 4, b""])
    lengths = [10, 10, 4, 0]
    survivors = {s: full[s] for s in (1, 2, 3, 4, 5)}
    with pytest.raises(BadPart, match="3 data parts"):
        code.encode([b""] * 3)
    with pytest.raises(BadPart, match="3 data part lengths"):
        code.reconstruct(survivors, [10, 10, 4], [0])
    with pytest.raises(BadPart, match="the data part in slot 2 is 4 bytes, not 5"):
        code.reconstruct(survivors, [10, 10, 5, 0], [0])
    with pytest.raises(BadPart, match="the parity part in slot 4 is 10 bytes, not 1099511627776"):
        code.reconstruct(survivors, [1 << 40, 10, 4, 0], [0])  # a length no part given has
    for bad in (-1, 1 << 60, 2.5, True):
        with pytest.raises(BadPart, match="data part length"):
            code.reconstruct(survivors, [bad, 10, 4, 0], [0])
    for slot in (-1, 6, 1 << 40, "0"):
        with pytest.raises(BadPart, match="slot"):
            code.reconstruct(survivors, lengths, [slot])
        with pytest.raises(BadPart, match="slot"):
            code.repair_plan([1, 2, 3, 4], slot)
        with pytest.raises(BadPart, match="slot"):
            code.reconstruct({**survivors, slot: b""}, lengths, [0])
    with pytest.raises(BadPart, match="slot 1 is among the survivors"):
        code.reconstruct(survivors, lengths, [1])
    with pytest.raises(BadPart, match="coefficient 256"):
        accumulate(bytearray(4), b"1234", 256)
    with pytest.raises(BadPart, match="does not fit"):
        accumulate(bytearray(3), b"1234", 7)
    with pytest.raises(BadPart, match="writable"):
        accumulate(memoryview(b"1234"), b"1234", 7)
    with pytest.raises(BadPart, match="contiguous"):
        accumulate(bytearray(4), memoryview(b"12345678")[::2], 7)
