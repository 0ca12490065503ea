"""The rebuild model of scripts/bench_erasure_scale.py: its plans, their bytes, and its simulation."""

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_erasure_scale as bench

from tierfs.core.erasure import Code, accumulate
from tierfs.core.stripes import Group, data_lengths, parts

GiB, MiB = 1 << 30, 1 << 20
S = 4 * GiB
CHAIN_42, NAIVE_42 = bench.Scheme("chain", d=4, p=2), bench.Scheme("naive", d=4, p=2)
CHAIN_82, NAIVE_82 = bench.Scheme("chain", d=8, p=2), bench.Scheme("naive", d=8, p=2)
REPLICAS_1, REPLICAS_2 = bench.Scheme("replicas", r=1), bench.Scheme("replicas", r=2)


@pytest.mark.parametrize("scheme", [CHAIN_42, CHAIN_82])
def test_a_chain_brings_one_shard_and_the_parity_share_into_the_replacement(scheme):
    e = bench.estimate(bench.Model(), bench.plan(scheme, 1000, {0}, S))
    assert e["shard_in_max"] == S
    assert e["total_in_max"] == S + S * scheme.p // scheme.d
    # Every survivor sends about one part per chain it is in: (D+P) chains of D links over D+P-1 survivors.
    n = scheme.d + scheme.p
    assert e["survivor_out_max"] <= 1.05 * S * n / (n - 1)


@pytest.mark.parametrize("scheme", [NAIVE_42, NAIVE_82])
def test_all_to_one_brings_d_parts_for_every_lost_part(scheme):
    e = bench.estimate(bench.Model(), bench.plan(scheme, 1000, {3}, S))
    assert e["shard_in_max"] == scheme.d * S
    assert e["total_in_max"] == (scheme.d + scheme.p) * S


def test_a_single_loss_repairs_by_xor_alone_and_two_need_multiplications():
    one = bench.plan(CHAIN_42, 60, {7}, S)
    assert {c for item in one[0].shard for _, c in item.links} == {1}
    two = bench.plan(CHAIN_42, 60, {6, 7}, S)
    assert any(c != 1 for r in two for item in r.shard for _, c in item.links)


def test_every_chain_rebuilds_its_part_from_live_members_of_the_group():
    """Run each planned chain with the real codec on real bytes: the sum is the lost part."""
    group, shard = Group(4, 2), 4000
    code = Code(group)
    shards = [os.urandom(shard) for _ in range(group.size)]
    lengths = data_lengths(group, [shard] * group.size)
    data = {}  # (stripe, slot) -> bytes
    for m, blob in enumerate(shards):
        for p in parts(group, m, shard):
            data[p.stripe, p.slot] = blob[p.start : p.end]
    for s in range(group.size):
        stripe = [data[s, k] for k in range(group.d)]
        for j, parity in enumerate(code.encode(stripe)):
            data[s, group.d + j] = bytes(parity)
    base = group.size * 3  # the fourth group of a job of 60
    lost = {base + 1, base + 4}
    for rebuild in bench.plan(CHAIN_42, 60, lost, shard):
        member = rebuild.rank - base
        for item, stripe in zip(
            rebuild.shard + rebuild.redundancy, group.data_stripes(member) + group.parity_stripes(member), strict=True
        ):
            assert len(item.links) == group.d and item.target == rebuild.rank
            assert all(base <= rank < base + group.size and rank not in lost for rank, _ in item.links)
            total = bytearray(max(lengths[stripe]))
            for rank, coefficient in item.links:
                accumulate(total, data[stripe, group.slot(stripe, rank - base)], coefficient)
            expected = data[stripe, group.slot(stripe, member)]
            assert bytes(total[: len(expected)]) == expected


