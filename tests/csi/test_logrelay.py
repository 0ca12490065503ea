"""The daemons' logs on the plugin's stdout (:mod:`tierfs.csi.logrelay`): through a real plugin,
and the relay alone over files this test writes, rotates and truncates."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.helpers import wait_for
from tierfs.csi.logrelay import MAX_LINE, LogRelay

JOB = {"job": "relayed", "rank": "0", "capacity": "64M"}


def test_the_plugin_relays_its_daemons_lines_with_the_job(plugin):
    plugin.publish(plugin.target(), JOB)
    line = wait_for(
        lambda: next(
            (line for line in plugin.log().splitlines() if line.startswith("job=relayed ") and " mounted " in line),
            None,
        ),
        timeout=10,
        what="the daemon's 'mounted' line on the plugin's stdout",
    )
    assert "INFO tierfs: mounted" in line  # the daemon's own line, after the prefix


def test_json_plugin_passes_its_daemons_json_lines_on(plugin_factory):
    plugin = plugin_factory("--log-format", "json")
    plugin.publish(plugin.target(), JOB)

    def mounted():
        for text in plugin.log().splitlines():
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if line.get("event") == "mounted":
                return line
        return None

    line = wait_for(mounted, timeout=10, what="the daemon's 'mounted' line on the plugin's stdout")
    assert (line["job"], line["rank"], line["level"]) == ("relayed", 0, "info")


def test_a_bad_plugin_log_format_is_one_line(shm_dir):
    proc = tierfs(
        "csi", "--log-format", "xml", "--endpoint", f"unix://{shm_dir()}/csi.sock", "--node-id", "n", check=False
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == ["tierfs: invalid --log-format 'xml': use text or json"]


# -- the relay alone ---------------------------------------------------------------------


@pytest.fixture
def logs(tmp_path) -> Path:
    (tmp_path / "old.log").write_text("before the plugin\n")
    return tmp_path


def append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def relayed(relay: LogRelay, out: io.StringIO) -> list[str]:
    relay.poll()
    lines = out.getvalue().splitlines()
    out.seek(0)
    out.truncate()
    return lines


def test_relay_starts_at_the_end_and_reads_new_files_from_the_start(logs):
    out = io.StringIO()
    relay = LogRelay(logs, out=out)
    relay._scan(at_end=True)  # what start() does before its thread runs
    append(logs / "old.log", "after\n")
    (logs / "new.log").write_text("first\nsecond")  # the second line is not finished yet
    (logs / "new.log.1").write_text("a rotated file is read only after its successor\n")
    assert sorted(relayed(relay, out)) == ["job=new first", "job=old after"]
    append(logs / "new.log", " line\n")
    assert relayed(relay, out) == ["job=new second line"]


def test_relay_follows_rotations_and_finishes_the_old_file(logs):
    out = io.StringIO()
    relay = LogRelay(logs, out=out)
    path = logs / "old.log"
    relay._scan(at_end=True)
    append(path, "1\n")
    assert relayed(relay, out) == ["job=old 1"]
    append(path, "2\n")  # written, then rotated away before the next pass
    path.rename(f"{path}.1")
    path.write_text("3\n")
    assert relayed(relay, out) == ["job=old 2", "job=old 3"]
    # Twice between two passes: .2 is finished, then .1, then the new file, each from its start.
    append(path, "4\n")
    os.rename(f"{path}.1", f"{path}.2")
    path.rename(f"{path}.1")
    append(f"{path}.1", "5\n")
    path.write_text("six\n")
    lines = []
    for _ in range(3):
        lines += relayed(relay, out)
    assert lines == ["job=old 4", "job=old 5", "job=old six"]
    path.write_text("7\n")  # truncated in place (shorter than what was read): read again from its start
    assert relayed(relay, out) == ["job=old 7"]


def test_relay_cuts_an_overlong_line_and_goes_on(logs):
    out = io.StringIO()
    relay = LogRelay(logs, out=out)
    relay._scan(at_end=True)
    append(logs / "old.log", "x" * (MAX_LINE * 3) + "\nnext\n")
    first, second = relayed(relay, out)
    assert first == f"job=old {'x' * MAX_LINE} [cut at {MAX_LINE >> 10} KiB]"
    assert second == "job=old next"
    append(logs / "old.log", "y" * (MAX_LINE + 10))  # no newline yet: cut without waiting for it
    assert relayed(relay, out) == [f"job=old {'y' * MAX_LINE} [cut at {MAX_LINE >> 10} KiB]"]
    append(logs / "old.log", "yyy\nafter\n")
    assert relayed(relay, out) == ["job=old after"]


def test_relay_in_json_passes_objects_and_wraps_the_rest(logs):
    out = io.StringIO()
    relay = LogRelay(logs, "json", out=out)
    relay._scan(at_end=True)
    append(logs / "old.log", '{"job": "old", "rank": 2, "message": "hi"}\nTraceback (most recent call last):\n')
    assert [json.loads(line) for line in relayed(relay, out)] == [
        {"job": "old", "rank": 2, "message": "hi"},
        {"job": "old", "message": "Traceback (most recent call last):"},
    ]


def test_relay_thread_stops_and_relays_what_came_last(logs):
    out = io.StringIO()
    relay = LogRelay(logs, out=out, every=60)  # no pass of its own before stop()
    relay.start()
    thread = relay._thread
    append(logs / "old.log", "last words\n")
    relay.stop()
    assert not thread.is_alive() and relay._tails == {}
    assert out.getvalue() == "job=old last words\n"
