"""A job's nodes are upgraded one at a time: this release and the one before it replicate to,
restore from and coordinate with each other, in both directions.

The release before is built from this repository's own history (the ``previous_release``
fixture) and run by one node of a real two-node cluster, the other node running this
checkout.
"""

from __future__ import annotations

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import sums
from tests.multinode.test_restore import commit_everywhere, files_of


@pytest.mark.expect_log(r"step 1 is no longer on peer .*: putting it on peers again")  # the wiped node's copy
def test_this_release_and_the_one_before_replicate_and_restore_each_other(cluster, previous_release):
    old, new = 0, 1
    c = cluster(2, replicas=1, capacity="256M")
    c.nodes[old].environ["PYTHONPATH"] = str(previous_release)
    c.start_all()
    assert "connection" not in c.status(old) and c.status(new)["connection"]["kept"], "two builds, really"
    expected = commit_everywhere(c, 1)  # each rank's step is on the other node
    for lost, kept in ((old, new), (new, old)):
        # The other node holds the lost rank's step (again, after the first round's wipe).
        wait_for(lambda: c.status(kept)["replicas_held"]["manifests"] == 1, what=f"rank {lost}'s step on node {kept}")
        c.kill_all()
        c.wipe(lost)  # restored from the other build's replica
        c.start_all()
        restored = wait_for(
            lambda: (r := c.status(lost)["restored"]) and r["state"] == "done" and r, what=f"rank {lost}'s restore"
        )
        assert (restored["step"], restored["tier"]) == (1, "peer"), restored
        for i in (old, new):
            assert sums(c.nodes[i].mountpoint, 1, files_of(i, 1)) == expected[i]
        assert c.status(kept)["cluster"]["restore_step"] == 1
    commit_everywhere(c, 2)  # and the next step replicates both ways again
