"""The daemon's Prometheus series: its counters, and its status read at each scrape.

What the daemon *is* at a moment (newest step per tier, lags, RAM, peers, a restore's
progress, goodput) is the status ``tierfs status`` shows, turned into gauges when
Prometheus asks, so the two never disagree; what it *did* (bytes sent, steps put,
errors, durations) is counted as it happens (:class:`tierfs.core.meters.Meters`). The
status is made on the trio thread, where everything it reads lives: a scrape from the
endpoint's thread asks for it there.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tierfs import __version__
from tierfs.config import Config
from tierfs.core.atomic import read_state, write_atomically
from tierfs.core.endpoint import Endpoint
from tierfs.core.errors import UserError
from tierfs.core.goodput import History, Observed, estimate
from tierfs.core.meters import LABELS, Meters, RequestTimes
from tierfs.fs import abi
from tierfs.tiers.base import Lane

log = logging.getLogger(__name__)
MAX_HISTORY = 64 << 10  # bytes: a record of a few numbers

# FUSE opcodes by value, named as the ``operation`` label spells them.
OPERATIONS = {
    value: name.lower()
    for name, value in vars(abi).items()
    if name.isupper()
    and isinstance(value, int)
    and 0 < value < 64
    and name
    in (
        "LOOKUP FORGET GETATTR SETATTR READLINK SYMLINK MKNOD MKDIR UNLINK RMDIR RENAME LINK OPEN READ "
        "WRITE STATFS RELEASE FSYNC SETXATTR GETXATTR LISTXATTR REMOVEXATTR FLUSH INIT OPENDIR READDIR "
        "RELEASEDIR FSYNCDIR ACCESS CREATE INTERRUPT DESTROY IOCTL BATCH_FORGET FALLOCATE READDIRPLUS "
        "RENAME2 LSEEK COPY_FILE_RANGE COPY_FILE_RANGE_64 TMPFILE STATX"
    ).split()
}
LANES = (Lane.PEERS, Lane.GCS, Lane.DISK)
GOODPUT = {  # status["goodput"] key -> (metric, help)
    "interval_s": ("tierfs_checkpoint_interval_seconds", "Median time between commits, observed"),
    "cost_s": ("tierfs_checkpoint_cost_seconds", "Mean time the job spends writing a step before its commit"),
    "overhead_ratio": ("tierfs_checkpoint_overhead_ratio", "Checkpoint cost over checkpoint interval"),
    "expected_loss_s": ("tierfs_expected_loss_per_failure_seconds", "Expected work lost per failure"),
    "mtbf_s": ("tierfs_mtbf_seconds", "Mean time between failures used: the operator's --mtbf, else observed"),
    "optimal_interval_s": (
        "tierfs_optimal_checkpoint_interval_seconds",
        "Checkpoint interval that maximises goodput (Young/Daly) at that MTBF",
    ),
    "goodput_ratio": ("tierfs_goodput_ratio", "Estimated share of time spent on useful work at the observed interval"),
    "optimal_goodput_ratio": ("tierfs_optimal_goodput_ratio", "The same share at the optimal interval"),
}


def lane_of(tier: str) -> str:
    """The lane a tier's name or kind belongs to: ``peer HOST:PORT`` and ``peer`` -> ``peers``."""
    word = tier.split()[0] if tier else "local"
    return Lane.PEERS if word == "peer" else word


def held_by(steps: Sequence[dict], lane: str) -> list[dict]:
    """The steps (as the status reports them) whose current version the lane's tiers hold."""
    return [st for st in steps if st["copies"].get(lane, {}).get("version") == st["version"]]


