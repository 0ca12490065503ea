"""JSON from outside: the same depth limit whatever the interpreter's own recursion limit."""

from __future__ import annotations

import json

import pytest

from tierfs.core.bounded_json import TooDeep, load, nesting_depth


def lists(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"0" + b"}" * depth


@pytest.mark.parametrize("make", [lists, objects])
def test_the_limit_itself_loads_and_one_level_more_is_refused(make):
    assert nesting_depth(load(make(8), 8), 8) == 8
    with pytest.raises(TooDeep, match="nests deeper than 8 levels"):
        load(make(9), 8)


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_a_nesting_bomb_is_refused_as_too_deep(depth):
    # 5,000 levels parse on Python 3.13 and raise RecursionError on 3.11 and 3.12;
    # 100,000 raise it everywhere. Either way the answer is the same.
    with pytest.raises(TooDeep, match="nests deeper than 16 levels"):
        load(lists(depth), 16)


@pytest.mark.parametrize("raw", [b"", b"[1,", b"\xff\xfe", b"{'a': 1}"])
def test_what_is_not_json_is_a_value_error_but_not_too_deep(raw):
    with pytest.raises(ValueError) as err:
        load(raw, 16)
    assert not isinstance(err.value, TooDeep)


def test_nesting_depth_counts_lists_and_objects_and_stops_past_the_limit():
    assert nesting_depth(7, 8) == 0
    assert nesting_depth([], 8) == 1
    assert nesting_depth({"a": [{}], "b": [1, [2]]}, 8) == 3
    deep = json.loads(lists(900))
    assert nesting_depth(deep, 8) == 9  # counts no further than limit + 1
