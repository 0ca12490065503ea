"""The node's one metrics endpoint: the plugin's own series and every daemon's.

A PodMonitor scrapes one port per node (the plugin's), however many jobs run there, so the
plugin asks each of its daemons for its series over the control socket at every scrape and
serves them with its own: the daemons need no port of their own, and a daemon that does not
answer costs the scrape its series and one ``ASK_TIMEOUT`` (they are asked side by side),
not the node's. The same
endpoint serves ``/healthz`` (whether the plugin can take new volumes, as Probe() answers)
and ``/daemons`` (every daemon, serving or sick, and why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from tierfs import __version__
from tierfs.core.endpoint import Endpoint
from tierfs.core.errors import UserError
from tierfs.csi import events, health, rpc
from tierfs.csi.daemons import Daemon, ask, each, poll
from tierfs.csi.records import records
from tierfs.csi.settings import PluginConfig

log = logging.getLogger("tierfs.csi")
MAX_DAEMON_METRICS = 4 << 20  # characters of one daemon's exposition: a few thousand series at most


class PluginCollector(Collector):
    def __init__(self, cfg: PluginConfig, volumes):
        self.cfg, self.volumes = cfg, volumes

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("tierfs_plugin", "The CSI node plugin serving this node", labels=["node"])
        info.add_metric([self.cfg.node_id], {"version": __version__})
        yield info
        published = GaugeMetricFamily("tierfs_plugin_volumes", "Volumes published on this node")
        published.add_metric([], len(records(self.cfg.state_dir / "volumes")))
        yield published
        calls = CounterMetricFamily(
            "tierfs_plugin_volume_calls", "CSI calls answered, by method and gRPC code", labels=["call", "code"]
        )
        for (call, code), n in sorted(rpc.CALLS.copy().items()):
            calls.add_metric([call, code], n)
        yield calls
        posted = CounterMetricFamily(
            "tierfs_plugin_events", "Kubernetes Events posted on pods, by reason", labels=["reason"]
        )
        for reason, n in sorted(events.POSTED.copy().items()):
            posted.add_metric([reason], n)
        yield posted
        states = poll(self.volumes)
        sick = sum(health.sick_because(s) is not None for s in states)
        daemons = GaugeMetricFamily(
            "tierfs_plugin_daemons", "The jobs' daemons on this node, serving or sick", labels=["state"]
        )
        daemons.add_metric(["serving"], len(states) - sick)
        daemons.add_metric(["sick"], sick)
        yield daemons
        # A job's daemon outlives its pods (until --gc-after): alerts on a job that ended skip it by this.
        pods = GaugeMetricFamily(
            "tierfs_plugin_job_pods", "Pods of the job using its volume on this node", labels=["job"]
        )
        for state in states:
            pods.add_metric([state.job], len(state.daemon.pods))
        yield pods
        yield from merged(self._daemon_series(states))

    def _daemon_series(self, states) -> Iterator[Metric]:
        answering = [s.daemon for s in states if s.status is not None]  # the others are counted sick above
        for families in each(_series_of, answering):
            yield from families


def _series_of(daemon: Daemon) -> list[Metric]:
    """One daemon's series; none if it does not answer: its trouble costs its series, not the scrape."""
    try:
        text = ask(daemon, {"op": "metrics"}).get("text")
        if not isinstance(text, str) or len(text) > MAX_DAEMON_METRICS:
            raise UserError("its answer is not an exposition of a bounded size")
        return list(text_string_to_metric_families(text))
    except (UserError, ValueError) as e:
        log.debug("no metrics from the daemon of job %s: %s", daemon.job, e)
        return []


def merged(families: Iterator[Metric]) -> Iterator[Metric]:
    """One family per name: each daemon exposes the same families, with its own job and rank."""
    by_name: dict[str, Metric] = {}
    for family in families:
        known = by_name.setdefault(family.name, family)
        if known is not family:
            known.samples.extend(family.samples)
    yield from by_name.values()


def serve(cfg: PluginConfig, volumes) -> Endpoint | None:
    """The endpoint at ``cfg.metrics``, or None without one; raises UserError if it cannot listen."""
    if cfg.metrics is None:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PluginCollector(cfg, volumes))
    pages: dict[str, Callable[[], tuple[int, object]]] = {
        "/healthz": lambda: _healthz(cfg),
        "/daemons": lambda: (200, health.daemons_report(volumes)),
    }
    return Endpoint(cfg.metrics, registry, pages, what="tierfs csi --metrics")


def _healthz(cfg: PluginConfig) -> tuple[int, dict]:
    ok, why = health.can_serve(cfg)
    return (200 if ok else 503), {"ready": ok, "why": why}