class StatusCollector(Collector):
    """Gauges (and the counters kept in the status) of one daemon, labelled with its job and rank."""

    def __init__(self, cfg: Config, status: Callable[[], dict], requests: Callable[[], RequestTimes | None]):
        self.labels = [cfg.job, str(cfg.rank)]
        self._status, self._requests = status, requests

    def _family(self, kind, name: str, text: str, extra: tuple[str, ...] = (), unit: str = ""):
        return kind(name, text, labels=[*LABELS, *extra], unit=unit)

    def collect(self) -> Iterator[Metric]:
        s = self._status()
        info = InfoMetricFamily("tierfs", "What serves the mount", labels=LABELS)
        info.add_metric(
            self.labels, {"version": __version__, "engine": s["fuse"]["engine"], "data_path": s["fuse"]["data_path"]}
        )
        yield info
        yield self._gauge("tierfs_start_time_seconds", "When the daemon started (unix time)", s["started_at"])
        yield self._counter("tierfs_steps_committed", "Steps committed on this rank", s["commits"])
        yield self._counter(
            "tierfs_failures",
            "Restarts of this rank that had to restore its step, since its first start",
            s["failures"],
        )
        ram = s["tiers"]["ram"]
        yield self._gauge("tierfs_ram_used_bytes", "Bytes the volume holds in RAM", ram["used"])
        yield self._gauge("tierfs_ram_capacity_bytes", "RAM the volume may use", ram["capacity"])
        fuse = s["fuse"]
        yield self._counter("tierfs_fuse_read_bytes", "Bytes read through the daemon data path", fuse["bytes_read"])
        yield self._counter(
            "tierfs_fuse_written_bytes", "Bytes written through the daemon data path", fuse["bytes_written"]
        )
        yield from self._steps(s)
        yield from self._peers(s)
        yield from self._erasure((s.get(Lane.PEERS) or {}).get("erasure"))
        yield from self._restore(s)
        yield from self._goodput(s.get("goodput") or {})
        if (times := self._requests()) is not None:
            yield self._request_times(times)

    def _gauge(self, name: str, text: str, value: float) -> GaugeMetricFamily:
        g = self._family(GaugeMetricFamily, name, text)
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, text: str, value: float) -> CounterMetricFamily:
        c = self._family(CounterMetricFamily, name, text)
        c.add_metric(self.labels, value)
        return c

    def _steps(self, s: dict) -> Iterator[Metric]:
        newest = self._family(
            GaugeMetricFamily,
            "tierfs_newest_step",
            "Newest committed step held by the tier (ram: this node's RAM; peers, gcs, disk: the lane's copies)",
            ("tier",),
        )
        when = self._family(
            GaugeMetricFamily,
            "tierfs_newest_step_timestamp_seconds",
            "Commit time of the newest step held by the tier (unix time)",
            ("tier",),
        )
        lag = self._family(
            GaugeMetricFamily,
            "tierfs_lag_seconds",
            "Age of the oldest committed step not yet on the tier; 0 when caught up",
            ("tier",),
        )
        steps = s["steps"]
        held = {"ram": steps}
        for lane in s["lanes"]:
            held[lane] = held_by(steps, lane)
            lag.add_metric([*self.labels, lane], (s.get(lane) or {}).get("lag_s", 0.0))
        for tier, have in held.items():
            if have:
                top = max(have, key=lambda st: st["step"])
                newest.add_metric([*self.labels, tier], top["step"])
                when.add_metric([*self.labels, tier], top["committed_at"])
        yield from (newest, when, lag)

    def _peers(self, s: dict) -> Iterator[Metric]:
        known = (s.get(Lane.PEERS) or {}).get("known")
        if known is None:
            return
        peers = self._family(
            GaugeMetricFamily, "tierfs_peers", "Peers of this node by the state it last saw", ("state",)
        )
        for state in ("up", "down", "unknown"):
            peers.add_metric([*self.labels, state], sum(p.get("state") == state for p in known))
        yield peers

    def _erasure(self, group: dict | None) -> Iterator[Metric]:
        """With --erasure: what this node holds for its group, and what the group's newest step survives."""
        if group is None:
            return
        yield self._gauge(
            "tierfs_erasure_grouped",
            "1 once this node agreed the job's erasure groups; 0 while it waits for every rank to answer",
            1 if "grouping" in group else 0,
        )
        yield self._gauge("tierfs_erasure_parity_bytes", "Parity this node holds for its group", group["parity_bytes"])
        yield self._gauge(
            "tierfs_erasure_members_answering", "Members of this node's group that answered", len(group["answering"])
        )
        steps = group["steps"]
        if steps:
            newest = steps[max(steps, key=int)]
            yield self._gauge(
                "tierfs_erasure_survivable_losses",
                "More members the group may lose with its newest step still rebuildable (< 0: not rebuildable now)",
                newest["survives"],
            )

    def _restore(self, s: dict) -> Iterator[Metric]:
        r = s.get("restored")
        missing = self._family(
            GaugeMetricFamily, "tierfs_restore_missing_bytes", "Bytes the running restore still has to fetch", ()
        )
        missing.add_metric(self.labels, r["bytes_missing"] if r else 0)
        yield missing
        restores = self._family(
            CounterMetricFamily,
            "tierfs_restores",
            "Restores begun by this daemon, by the tier most of the bytes came from",
            ("source",),
        )
        received = self._family(
            CounterMetricFamily, "tierfs_tier_received_bytes", "Bytes restored from the tier", ("tier",)
        )
        by_lane = dict.fromkeys(s["lanes"], 0)
        if r:
            restores.add_metric([*self.labels, lane_of(r["tier"])], 1)
            for tier, n in r["bytes_from"].items():
                by_lane[lane_of(tier)] = by_lane.get(lane_of(tier), 0) + n
        for lane, n in by_lane.items():
            received.add_metric([*self.labels, lane], n)
        yield restores
        yield received

    def _goodput(self, g: dict) -> Iterator[Metric]:
        for key, (name, text) in GOODPUT.items():
            if g.get(key) is not None:
                yield self._gauge(name, text, g[key])
        risk = self._family(
            GaugeMetricFamily,
            "tierfs_work_at_risk_seconds",
            "Work lost if a failure struck now "
            "and the step came back from the tier: now minus the newest step held there",
            ("tier",),
        )
        for tier, seconds in (g.get("at_risk_s") or {}).items():
            risk.add_metric([*self.labels, tier], seconds)
        yield risk

    def _request_times(self, times: RequestTimes) -> HistogramMetricFamily:
        h = self._family(
            HistogramMetricFamily,
            "tierfs_fuse_request_duration_seconds",
            "FUSE requests served by the daemon, from read to answer",
            ("operation",),
        )
        bounds = RequestTimes.bounds()
        for opcode, counts, total_ns in times.items():
            seen, cumulative = 0, []
            for bound, n in zip(bounds, counts, strict=True):
                seen += n
                cumulative.append((bound, seen))
            h.add_metric([*self.labels, OPERATIONS.get(opcode, "other")], cumulative, total_ns / 1e9)
        return h


