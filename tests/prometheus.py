"""A real Prometheus server (Debian's ``prometheus``) scraping tierfs endpoints, for tests.

It scrapes every second on loopback, keeps its data in a temporary directory, and is asked
through its HTTP query API, as an operator's dashboard or alert would ask it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from tierfs_testing import free_port

from tests.helpers import wait_for


def promtool_check_metrics(text: str) -> None:
    """``promtool check metrics`` on an exposition: fails the test on any problem it names."""
    run = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert run.returncode == 0, (run.stdout + run.stderr).decode()


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, list[str]]):
        """``targets``: scrape job -> HOST:PORT endpoints serving /metrics."""
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        # honor_labels: the series' own ``job`` (tierfs' job) wins over the scrape job's name,
        # as the PodMonitor in csi/deploy/monitoring asks too.
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [
                {"job_name": job, "honor_labels": True, "static_configs": [{"targets": addresses}]}
                for job, addresses in targets.items()
            ],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self._ready, timeout=60, what="prometheus to start")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited: {(self.dir / 'prometheus.log').read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple, float]:
        """An instant query: each series' labels (sorted pairs, without __name__) -> its value."""
        data = self._get("/api/v1/query", query=expr)
        return {
            tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): float(r["value"][1])
            for r in data["result"]
        }

    def value(self, expr: str) -> float | None:
        """The value of a query that names one series, None while it has none."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} names {len(result)} series: {result}"
        return next(iter(result.values()), None)

    def wait_value(self, expr: str, expected: float, timeout: float = 60) -> None:
        """Wait until the query's one series has ``expected``: scrapes are a second apart."""
        seen = []

        def matches() -> bool:
            seen[:] = [self.value(expr)]
            return seen[0] == expected

        try:
            wait_for(matches, timeout=timeout, what=f"{expr} == {expected}")
        except AssertionError as e:
            raise AssertionError(f"{e}; it was {seen[0] if seen else None}") from None

    def targets_up(self) -> dict[str, str]:
        """Each scraped endpoint -> its health (``up``, ``down``, ``unknown``) and last error."""
        data = self._get("/api/v1/targets")
        return {
            t["labels"]["instance"]: t["health"] + (f": {t['lastError']}" if t["lastError"] else "")
            for t in data["activeTargets"]
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def prometheus(tmp_path):
    """Factory: ``prometheus(targets)``; every server is stopped afterwards."""
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is not installed: run scripts/setup.sh")
    made: list[Prometheus] = []

    def make(targets: dict[str, list[str]]) -> Prometheus:
        made.append(Prometheus(tmp_path / f"prometheus-{len(made)}", targets))
        return made[-1]

    yield make
    for p in made:
        p.close()
