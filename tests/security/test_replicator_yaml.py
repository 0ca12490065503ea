"""``replicator.yaml`` is written by whoever runs in the pod and read by root.

Whatever it holds -- deep nesting, an alias bomb, a huge file, a link to a root-only file,
a fifo, references to the daemon's secret, a job name that climbs out of the volume -- the
answer is one line in ``replicator.failed`` that repeats nothing of the daemon's
environment, nothing is written outside the job's tree, and the mount goes on serving.
"""

from __future__ import annotations

import json
import os
import string
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import tierfs
from tests.fuse.test_mtc import YAML, handshake
from tests.helpers import wait_for
from tierfs.mtc.spec import EXPANDABLE, MAX_SPEC_BYTES, SpecError, parse_spec

MARK = "S3CR3T-VALUE-7f1c9e"  # every environment value below contains it: it must never come back
ENV = {"TIERFS_SECRET": MARK, "HOME": f"/home/{MARK}", **{name: f"{MARK}-{name}" for name in EXPANDABLE}}
GOOD = YAML.format(job="run", rank=0, nodes=1)
DEEP = "job-name: " + "[" * 10_000 + "]" * 10_000  # within the size cap; 1000 levels overflow the stack
BOMB = (
    "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(5))
    + GOOD.replace("peer-ranks: []", "peer-ranks: *f")
)  # 10^6 elements once expanded; 3 more lines make 10^9


def check(text: str, env: dict[str, str] = ENV) -> SpecError | None:
    """Parse ``text``; any problem must be a SpecError of one short line that repeats no
    value of ``env``. Returns it (None if the spec was accepted)."""
    try:
        _, warnings = parse_spec(text, env=env)
    except SpecError as e:
        message = str(e)
        assert "\n" not in message and len(message) < 400, message
        assert MARK not in message, message
        return e
    for w in warnings:
        assert "\n" not in w and len(w) < 400 and MARK not in w, w
    return None


# -- the parser ------------------------------------------------------------------------------


def test_deep_nesting_is_refused_without_exhausting_the_stack():
    for text in (DEEP, "job-name:\n" + "- " * 10_000 + "x", "a: " + "{b: " * 10_000 + "1" + "}" * 10_000):
        assert "deeper than" in str(check(text))


def test_aliases_are_refused_before_they_expand():
    start = time.monotonic()
    assert "alias" in str(check(BOMB))
    assert time.monotonic() - start < 1.0
    assert "alias" in str(check(GOOD + "\nextra: &x 1"))  # an anchor alone is refused too


def test_a_file_larger_than_the_cap_is_refused_unread():
    assert "larger than" in str(check(GOOD + "\n#" + "x" * MAX_SPEC_BYTES))


def test_only_the_jobs_shape_expands_from_the_environment():
    """The daemon's secret (or anything else of its environment) never becomes a value."""
    for key in ("job-name", "framework", "peer-ranks", "nodes"):
        text = "\n".join(
            f"{k}: $TIERFS_SECRET" if k == key else line for line in GOOD.splitlines() for k in [line.partition(":")[0]]
        )
        assert "does not expand" in str(check(text))
    assert "does not expand" in str(check(GOOD.replace("run", "${HOME}")))
    spec, _ = parse_spec(GOOD.replace("node-rank: 0", "node-rank: $NODE_RANK"), env={"NODE_RANK": "0"})
    assert spec.node_rank == 0


def test_an_error_never_repeats_a_value():
    env = {**ENV, "NODE_RANK": f"{MARK}-not-a-number"}
    for text in (
        GOOD.replace("node-rank: 0", "node-rank: $NODE_RANK"),
        GOOD.replace("peer-ranks: []", "peer-ranks: ${JOBSET_NAME}"),
        GOOD.replace("peer-ranks: []", "peer-ranks: [$JOB_INDEX]"),
        GOOD.replace("framework: orbax", "framework: [$HOSTNAME]"),
    ):
        assert check(text, env) is not None


@pytest.mark.parametrize("name", ["../../etc/cron.d/x", "a/b", "x" * 300, "bad\nname", "nul\0"])
def test_a_job_name_is_one_file_name(name):
    assert "job-name" in str(check(GOOD.replace("job-name: run", f"job-name: {json.dumps(name)}")))


def test_odd_scalars_are_spec_errors():
    for value in (
        "1" * 5000,
        "2001-02-30",
        "!!binary '%%%'",
        "!!python/object:os.system x",
        "1:" * 20_000 + "1",
        ".inf",
        "!!set {1, 2}",
        "99999999999999999999",
    ):
        assert check(GOOD.replace("nodes: 1", f"nodes: {value}")) is not None


# -- fuzzing the parser ----------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["$TIERFS_SECRET", "${HOME}", "$NODE_RANK", "$", "$$", "${", "[$JOB_INDEX]"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
keys = st.sampled_from(
    [
        "job-name",
        "framework",
        "assume-data-parallelism",
        "node-rank",
        "nodes",
        "peer-ranks",
        "backup-interval-minutes",
        "backup-interval-steps",
        "workers-per-node",
        "master-port",
    ]
)
documents = st.dictionaries(keys | st.text(max_size=10), values, max_size=12)
FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.text(max_size=400))
def test_fuzz_any_text_is_a_spec_or_a_one_line_spec_error(text):
    check(text)


