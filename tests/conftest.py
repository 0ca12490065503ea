"""Shared fixtures: real tmpfs directories, real FUSE mounts driven through the CLI, a real
GCS emulator on loopback.

Every mount a test makes is unmounted in a finalizer, whatever the test did, and a daemon
that does not go away is killed by its PID; nothing else is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tierfs_testing import TIERFS, cleanup_mount, unmount_all_beneath
from tierfs_testing.gcs_emulator import GcsEmulator

from tests.prometheus import prometheus  # noqa: F401 (a fixture for every test package)
from tierfs.commands.status import fetch
from tierfs.core import mounts
from tierfs.ramtier.tmpfs import delete_ram_data

SHM = Path("/dev/shm")

# The suite runs on two workers (scripts/test.sh). Node addresses beyond 127.0.0.1 are one
# resource of the machine: a node restarted on its port, or cut off by nftables, must not meet
# another worker's node there. Every test that uses them runs on one worker, one at a time, and
# they start first, being the longest run.
SHARED_HOSTS = re.compile(r"127\.0\.0\.(?:[2-9]|[1-9][0-9]+)\b|LocalCluster")
HOST_FIXTURES = {"cluster", "dns_server", "chaos_job"}


def _uses_shared_hosts(path: Path, cache: dict[Path, bool]) -> bool:
    """Whether ``path``, or a conftest.py of a package of tests holding it, names a shared host."""
    if path not in cache:
        tests = Path(__file__).parent
        conftests = [d / "conftest.py" for d in path.parents if tests in d.parents and (d / "conftest.py").exists()]
        cache[path] = any(SHARED_HOSTS.search(p.read_text()) for p in [path, *conftests])
    return cache[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cache: dict[Path, bool] = {}
    for item in items:
        if HOST_FIXTURES & set(getattr(item, "fixturenames", ())) or _uses_shared_hosts(item.path, cache):
            item.add_marker(pytest.mark.xdist_group("shared-hosts"))


def tierfs(*args: str, check: bool = True, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run the ``tierfs`` command as a user would, capturing its output."""
    proc = subprocess.run([*TIERFS, *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"tierfs {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr}")
    return proc


@pytest.fixture(autouse=True, scope="session")
def runtime_dir():
    """Keep the tests' daemon registry away from the host's /run/tierfs."""
    path = SHM / f"tierfs-test-run-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    old = os.environ.get("TIERFS_RUNTIME_DIR")
    os.environ["TIERFS_RUNTIME_DIR"] = str(path)
    yield path
    if old is None:
        del os.environ["TIERFS_RUNTIME_DIR"]
    else:
        os.environ["TIERFS_RUNTIME_DIR"] = old
    shutil.rmtree(path, ignore_errors=True)


class DaemonLogs:
    """What the daemons of one test logged at WARNING or above, read before their files go.

    Bugs in a daemon mostly surface as log lines, not as failed calls, so a test fails when
    a daemon it started logs a warning or an error the test did not declare with
    ``@pytest.mark.expect_log(regex, ...)`` or ``daemon_logs.expect(regex)``.
    """

    # A text line's level, a JSON line's (--log-format json), or a traceback's first line
    # (an exception group's is indented).
    PROBLEM = re.compile(
        r'^\S+ \S+ \d+ (WARNING|ERROR|CRITICAL) |^\{.*"level": "(warning|error|critical)"'
        r"|^Traceback |^  \+ Exception Group Traceback "
    )

    def __init__(self, runtime_dir: Path):
        self.runtime_dir = runtime_dir
        self.expected: list[re.Pattern] = []
        self.problems: list[str] = []
        self._seen = {p: p.stat().st_size for p in runtime_dir.rglob("*.log")}

    def expect(self, *patterns: str) -> None:
        self.expected += [re.compile(p) for p in patterns]

    def collect(self, root: Path) -> None:
        """Read the new lines of every log under ``root``."""
        for path in sorted(root.rglob("*.log")):
            try:
                with open(path, "rb") as f:
                    f.seek(self._seen.get(path, 0))
                    text = f.read().decode(errors="replace")
            except OSError:
                continue
            self._seen[path] = self._seen.get(path, 0) + len(text.encode(errors="replace"))
            self.problems += [f"{path.name}: {line}" for line in text.splitlines() if self.PROBLEM.match(line)]

    def unexpected(self) -> list[str]:
        return [line for line in self.problems if not any(p.search(line) for p in self.expected)]


@pytest.fixture(autouse=True)
def daemon_logs(request, runtime_dir) -> Iterator[DaemonLogs]:
    logs = DaemonLogs(runtime_dir)
    for marker in request.node.iter_markers("expect_log"):
        logs.expect(*marker.args)
    yield logs
    logs.collect(runtime_dir)
    unexpected = logs.unexpected()
    if unexpected:
        pytest.fail("a daemon logged what this test does not expect:\n  " + "\n  ".join(unexpected[:20]), pytrace=False)


@pytest.fixture
def shm_dir(daemon_logs):
    """A fresh directory on tmpfs, removed afterwards with anything mounted in it."""
    made = []

    def make(prefix: str = "tierfs-test") -> Path:
        p = SHM / f"{prefix}-{uuid.uuid4().hex[:10]}"
        p.mkdir()
        made.append(p)
        return p

    yield make
    for p in made:
        unmount_all_beneath(p)  # ranks' own tmpfs (--capacity) outlive their daemons
        daemon_logs.collect(p)
        delete_ram_data(p)  # with what a failed test left immutable or append-only


@pytest.fixture
def small_tmpfs(shm_dir):
    """Factory: a tmpfs of its own, ``size`` bytes big (and more mount ``options``), unmounted
    afterwards with every mount beneath it (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    made: list[Path] = []

    def make(size: int, options: str = "") -> Path:
        p = shm_dir("tierfs-small")
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777{options and ','}{options}", "tierfs-test", str(p)],
            check=True,
        )
        made.append(p)
        return p

    yield make
    for p in made:
        subprocess.run(["umount", "-l", str(p)], check=False)


@pytest.fixture
def ref_dir(shm_dir) -> Path:
    """A plain tmpfs directory with the mode of a tmpfs root, to compare behaviour against."""
    p = shm_dir("tierfs-ref")
    os.chmod(p, 0o1777)
    return p


@dataclass
class Volume:
    mountpoint: Path
    ramdisk: Path
    job: str
    rank: int

    @property
    def tree(self) -> Path:
        return self.ramdisk / self.job / f"rank-{self.rank}" / "tree"

    def status(self) -> dict:
        return fetch(self.mountpoint)  # what `tierfs status --json` prints, without a CLI start per poll

    @property
    def pid(self) -> int:
        return mounts.Registration(self.mountpoint).read()["pid"]

    def is_mounted(self) -> bool:
        return mounts.find_mount(self.mountpoint) is not None


@pytest.fixture
def volumes(shm_dir):
    """Factory: ``volumes(job=..., rank=..., **options)`` mounts a volume through the CLI.

    Mountpoints live where every user can reach them (tests also run as non-root users).
    """
    made: list[Path] = []
    ramdisk = shm_dir("tierfs-ram")
    mnt_base = shm_dir("tierfs-mnt")

    def mount(
        job: str = "job", rank: int = 0, mountpoint: Path | None = None, ramdisk_dir: Path | None = None, **options
    ) -> Volume:
        mp = mountpoint
        if mp is None:
            mp = mnt_base / f"mnt-{len(made)}"
            mp.mkdir()
        rd = ramdisk_dir or ramdisk
        args = ["mount", mp, "--ramdisk", rd, "--job", job, "--rank", str(rank)]
        for key, value in options.items():
            flag = f"--{key.replace('_', '-')}"
            args += [flag] if value is True else [flag, str(value)]
        made.append(mp)
        tierfs(*args)
        return Volume(mp, rd, job, rank)

    mount.ramdisk = ramdisk
    yield mount
    for mp in made:
        cleanup_mount(mp)


@pytest.fixture
def volume(volumes) -> Volume:
    """One mounted volume with a 1 GiB capacity."""
    return volumes(capacity="1G")


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """One emulator for the session, with STORAGE_EMULATOR_HOST pointing at it meanwhile."""
    emulator = GcsEmulator(tmp_path_factory.mktemp("gcs-emulator"))
    try:
        emulator.start()
        with pytest.MonkeyPatch.context() as mp:
            for name, value in emulator.environ().items():
                mp.setenv(name, value)
            yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> str:
    """A new, empty bucket: tests never see each other's objects."""
    name = f"tierfs-test-{uuid.uuid4().hex[:12]}"
    gcs_emulator.make_bucket(name)
    return name


PREVIOUS = "b575158da5e0b6d5787091983fca61b3b5134b75"  # the release before this one


@pytest.fixture(scope="session")
def previous_release(tmp_path_factory) -> Path:
    """The previous release's package, for PYTHONPATH: built from this repository's own
    history (``git archive`` of :data:`PREVIOUS`)."""
    out = tmp_path_factory.mktemp("previous-release")
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", PREVIOUS, "src/tierfs"], capture_output=True
    )
    if archive.returncode != 0:
        pytest.skip(f"this checkout has no history to build the previous release from: {archive.stderr.decode()}")
    (out / "release.tar").write_bytes(archive.stdout)
    with tarfile.open(out / "release.tar") as tar:
        tar.extractall(out, filter="data")
    return out / "src"
