"""The request histograms' arithmetic, and the merging of several daemons' expositions into one."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tierfs.core.meters import REQUEST_BUCKETS, RequestTimes
from tierfs.csi.metrics import merged
from tierfs.daemon.metrics import lane_of


def test_a_time_lands_in_the_first_bucket_whose_bound_is_above_it():
    t = RequestTimes()
    for ns in (0, 8191, 8192, 16383, 16384, 10**12):
        t.record(15, ns)
    [(opcode, counts, total)] = t.items()
    bounds = RequestTimes.bounds()
    assert opcode == 15 and total == sum((0, 8191, 8192, 16383, 16384, 10**12))
    assert float(bounds[0]) == 8192e-9 and float(bounds[1]) == 16384e-9 and bounds[-1] == "+Inf"
    assert counts[:3] == [2, 2, 1] and counts[REQUEST_BUCKETS - 1] == 1 and sum(counts) == 6
    assert [float(b) for b in bounds[:-1]] == sorted(float(b) for b in bounds[:-1])


def test_an_opcode_beyond_fuses_counts_as_other():
    t = RequestTimes()
    t.record(4096, 1)  # CUSE_INIT
    t.record(1, 1)
    assert [op for op, _, _ in t.items()] == [0, 1]


def test_each_family_appears_once_with_every_daemons_samples():
    def exposition(job: str, value: int) -> str:
        return (
            f"# HELP tierfs_steps_committed_total Steps\n# TYPE tierfs_steps_committed_total counter\n"
            f'tierfs_steps_committed_total{{job="{job}",rank="0"}} {value}\n'
        )

    families = list(
        merged(f for text in (exposition("a", 1), exposition("b", 2)) for f in text_string_to_metric_families(text))
    )
    assert [f.name for f in families] == ["tierfs_steps_committed"]
    assert {s.labels["job"]: s.value for s in families[0].samples} == {"a": 1, "b": 2}


def test_tier_names_map_to_their_lanes():
    assert [lane_of(t) for t in ("peer 10.0.0.2:7420", "peer", "gcs", "disk", "local", "")] == [
        "peers",
        "peers",
        "gcs",
        "disk",
        "local",
        "local",
    ]
