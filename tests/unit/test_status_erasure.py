"""What ``tierfs status`` says of an erasure group: before its grouping is agreed, and after."""

from __future__ import annotations

from tierfs.commands.status import erasure_lines


def test_a_group_not_formed_names_the_ranks_it_waits_for():
    waiting = {"shape": "2+1", "members": [], "answering": [], "parity_bytes": 0, "steps": {}, "waiting_for": [2, 5]}
    assert erasure_lines(waiting) == ["        no group yet: the grouping forms once rank(s) 2, 5 answer"]
    assert erasure_lines({**waiting, "waiting_for": []}) == ["        no group yet: the grouping is not agreed yet"]


def test_a_formed_group_shows_its_grouping_weak_spots_and_steps():
    group = {
        "shape": "2+1",
        "group": 1,
        "grouping": "3dda26dda388f5df",
        "members": [1, 3, 5],
        "answering": [1, 3],
        "parity_bytes": 3 << 20,
        "weak_spots": [["rack=a", [1, 3]]],
        "twins_together": [[3, 5]],
        "steps": {"4": {"survives": 0, "rebuildable": [1, 3, 5]}, "5": {"survives": -1, "rebuildable": []}},
    }
    lines = [line.strip() for line in erasure_lines(group)]
    assert lines[0] == "group 1 of ranks 1, 3, 5 (grouping 3dda26dda388f5df): 2 answering, 3.0 MiB of parity held here"
    assert lines[1] == "weak spot: rack=a holds ranks 1, 3, more than it survives"
    assert lines[2] == "twins 3, 5 share the group: there were fewer groups than twins"
    assert lines[3] == "step 4: survives 0 more loss(es); rebuildable ranks [1, 3, 5]"
    assert lines[4] == "step 5: cannot be rebuilt (1 part(s) short); rebuildable ranks none"