class Telemetry:
    """A daemon's metrics: its counters, its status as series, the endpoint serving them, and
    what goodput is estimated from (:mod:`tierfs.core.goodput`)."""

    def __init__(
        self,
        cfg: Config,
        status: Callable[[bool], dict],
        requests: Callable[[], RequestTimes | None],
        history: Path,
        started: float,
    ):
        """``status(settle)``: the daemon's status (:func:`tierfs.daemon.status.report`)."""
        self.cfg, self.started_at = cfg, started
        self.registry = CollectorRegistry(auto_describe=False)
        self.meters = Meters(cfg.job, cfg.rank, self.registry)
        self._status = status
        self._token: trio.lowlevel.TrioToken | None = None
        self._history_path = history
        self.history = _load_history(history)
        self._safe: dict[str, float] = {}  # lane -> commit time of the newest step seen held there
        self._copy_s: dict[str, float] = {}  # lane -> median time from a commit until the lane held the step
        self.registry.register(StatusCollector(cfg, self._status_anywhere, requests))
        self.endpoint = Endpoint(cfg.metrics, self.registry) if cfg.metrics is not None else None

    def started(self) -> None:
        """Called on the trio thread once it runs: scrapes from other threads ask for the status there."""
        self._token = trio.lowlevel.current_trio_token()

    def _status_anywhere(self) -> dict:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:  # another thread: the endpoint's
            if self._token is None:
                raise RuntimeError("the daemon is not serving yet") from None
            return trio.from_thread.run_sync(self._status, False, trio_token=self._token)
        return self._status(False)

    def exposition(self) -> str:
        """Every series, as Prometheus reads them (the control socket's ``metrics``)."""
        return generate_latest(self.registry).decode()

    def restored(self, restore: dict) -> None:
        """A restore finished: a failure the job came back from, and how long coming back took."""
        self.meters.restored(lane_of(restore["tier"]), restore["seconds"])
        self.history.restored(restore["seconds"])
        try:
            write_atomically(self._history_path, json.dumps(self.history.to_json()))
        except OSError as e:  # only the goodput estimate is poorer for it
            log.warning("could not keep the restore in %s: %s", self._history_path, e)

    def report(self, steps: Sequence[dict], lanes: Sequence[str], commits: int, recent) -> dict:
        """What ``tierfs status`` adds: the endpoint, commits and failures, and the goodput estimate."""
        for lane in lanes:
            held = held_by(steps, lane)
            if held:
                self._safe[lane] = max(self._safe.get(lane, 0.0), max(st["committed_at"] for st in held))
            lags = sorted(st["copies"][lane]["lag_s"] for st in held if "lag_s" in st["copies"][lane])
            if lags:
                self._copy_s[lane] = lags[len(lags) // 2]
        now = time.time()
        restores = sorted(self.history.restore_s)
        observed = Observed(
            commits=list(recent),
            safe_at={lane: self._safe.get(lane) for lane in lanes},
            copy_s=dict(self._copy_s),
            restore_s=restores[len(restores) // 2] if restores else None,
            failures=self.history.failures,
            observed_s=now - self.history.first_seen,
            mtbf_s=self.cfg.mtbf,
        )
        restore_tier = next((lane for lane in LANES if lane in lanes), "local")
        return {
            "metrics": self.url,
            "started_at": self.started_at,
            "commits": commits,
            "failures": self.history.failures,
            "goodput": estimate(observed, now, restore_tier).as_dict(),
        }

    @property
    def url(self) -> str | None:
        return self.endpoint.url if self.endpoint is not None else None

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


def _load_history(path: Path) -> History:
    """What this rank remembers of earlier runs; a new record where there is none or it is unreadable."""
    try:
        return History.from_json(json.loads(read_state(path, MAX_HISTORY)))
    except FileNotFoundError:
        pass
    except (OSError, UserError, ValueError) as e:
        log.warning("starting a new goodput record: %s is unreadable: %s", path, e)
    return History(first_seen=time.time())
