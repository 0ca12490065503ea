"""Kubernetes Events on the training pods: what happened to their checkpoints, where the job's
people already look (``kubectl describe pod``, ``kubectl get events``).

Reasons, each on every pod that uses the job's volume on this node:

- ``TierfsRestored`` (Normal): the daemon finished restoring a step, once per restore.
- ``TierfsBackupFailing`` (Warning): the GCS backup has failed, or lagged past its own
  backup interval, for longer than ``--event-backup-lag``.
- ``TierfsCapacityNearlyFull`` (Warning): the RAM tier is over ``FULL`` of its capacity.
- ``TierfsStartRefused`` (Warning): NodePublishVolume refused the pod's volume (the refusal's
  message; kubelet shows the same in its own FailedMount events, ours names the reason).

One thread (:class:`EventWatcher`) looks at the daemons every ``--event-interval`` and posts;
a refused publish only queues its Event for that thread, so no kubelet call ever waits for
the API server or hears of its failures. A failure to post is logged once a minute.

Repeats: a reason is posted on a pod once, as a new Event, and thereafter at most once every
``REPEAT_AFTER``, by patching that Event's ``count`` and ``lastTimestamp`` (as kubelet's own
event correlator does); occurrences in between are dropped. :data:`POSTED` counts the posts
and patches by reason (``tierfs_plugin_events_total``).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from tierfs.csi import kube
from tierfs.csi.daemons import Daemon, DaemonState, HasStateDir, poll
from tierfs.csi.records import pod_of
from tierfs.csi.settings import PluginConfig

log = logging.getLogger("tierfs.csi")

RESTORED, BACKUP_FAILING = "TierfsRestored", "TierfsBackupFailing"
CAPACITY_NEARLY_FULL, START_REFUSED = "TierfsCapacityNearlyFull", "TierfsStartRefused"
TYPES = {RESTORED: "Normal", BACKUP_FAILING: "Warning", CAPACITY_NEARLY_FULL: "Warning", START_REFUSED: "Warning"}
COMPONENT = "tierfs-csi"
REPEAT_AFTER = 600.0  # seconds between two posts of one reason on one pod
FORGET_AFTER = 3600.0  # the API server's default Event TTL: an Event older than that is gone anyway
WARN_EVERY = 60.0  # seconds between two warnings that Events cannot be posted
FULL = 0.9  # share of its capacity the RAM tier may hold before a warning
MAX_MESSAGE = 1024  # characters: an Event's message is one line for `kubectl describe`
MAX_QUEUED = 64  # refusals waiting for the thread; kubelet retries a refused publish anyway

POSTED: dict[str, int] = dict.fromkeys(TYPES, 0)  # Events posted or updated, by reason
_posted_lock = threading.Lock()


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


@dataclass
class _Posted:
    namespace: str
    name: str  # the Event's own name
    count: int
    at: float  # when it was last posted or patched


class Recorder:
    """Posts Events on pods, one per reason and pod, repeats folded into its count."""

    def __init__(self, client: kube.KubeClient, node_id: str, clock: Callable[[], float] = time.time):
        self.client, self.node_id, self.clock = client, node_id, clock
        self._posted: dict[tuple[str, str], _Posted] = {}
        self._warned_at = -math.inf
        self._unwarned = 0

    def emit(self, pod: dict, reason: str, message: str) -> bool:
        """Post (or fold in) one occurrence; False only when the API server did not take it."""
        key = (pod.get("uid") or f"{pod['namespace']}/{pod['name']}", reason)
        now = self.clock()
        before = self._posted.get(key)
        if before is not None and now - before.at < REPEAT_AFTER:
            return True
        message, stamp = _one_line(message), _stamp(now)
        try:
            if before is not None:
                try:
                    self.client.patch_event(
                        before.namespace,
                        before.name,
                        {"count": before.count + 1, "lastTimestamp": stamp, "message": message},
                    )
                    before.count, before.at = before.count + 1, now
                    _count(reason)
                    return True
                except kube.EventGone:
                    pass  # expired: a new one
            name = f"{pod['name'][:236].rstrip('.-')}.{secrets.token_hex(8)}"
            self.client.post_event(pod["namespace"], self._event(pod, name, reason, message, stamp))
        except (kube.EventRefused, ValueError) as e:
            self._failed(pod, reason, e, now)
            return False
        self._posted[key] = _Posted(pod["namespace"], name, 1, now)
        _count(reason)
        return True

    def forget_old(self) -> None:
        """Drop what the API server has expired: the next occurrence posts a new Event."""
        now = self.clock()
        for key in [k for k, p in self._posted.items() if now - p.at >= FORGET_AFTER]:
            del self._posted[key]

    def _event(self, pod: dict, name: str, reason: str, message: str, stamp: str) -> dict:
        involved = {"apiVersion": "v1", "kind": "Pod", "namespace": pod["namespace"], "name": pod["name"]}
        if pod.get("uid"):
            involved["uid"] = pod["uid"]
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": pod["namespace"]},
            "involvedObject": involved,
            "reason": reason,
            "type": TYPES[reason],
            "message": message,
            "source": {"component": COMPONENT, "host": self.node_id},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node_id[:128],
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
        }

    def _failed(self, pod: dict, reason: str, error: Exception, now: float) -> None:
        if now - self._warned_at < WARN_EVERY:
            self._unwarned += 1
            log.debug("Event %s on pod %s/%s not posted: %s", reason, pod["namespace"], pod["name"], error)
            return
        more = f" ({self._unwarned} more not posted since the last warning)" if self._unwarned else ""
        log.warning("cannot post Event %s on pod %s/%s: %s%s", reason, pod["namespace"], pod["name"], error, more)
        self._warned_at, self._unwarned = now, 0


def _count(reason: str) -> None:
    with _posted_lock:
        POSTED[reason] = POSTED.get(reason, 0) + 1


class EventWatcher:
    """The thread that looks at the daemons and posts their pods' Events; :meth:`start` and
    :meth:`stop` (which joins it) bracket the plugin's serving."""

    def __init__(self, volumes: HasStateDir, cfg: PluginConfig, client: kube.KubeClient | None = None):
        self.volumes, self.interval, self.backup_lag = volumes, cfg.event_interval, cfg.event_backup_lag
        self.recorder = Recorder(client or getattr(volumes, "kube", None) or kube.KubeClient(cfg.kube_api), cfg.node_id)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._refusals: deque[tuple[dict, str]] = deque(maxlen=MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._started = time.time()
        self._restores: dict[str, tuple] = {}  # job -> the finished restore its pods were told of
        self._backup_bad: dict[str, tuple[float, str | None]] = {}  # job -> since when its GCS lane fails, last error

    def start(self) -> None:
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="csi-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def refused(self, context: dict[str, str], message: str) -> None:
        """A publish was refused: queue its Event (called in a kubelet call: never blocks or raises)."""
        pod = pod_of(context)
        if pod is not None:
            self._refusals.append((pod, f"tierfs refused the volume: {message}"))
            self._wake.set()

    def _run(self) -> None:
        next_look = time.monotonic()
        while not self._stop.is_set():
            looking = time.monotonic() >= next_look
            if looking:
                next_look = time.monotonic() + self.interval
            try:
                while self._refusals:
                    pod, message = self._refusals.popleft()
                    self.recorder.emit(pod, START_REFUSED, message)
                if looking:
                    self.check(poll(self.volumes, self._stop))
            except Exception:
                log.exception("posting the pods' Events failed")
            self._wake.wait(max(0.0, next_look - time.monotonic()))
            self._wake.clear()

    def check(self, states: list[DaemonState]) -> None:
        """Post what ``states`` (one look at every daemon) tell the pods."""
        now = time.time()
        for state in states:
            if state.status is None or self._stop.is_set():
                continue
            self._restored(state.daemon, state.status, now)
            self._backup(state.daemon, state.status, now)
            self._capacity(state.daemon, state.status)
        jobs = {s.job for s in states}
        for seen in (self._restores, self._backup_bad):
            for job in [j for j in seen if j not in jobs]:
                del seen[job]
        self.recorder.forget_old()

    def _tell(self, daemon: Daemon, reason: str, message: str) -> bool:
        """Every pod of the daemon; False if some post failed (so the next look tries again)."""
        return all([self.recorder.emit(pod, reason, message) for pod in daemon.pods])

    def _restored(self, daemon: Daemon, status: dict, now: float) -> None:
        restored = status.get("restored")
        if not isinstance(restored, dict) or restored.get("state") != "done":
            return
        key = (restored.get("step"), restored.get("at"))
        if self._restores.get(daemon.job) == key or not daemon.pods:
            return
        seconds = float(restored.get("seconds") or 0)
        if (restored.get("at") or now) + seconds < self._started - REPEAT_AFTER:
            self._restores[daemon.job] = key  # long before this plugin: the one before told the pods
            return
        message = (
            f"restored step {restored.get('step')} from {restored.get('tier')} in {seconds:.1f} s "
            f"({restored.get('bytes')} bytes)"
        )
        if self._tell(daemon, RESTORED, message):
            self._restores[daemon.job] = key

    def _backup(self, daemon: Daemon, status: dict, now: float) -> None:
        lane = status.get("gcs")
        if not isinstance(lane, dict):
            self._backup_bad.pop(daemon.job, None)
            return
        state, lag = lane.get("state"), float(lane.get("lag_s") or 0)
        if state in ("failing", "unavailable"):  # between retries the lane is "working", its error cleared
            since = self._backup_bad.get(daemon.job, (now, None))[0]
            self._backup_bad[daemon.job] = (since, lane.get("error"))
        elif state == "ok" or lag == 0:  # a step went up, or nothing waits for one
            self._backup_bad.pop(daemon.job, None)
        since, last_error = self._backup_bad.get(daemon.job, (now, None))
        failing_for = now - since
        overdue = lag - float(lane.get("backup_interval_s") or 0)  # a scheduled backup lags by design
        if max(failing_for, overdue) < self.backup_lag or not daemon.pods:
            return
        what = f"failing for {failing_for:.0f} s" if failing_for >= self.backup_lag else f"{lag:.0f} s behind"
        error = f"; last error: {last_error}" if last_error else ""
        self._tell(
            daemon,
            BACKUP_FAILING,
            f"the GCS backup of job {daemon.job} rank {daemon.rank} "
            f"({lane.get('url') or 'gcs'}) is {what} (lane {state}){error}",
        )

    def _capacity(self, daemon: Daemon, status: dict) -> None:
        ram = (status.get("tiers") or {}).get("ram") or {}
        used, capacity = ram.get("used") or 0, ram.get("capacity") or 0
        if capacity <= 0 or used < FULL * capacity or not daemon.pods:
            return
        self._tell(
            daemon,
            CAPACITY_NEARLY_FULL,
            f"the RAM tier of job {daemon.job} rank {daemon.rank} is {100 * used / capacity:.0f}% full "
            f"({used >> 20} MiB of {capacity >> 20} MiB): new checkpoints may not fit; keep fewer steps "
            "(keep-local) or give the volume more capacity",
        )
