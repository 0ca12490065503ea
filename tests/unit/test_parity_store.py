"""The parity store (tierfs.store.parity): parity summed from pieces in any order equals the
codec's, pieces sent twice are summed once, conflicting ones are refused, and only complete
sums outlive a restart. Real files under tmp_path, real threads."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tierfs.core import manifest
from tierfs.core.erasure import Code
from tierfs.core.stripes import MAX_SHARD, Group
from tierfs.store.parity import MAX_READ, NotHeldParity, ParityError, ParityStore

Piece = tuple[int, int, int, bytes]  # (slot, part_length, offset, data)


def make_stripe(rng: random.Random, lengths: list[int]) -> list[bytes]:
    return [rng.randbytes(n) for n in lengths]


def cut(rng: random.Random, data: list[bytes], largest: int = 97) -> list[Piece]:
    """Every data part cut into pieces of random sizes (an empty part is one empty piece)."""
    pieces = []
    for slot, part in enumerate(data):
        offset = 0
        while True:
            n = min(rng.randint(1, largest), len(part) - offset)
            pieces.append((slot, len(part), offset, part[offset : offset + n]))
            offset += n
            if offset >= len(part):
                break
    return pieces


def feed(store: ParityStore, step: int, stripe: int, parity: int, pieces: list[Piece]) -> list[bool]:
    return [store.add(step, stripe, parity, slot, n, offset, piece) for slot, n, offset, piece in pieces]


def fill(store: ParityStore, code: Code, step: int, stripe: int, data: list[bytes], rng: random.Random) -> None:
    """Every parity part of the stripe, complete."""
    for parity in range(code.p):
        pieces = cut(rng, data)
        rng.shuffle(pieces)
        assert feed(store, step, stripe, parity, pieces)[-1]


def whole(store: ParityStore, step: int, stripe: int, parity: int) -> bytes:
    return store.read(step, stripe, parity, 0, store.length(step, stripe, parity))


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("d", "p", "lengths"),
    [(4, 2, [1000, 1000, 1000, 1000]), (4, 2, [700, 1000, 0, 999]), (3, 1, [513, 1, 511]), (3, 1, [0, 0, 0])],
)
def test_pieces_in_any_order_sum_to_the_codec_parity(tmp_path, d, p, lengths):
    rng = random.Random(f"{d}+{p} {lengths}")
    code = Code(Group(d, p))
    store = ParityStore(tmp_path / "parity-store", code)
    data = make_stripe(rng, lengths)
    expected = code.encode(data)
    for parity in range(p):
        pieces = cut(rng, data)
        rng.shuffle(pieces)
        done = feed(store, 3, 1, parity, pieces)
        assert done == [False] * (len(pieces) - 1) + [True], "complete exactly when the last piece is in"
        assert store.complete(3, 1, parity)
        assert store.length(3, 1, parity) == max(lengths)
        assert whole(store, 3, 1, parity) == expected[parity]
    assert store.entries() == {3: {(1, j): True for j in range(p)}}
    assert store.held_bytes() == p * max(lengths)


def test_pieces_from_many_threads_each_sent_twice_sum_once(tmp_path):
    rng = random.Random(7)
    code = Code(Group(4, 2))
    store = ParityStore(tmp_path, code)
    data = make_stripe(rng, [40_000, 39_999, 12_345, 40_000])
    jobs = [(parity, piece) for parity in range(2) for piece in cut(rng, data, largest=3000) * 2]
    rng.shuffle(jobs)
    with ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda job: store.add(5, 0, job[0], *job[1]), jobs))
    assert sum(done) >= 2  # each entry's last new piece said so (duplicates after it do too)
    expected = code.encode(data)
    for parity in range(2):
        assert whole(store, 5, 0, parity) == expected[parity]
        assert [store.received(5, 0, parity, slot) for slot in range(4)] == [len(part) for part in data]


def test_a_piece_sent_again_is_ignored(tmp_path):
    rng = random.Random(11)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    data = make_stripe(rng, [300, 300, 200])
    pieces = cut(rng, data)
    first, rest = pieces[0], pieces[1:]
    assert store.add(0, 2, 0, *first) is False
    assert store.add(0, 2, 0, *first) is False  # summed twice, it would cancel out
    assert store.received(0, 2, 0, first[0]) == len(first[3])
    feed(store, 0, 2, 0, rest)
    assert store.complete(0, 2, 0)
    assert store.add(0, 2, 0, *rest[-1]) is True  # and after completion
    assert whole(store, 0, 2, 0) == code.encode(data)[0]


def test_conflicting_pieces_are_refused_and_change_nothing(tmp_path):
    rng = random.Random(13)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    data = make_stripe(rng, [100, 100, 100])
    assert not store.add(1, 0, 0, 0, 100, 10, data[0][10:20])
    bad = [
        (0, 100, 15, data[0][15:25]),  # overlaps [10, 20) from the right
        (0, 100, 5, data[0][5:15]),  # from the left
        (0, 100, 10, data[0][10:15]),  # starts with it, shorter
        (0, 100, 0, data[0][0:100]),  # covers it
        (0, 90, 30, data[0][30:40]),  # another length for slot 0's part
        (1, 100, 95, data[1][95:100] + b"x"),  # past the part's end
        (1, 100, 0, b""),  # an empty piece of a part that is not empty
        (1, 0, 1, b""),  # an empty part's piece is at 0
    ]
    for piece in bad:
        with pytest.raises(ParityError, match="step 1 stripe 0"):
            store.add(1, 0, 0, *piece)
    assert store.received(1, 0, 0, 0) == 10 and store.received(1, 0, 0, 1) == 0
    feed(store, 1, 0, 0, [(0, 100, 0, data[0][:10]), (0, 100, 20, data[0][20:])])
    feed(store, 1, 0, 0, [(1, 100, 0, data[1]), (2, 100, 0, data[2])])
    assert whole(store, 1, 0, 0) == code.encode(data)[0]
    with pytest.raises(ParityError, match="not 77"):  # a complete entry still knows its parts' lengths
        store.add(1, 0, 0, 2, 77, 0, data[2][:10])


def test_a_restart_keeps_complete_parity_and_drops_the_rest(tmp_path):
    rng = random.Random(17)
    code = Code(Group(4, 2))
    store = ParityStore(tmp_path, code)
    done = make_stripe(rng, [500, 480, 500, 3])
    fill(store, code, 8, 4, done, rng)
    before = [whole(store, 8, 4, j) for j in range(2)]
    interrupted = make_stripe(rng, [200, 200, 200, 200])
    pieces = cut(rng, interrupted)
    feed(store, 9, 4, 1, pieces[: len(pieces) // 2])
    store.put_manifest(17, 8, b'{"rank": 17}')
    (tmp_path / "parity" / ".tmp.9.4.1.json").write_bytes(b"a meta being written when the daemon stopped")
    assert "parity/9.4.1" in files(tmp_path)

    again = ParityStore(tmp_path, code)
    again.load()
    assert again.entries() == {8: {(4, 0): True, (4, 1): True}}
    assert [whole(again, 8, 4, j) for j in range(2)] == before
    assert again.held_bytes() == 2 * 500
    kept = {"parity/8.4.0", "parity/8.4.0.json", "parity/8.4.1", "parity/8.4.1.json", "manifests/17.8"}
    assert files(tmp_path) == kept
    assert again.received(9, 4, 1, pieces[0][0]) == 0 and again.received(8, 4, 1, 3) == 3
    assert again.get_manifest(17, 8) == b'{"rank": 17}'
    with pytest.raises(NotHeldParity):
        again.read(9, 4, 1, 0, 1)
    feed(again, 9, 4, 1, pieces)  # its senders send everything again: no stale half-sum under it
    assert whole(again, 9, 4, 1) == code.encode(interrupted)[1]


def test_a_restart_drops_parity_whose_meta_does_not_match_it(tmp_path):
    rng = random.Random(19)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    fill(store, code, 1, 0, make_stripe(rng, [64, 64, 64]), rng)
    fill(store, code, 2, 0, make_stripe(rng, [64, 64, 64]), rng)
    os.truncate(tmp_path / "parity" / "1.0.0", 63)
    again = ParityStore(tmp_path, code)
    again.load()
    assert again.entries() == {2: {(0, 0): True}}
    assert "parity/1.0.0" not in files(tmp_path)


def test_reads_past_the_end_are_the_stripe_padding(tmp_path):
    rng = random.Random(23)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    data = make_stripe(rng, [50, 10, 0])
    fill(store, code, 0, 3, data, rng)
    parity = code.encode(data)[0]
    assert store.read(0, 3, 0, 40, 30) == parity[40:] + bytes(20)
    assert store.read(0, 3, 0, 1000, 7) == bytes(7)
    assert store.read(0, 3, 0, 0, 0) == b""
    for offset, length in [(-1, 1), (0, -1), (0, MAX_READ + 1), (True, 1)]:
        with pytest.raises(ParityError):
            store.read(0, 3, 0, offset, length)


def test_manifest_copies_round_trip_and_are_capped(tmp_path):
    store = ParityStore(tmp_path, Code(Group(4, 2)))
    store.put_manifest(5, 12, b"five at twelve")
    store.put_manifest(2, 12, b"two at twelve")
    store.put_manifest(5, 3, b"five at three")
    store.put_manifest(5, 12, b"five at twelve, again")
    assert store.manifests() == [(2, 12), (5, 3), (5, 12)]
    assert store.get_manifest(5, 12) == b"five at twelve, again"
    with pytest.raises(NotHeldParity):
        store.get_manifest(5, 4)
    with pytest.raises(ParityError, match="rank 1 step 1"):
        store.put_manifest(1, 1, bytes(manifest.MAX_BYTES + 1))
    for rank, step in [(-1, 0), (0, -1), ("0", 0)]:
        with pytest.raises(ParityError):
            store.put_manifest(rank, step, b"{}")
    assert store.manifests() == [(2, 12), (5, 3), (5, 12)]
    again = ParityStore(tmp_path, Code(Group(4, 2)))
    again.load()
    assert again.manifests() == [(2, 12), (5, 3), (5, 12)]
    assert again.get_manifest(2, 12) == b"two at twelve"


def test_forget_before_frees_the_older_steps(tmp_path):
    rng = random.Random(29)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    fill(store, code, 1, 0, make_stripe(rng, [100, 90, 80]), rng)
    fill(store, code, 2, 1, make_stripe(rng, [30, 30, 30]), rng)
    feed(store, 2, 2, 0, [(0, 70, 0, rng.randbytes(10))])
    store.put_manifest(0, 1, b"old")
    store.put_manifest(0, 2, b"new")
    assert store.held_bytes() == 100 + 30 + 70
    assert store.forget_before(2) == 100
    assert store.held_bytes() == 100
    assert store.entries() == {2: {(1, 0): True, (2, 0): False}}
    assert store.manifests() == [(0, 2)]
    with pytest.raises(NotHeldParity):
        store.read(1, 0, 0, 0, 1)
    assert store.forget_before(3) == 100
    assert store.held_bytes() == 0 and store.entries() == {} and files(tmp_path) == set()


def test_a_closed_store_drops_everything_and_takes_nothing_more(tmp_path):
    rng = random.Random(31)
    code = Code(Group(3, 1))
    store = ParityStore(tmp_path, code)
    fill(store, code, 1, 0, make_stripe(rng, [100, 90, 80]), rng)
    feed(store, 2, 2, 0, [(0, 70, 0, rng.randbytes(10))])
    store.put_manifest(0, 1, b"{}")
    assert store.close() == 100 + 70
    assert store.held_bytes() == 0 and store.entries() == {} and store.manifests() == []
    assert files(tmp_path) == set()
    with pytest.raises(ParityError, match="dropped the grouping"):
        store.add(3, 0, 0, 0, 10, 0, b"x")
    with pytest.raises(ParityError, match="dropped the grouping"):
        store.put_manifest(0, 3, b"{}")
    assert files(tmp_path) == set()


@pytest.mark.parametrize(
    ("step", "stripe", "parity", "slot", "part_length", "offset", "data"),
    [
        (-1, 0, 0, 0, 4, 0, b"abcd"),
        (0, 6, 0, 0, 4, 0, b"abcd"),  # a 4+2 group has stripes 0..5
        (0, 0, 2, 0, 4, 0, b"abcd"),  # and parity parts 0..1
        (0, 0, 0, 4, 4, 0, b"abcd"),  # and data slots 0..3
        (0, 0, 0, -1, 4, 0, b"abcd"),
        (0, 0, 0, True, 4, 0, b"abcd"),
        (0, 0, 0, 0, 4, -1, b"abcd"),
        (0, 0, 0, 0, 4, 1, b"abcd"),
        (0, 0, 0, 0, MAX_SHARD + 1, 0, b"abcd"),
        (0, 0, 0, 0, -4, 0, b""),
    ],
)
def test_impossible_pieces_are_refused(tmp_path, step, stripe, parity, slot, part_length, offset, data):
    store = ParityStore(tmp_path, Code(Group(4, 2)))
    with pytest.raises(ParityError):
        store.add(step, stripe, parity, slot, part_length, offset, data)
    assert store.entries() == {} and files(tmp_path) == set()


def test_incomplete_parity_is_not_served(tmp_path):
    store = ParityStore(tmp_path, Code(Group(3, 1)))
    store.add(4, 0, 0, 0, 10, 0, b"0123456789")
    assert not store.complete(4, 0, 0)
    for ask in (lambda: store.length(4, 0, 0), lambda: store.read(4, 0, 0, 0, 1), lambda: store.length(4, 1, 0)):
        with pytest.raises(NotHeldParity):
            ask()