@FUZZ
@given(documents, st.booleans())
def test_fuzz_any_yaml_structure_is_a_spec_or_a_one_line_spec_error(doc, flow):
    check(yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True))


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, len(GOOD)), st.text(alphabet=string.printable + "&*!{}[]$", max_size=6)), max_size=6
    )
)
def test_fuzz_a_damaged_orbax_spec_is_a_spec_or_a_one_line_spec_error(edits):
    text = GOOD
    for at, piece in edits:
        text = text[:at] + piece + text[at:]
    check(text)


# -- through a real mount --------------------------------------------------------------------


@pytest.fixture
def hostile_env(monkeypatch):
    """The daemon's environment holds a secret, as on a real node."""
    monkeypatch.setenv("TIERFS_SECRET", MARK)


def daemon_values(pid: int) -> list[str]:
    """The values of the daemon's environment that could identify it (its secret among them)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [p.decode(errors="replace").partition("=") for p in f.read().split(b"\0") if p]
    return [v for _, _, v in pairs if len(v) >= 12]


def answered(mnt: Path, timeout: float = 15) -> str:
    """Wait for the node's acknowledgement; returns replicator.failed (and deletes it, as Orbax does)."""
    wait_for(lambda: not os.path.lexists(mnt / "replicator.yaml"), timeout, "replicator.yaml to be acknowledged", 0.05)
    failed = (mnt / "replicator.failed").read_text()
    (mnt / "replicator.failed").unlink()
    (mnt / "replicator.errors").unlink(missing_ok=True)
    return failed


def still_serving(mnt: Path) -> None:
    probe = mnt / "probe"
    probe.write_bytes(b"still here")
    assert probe.read_bytes() == b"still here"
    probe.unlink()


def place(mnt: Path, text: str) -> None:
    """Write ``replicator.yaml`` as Orbax does: beside it, then renamed into place."""
    (mnt / "replicator.yaml.tmp").write_text(text)
    os.replace(mnt / "replicator.yaml.tmp", mnt / "replicator.yaml")


def assert_clean_answer(vol, failed: str) -> None:
    lines = failed.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: "), failed
    for value in daemon_values(vol.pid):
        assert value not in failed, "replicator.failed repeats a value of the daemon's environment"


@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
def test_a_hostile_replicator_yaml_leaves_the_mount_serving(volumes, hostile_env, shm_dir):
    vol = volumes(job="run")
    mnt = vol.mountpoint
    outside = sorted(os.listdir(mnt.parent))
    escape = f"escape-{os.getpid()}"
    for text in (
        DEEP,
        BOMB,
        "x" * (MAX_SPEC_BYTES + 1),
        "\0\x01\x02binary",
        GOOD.replace("job-name: run", "job-name: $TIERFS_SECRET"),
        GOOD.replace("peer-ranks: []", "peer-ranks: ${TIERFS_SECRET}"),
        GOOD.replace("job-name: run", f"job-name: ../../{escape}"),
    ):
        place(mnt, text)
        assert_clean_answer(vol, answered(mnt))
        still_serving(mnt)
    assert sorted(os.listdir(mnt.parent)) == outside
    assert not list(Path("/dev/shm").glob(f"{escape}*")) and not list(mnt.parent.glob(f"{escape}*"))
    assert not list(mnt.glob("*.restore"))
    assert handshake(mnt, GOOD)[0] == 0, "a good spec is still taken"


@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
@pytest.mark.parametrize("kind", ["deep", "link", "fifo"])
def test_a_hostile_replicator_yaml_left_for_the_next_start(volumes, hostile_env, shm_dir, kind):
    """Found at start-up (written while no daemon served, or in a form that wakes nobody):
    the daemon starts, answers it and serves; it never dies at every restart."""
    vol = volumes(job="run")
    mnt = vol.mountpoint
    secret = shm_dir("tierfs-root-only") / "token"
    secret.write_text(GOOD.replace("peer-ranks: []", f"peer-ranks: {MARK}-root-only-content"))
    os.chmod(secret.parent, 0o700)
    if kind == "link":
        os.symlink(secret, mnt / "replicator.yaml")
    elif kind == "fifo":
        os.mkfifo(mnt / "replicator.yaml")
    tierfs("unmount", mnt)
    if kind == "deep":
        (vol.tree / "replicator.yaml").write_text(DEEP)
    again = volumes(job="run", mountpoint=mnt)
    failed = answered(mnt)
    assert_clean_answer(again, failed)
    assert "root-only-content" not in failed
    time.sleep(0.5)  # a daemon that died of it would be gone by now
    still_serving(mnt)
    assert handshake(mnt, GOOD)[0] == 0


@pytest.fixture
def one_mount(volumes, hostile_env):
    return volumes(job="run")


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
@given(st.one_of(st.text(max_size=300), documents.map(yaml.safe_dump)))
def test_fuzz_through_the_mount(one_mount, text):
    mnt = one_mount.mountpoint
    before = sorted(os.listdir(mnt.parent))
    place(mnt, text)
    wait_for(lambda: not os.path.lexists(mnt / "replicator.yaml"), 15, "replicator.yaml to be acknowledged", 0.02)
    if (mnt / "replicator.failed").exists():
        assert_clean_answer(one_mount, (mnt / "replicator.failed").read_text())
    for name in os.listdir(mnt):  # the answers, as the job consumes them
        if name.startswith("replicator.") or name.endswith(".restore"):
            os.unlink(mnt / name)
    still_serving(mnt)
    assert sorted(os.listdir(mnt.parent)) == before
