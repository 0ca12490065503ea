"""replicator.yaml: what the job may say, and the one-line reasons a spec is refused."""

from __future__ import annotations

import pytest

from tierfs.mtc.protocol import restore_entry_name, restore_entry_step
from tierfs.mtc.spec import SpecError, parse_spec

ORBAX = """job-name: run-7
framework: orbax
assume-data-parallelism: 2
node-rank: 1
nodes: 4
peer-ranks: [3]
backup-interval-minutes: 30"""


def spec_with(**changes) -> str:
    lines = dict(line.split(": ", 1) for line in ORBAX.splitlines())
    for key, value in changes.items():
        key = key.replace("_", "-")
        if value is None:
            lines.pop(key, None)
        else:
            lines[key] = value
    return "\n".join(f"{k}: {v}" for k, v in lines.items())


def test_orbax_spec_is_read_as_written():
    spec, warnings = parse_spec(ORBAX, env={})
    assert (spec.job_name, spec.framework, spec.nodes, spec.node_rank) == ("run-7", "orbax", 4, 1)
    assert spec.peer_ranks == (3,) and spec.data_parallelism == 2
    assert spec.backup_interval_minutes == 30 and spec.backup_interval_s == 1800.0
    assert spec.backup_interval_steps is None and warnings == []


def test_step_interval_and_pytorch_extras():
    text = spec_with(backup_interval_minutes=None, backup_interval_steps="100", framework="pytorch.distributed")
    spec, warnings = parse_spec(text + "\nworkers-per-node: 2\nmaster-port: 29500", env={})
    assert spec.backup_interval_steps == 100 and spec.backup_interval_s is None
    assert spec.workers_per_node == 2 and warnings == []


def test_variables_are_expanded_from_the_environment():
    text = spec_with(node_rank="$NODE_RANK", job_name="${JOBSET_NAME}-x", peer_ranks="[$JOB_INDEX]")
    spec, _ = parse_spec(text, env={"NODE_RANK": "2", "JOBSET_NAME": "j", "JOB_INDEX": "0"})
    assert (spec.node_rank, spec.job_name, spec.peer_ranks) == (2, "j-x", (0,))
    with pytest.raises(SpecError, match=r"'node-rank' .* refers to \$NODE_RANK, which is not set"):
        parse_spec(text, env={"JOBSET_NAME": "j", "JOB_INDEX": "0"})


def test_unknown_keys_and_frameworks_are_warnings():
    _, warnings = parse_spec(spec_with(framework="jaxlike") + "\ncolour: blue", env={})
    assert any("'colour'" in w for w in warnings) and any("'jaxlike'" in w for w in warnings)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nodes": None}, r"lacks 'nodes'"),
        ({"job_name": None, "peer_ranks": None}, r"lacks 'job-name', 'peer-ranks'"),
        ({"node_rank": "4"}, r"'node-rank' 4 is out of range for 4 node\(s\)"),
        ({"node_rank": "-1"}, r"'node-rank' -1 is out of range"),
        ({"peer_ranks": "[3, 3]"}, r"'peer-ranks' lists rank 3 more than once"),
        ({"peer_ranks": "[7]"}, r"'peer-ranks' has rank 7, out of range"),
        ({"peer_ranks": "[1]"}, r"'peer-ranks' has this node's own rank 1"),
        ({"peer_ranks": "3"}, r"'peer-ranks' must be a list"),
        ({"backup_interval_steps": "10"}, r"exactly one of .* \(both given\)"),
        ({"backup_interval_minutes": None}, r"exactly one of .* \(neither given\)"),
        ({"nodes": "four"}, r"'nodes' must be a whole number"),
        ({"assume_data_parallelism": "3"}, r"'assume-data-parallelism' 3 must .* divide 'nodes' \(4\)"),
        ({"backup_interval_minutes": "-5"}, r"'backup-interval-minutes' is -5 .* must not be negative"),
    ],
)
def test_malformed_specs_name_their_problem(changes, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(spec_with(**changes), env={})


@pytest.mark.parametrize("text", ["nodes: [1", "- just\n- a list", ""])
def test_not_a_mapping_or_not_yaml(text):
    with pytest.raises(SpecError, match="replicator.yaml"):
        parse_spec(text, env={})


def test_restore_entry_names_round_trip():
    name = restore_entry_name("run-7", 120, 3)
    assert name == "run-7-s120-n3-w0.restore" and restore_entry_step(name) == 120
    assert restore_entry_step("120") is None and restore_entry_step("x-s1-n2.restore") is None


def test_a_rollback_is_read_and_refused_below_zero():
    spec, warnings = parse_spec(ORBAX + "\nrestore-step: 300", env={})
    assert spec.restore_step == 300 and warnings == []
    assert parse_spec(ORBAX, env={})[0].restore_step is None
    with pytest.raises(SpecError, match=r"'restore-step' is -1 .* must not be negative"):
        parse_spec(ORBAX + "\nrestore-step: -1", env={})