def test_replicas_fetch_from_the_live_holders_and_give_back_what_the_lost_rank_held():
    (one,) = bench.plan(REPLICAS_2, 100, {10}, S)
    assert sorted((c.source, c.length) for c in one.shard) == [(11, S // 2), (12, S // 2)]
    assert sorted(c.source for c in one.redundancy) == [8, 9]
    first, second = bench.plan(REPLICAS_2, 100, {10, 11}, S)
    assert [(c.source, c.length) for c in first.shard] == [(12, S)]
    assert second.after == (10,)  # rank 11 held a copy of rank 10's shard: from its replacement, once back


def test_one_loss_with_one_replica_takes_a_shard_over_one_nic():
    model = bench.Model(shard=1 * GiB)
    rebuilds = bench.plan(REPLICAS_1, 100, {5}, model.shard)
    wire = model.shard / model.nic
    assert bench.estimate(model, rebuilds)["shard_s"] == pytest.approx(wire, rel=0.01)
    assert bench.simulate(model, rebuilds)["shard_s"] == pytest.approx(wire, rel=0.02)
    model100 = replace(model, nic_gbit=100.0)
    assert bench.simulate(model100, rebuilds)["shard_s"] == pytest.approx(wire / 4, rel=0.02)


@pytest.mark.parametrize("scheme", [CHAIN_42, NAIVE_82, REPLICAS_2])
def test_losses_beyond_what_a_domain_tolerates_come_from_gcs(scheme):
    model = bench.Model(shard=256 * MiB)
    lost = set(range(scheme.tolerates + 1))
    rebuilds = bench.plan(scheme, 100, lost, model.shard)
    from_gcs = {r.rank for r in rebuilds if r.from_gcs}
    assert from_gcs == (lost if scheme.kind != "replicas" else {0})
    assert all(isinstance(i, bench.Restore) for r in rebuilds if r.from_gcs for i in r.shard)
    sim = bench.simulate(model, rebuilds)
    assert sim["gcs_bytes_read"] == len(from_gcs) * model.shard
    gcs = bench.gcs_seconds(model, model.shard, len(from_gcs))
    assert sim["shard_s"] == pytest.approx(gcs, rel=0.05)
    assert gcs > 5 * model.shard / model.nic  # GCS at 8 streams of 100 MB/s is far slower than a peer's NIC


def test_two_losses_in_a_group_cost_every_survivor_two_shards():
    """With P=2 and two members lost, D survivors are left and each is in every chain: 2 x D x D parts over D."""
    model = bench.Model()
    rebuilds = bench.plan(CHAIN_82, 1000, {20, 21}, S)
    shard_phase = bench.loads(model, [i for r in rebuilds for i in r.shard])
    assert max(shard_phase.out.values()) == min(shard_phase.out.values()) == 2 * S
    assert bench.estimate(model, rebuilds)["shard_s"] == pytest.approx(2 * S / model.nic, rel=0.02)


def test_the_simulated_chain_comes_close_to_the_flow_estimate():
    model = bench.Model(shard=1 * GiB)  # parts of 256 MiB, 64 blocks of 4 MiB each
    rebuilds = bench.plan(CHAIN_42, 60, {2}, model.shard)
    sim, e = bench.simulate(model, rebuilds), bench.estimate(model, rebuilds)
    assert e["shard_s"] <= sim["shard_s"] <= 1.1 * e["shard_s"]
    assert e["redundant_s"] <= 1.02 * sim["redundant_s"] <= 1.15 * e["redundant_s"]
    assert sim["gcs_bytes_read"] == 0


def test_domains_and_components_of_random_losses():
    lost = {0, 1, 2, 13, 30, 97}
    assert bench.domain_counts(CHAIN_42, 100, lost) == {"several": 0, "beyond": 1}  # {0, 1, 2} in group 0
    assert bench.domain_counts(REPLICAS_1, 100, lost) == {"several": 0, "beyond": 2}  # 0 -> 1 and 1 -> 2 lost
    assert bench.component(CHAIN_42, 100, lost, 1) == {0, 1, 2}
    assert bench.component(REPLICAS_2, 100, lost, 0) == {97, 0, 1, 2}  # ring distance 3 <= 2r
    assert bench.covered(100, [CHAIN_42, CHAIN_82, REPLICAS_1]) == 96  # groups of 6 cover 96 ranks, of 10 all 100
    picked = bench.random_losses(100, [CHAIN_82], 0.05, seed=1)
    assert len(picked) == 5 and max(picked) < 100
