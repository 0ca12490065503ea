"""Three real daemons scraped by a real Prometheus: what an operator's queries see.

Every value asserted here is one Prometheus stored from a scrape, asked through its query
API, against what the test itself wrote (bytes, steps) or the daemon's own status.
"""

from __future__ import annotations

import urllib.request

import pytest
from tierfs_testing import free_port

from tests.helpers import wait_for
from tests.multinode.test_peers import commit_step
from tests.multinode.test_restore import files_of
from tests.prometheus import promtool_check_metrics

STEPS = (1, 2)


def step_bytes(rank: int, step: int) -> int:
    return sum(len(b) for b in files_of(rank, step).values())


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.fixture
def scraped(cluster, gcs_bucket, prometheus):
    """A 3-node job with peers and GCS, each daemon serving /metrics, and Prometheus scraping them."""
    c = cluster(3, replicas=1, capacity="256M", keep_local=3, gcs=f"gs://{gcs_bucket}/metrics")
    for n in c.nodes:
        n.environ["TIERFS_METRICS"] = f"{n.host}:{free_port(n.host)}"
    c.start_all()
    prom = prometheus({"tierfs": [n.environ["TIERFS_METRICS"] for n in c.nodes]})
    return c, prom


def test_prometheus_sees_each_rank_commit_replicate_back_up_and_restore(scraped):
    c, prom = scraped
    for step in STEPS:
        for i, n in enumerate(c.nodes):
            commit_step(n.mountpoint, step, files_of(i, step))
        for i in range(3):
            c.wait_safe(i, step)
    for i, n in enumerate(c.nodes):
        promtool_check_metrics(scrape(n.environ["TIERFS_METRICS"]))
        rank = f'job="{c.job}",rank="{i}"'
        prom.wait_value(f"tierfs_steps_committed_total{{{rank}}}", len(STEPS))
        for tier in ("ram", "peers", "gcs"):
            prom.wait_value(f'tierfs_newest_step{{{rank},tier="{tier}"}}', STEPS[-1])
        # Every step's bytes were new to both tiers (each rank's bytes differ by step): all sent.
        written = sum(step_bytes(i, s) for s in STEPS)
        for tier in ("peers", "gcs"):
            prom.wait_value(f'tierfs_tier_sent_bytes_total{{{rank},tier="{tier}"}}', written)
            prom.wait_value(f'tierfs_tier_steps_total{{{rank},tier="{tier}"}}', len(STEPS))
            prom.wait_value(f'tierfs_tier_errors_total{{{rank},tier="{tier}"}}', 0)
            prom.wait_value(f'tierfs_lag_seconds{{{rank},tier="{tier}"}}', 0)
            assert prom.value(f'tierfs_step_copy_duration_seconds_count{{{rank},tier="{tier}"}}') == len(STEPS)
        status = c.status(i)
        assert prom.value(f"tierfs_ram_capacity_bytes{{{rank}}}") == status["tiers"]["ram"]["capacity"] == 256 << 20
        assert prom.value(f'tierfs_peers{{{rank},state="up"}}') == 2
        assert prom.value(f'count(tierfs_info{{{rank},data_path="{status["fuse"]["data_path"]}"}})') == 1
        # The files were created through the daemon, whichever path their bytes took.
        assert prom.value(f'tierfs_fuse_request_duration_seconds_count{{{rank},operation="create"}}') >= 2

    # Rank 0 loses its node: its RAM comes back from its peer, and Prometheus sees where from.
    c.kill(0)
    c.wipe(0)
    c.start(0)
    wait_for(lambda: (c.status(0)["restored"] or {}).get("state") == "done", what="rank 0's restore")
    rank0 = f'job="{c.job}",rank="0"'
    prom.wait_value(f'tierfs_restores_total{{{rank0},source="peers"}}', 1)
    prom.wait_value(f'tierfs_tier_received_bytes_total{{{rank0},tier="peers"}}', step_bytes(0, STEPS[-1]))
    prom.wait_value(f'tierfs_restore_duration_seconds_count{{{rank0},source="peers"}}', 1)
    prom.wait_value(f"tierfs_failures_total{{{rank0}}}", 1)
    prom.wait_value(f'tierfs_newest_step{{{rank0},tier="ram"}}', STEPS[-1])
    prom.wait_value(f"tierfs_restore_missing_bytes{{{rank0}}}", 0)
    assert c.status(0)["metrics"] == f"http://{c.nodes[0].environ['TIERFS_METRICS']}/metrics"
    assert all(health == "up" for health in prom.targets_up().values()), prom.targets_up()
