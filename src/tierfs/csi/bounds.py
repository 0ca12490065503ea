"""The admin's bounds on a volume's tuning attributes: what one job's daemon may spend of the node.

Every volume attribute was weighed for what it costs beyond the job itself:

- ``restore-wait`` holds the pod's start (and a plugin thread) while peers stay silent;
- ``prefetch`` and ``chunk-size`` set a restore's connections and the bytes in flight in
  the daemon's memory, which the plugin's container pays (prefetch x chunk-size);
- ``replicas`` multiplies what every commit sends over the node's network, and so does the
  P of ``erasure`` (D+P: each commit sends P shards' worth of data parts);
- ``keep`` multiplies what stays on the node's ``--disk`` (and in the cluster's bucket);
- ``peers`` is how many addresses the daemon surveys and connects to: a long list of
  someone else's addresses would make it a scanner run from the node;
- ``survey-interval`` and ``backup-interval`` set how often the daemon talks to every
  peer, and uploads, over the node's network;
- ``log-level: debug`` writes every request to the node's disk, beside every job's log.

Each gets a bound here (a ceiling ``max-*``, or a floor ``min-*``), with a default close
to the daemon's own defaults, so a cluster whose admin sets none is still bounded. The
others cost only the job: ``job``, ``rank``, ``nodes``, ``coordinator``, ``topology``,
``data-parallel``, ``commit-rule``, ``gc-grace``, ``keep-local`` (inside the job's
``capacity``), ``peer-tls``, ``restore-step``, ``mtbf`` and the job's GCS identity
(``gcs-token-audience``, ``gcs-service-account``, ``gcs-sts-url``, ``gcs-iam-url``); the
remaining ones are bounded in :mod:`tierfs.csi.ceilings` (``capacity``, ``data-path``,
``engine``, ``wake-cpus``, ``listen``) and by the plugin's flags (``gcs``). ``keep-every``
and ``keep-for`` need no bound of their own: on the node's ``--disk`` a rank keeps at most
``keep`` milestones (:class:`tierfs.store.replicas.ReplicaStore`), so ``max-keep`` bounds
them; the bucket is the job's.

When neither the volume nor the ConfigMap sets a bounded attribute and the daemon's own
default is past the admin's bound, the volume gets the bound itself: the admin's bound
holds for every job, not only for those that ask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tierfs.config import LOG_LEVELS, Config
from tierfs.core import chunks, stripes
from tierfs.core.errors import UserError
from tierfs.core.parse import parse_duration, parse_size
from tierfs.discovery.spec import parse_peers

WHERE = "ConfigMap tierfs-config"


def _count(text: str, what: str) -> float:
    text = str(text).strip()
    if not text.isdigit():
        raise UserError(f"invalid {what} {text[:40]!r}: expected a whole number")
    return float(text)


def _level(text: str, what: str) -> float:
    text = str(text).strip().lower()
    if text not in LOG_LEVELS:
        raise UserError(f"invalid {what} {text[:40]!r}: use one of {', '.join(LOG_LEVELS)}")
    return float(LOG_LEVELS.index(text))


def _addresses(text: str, what: str) -> float:
    """The fixed addresses a ``peers`` value expands to (``auto`` is counted once the plugin expands it)."""
    if str(text).strip().lower() == "auto":
        raise UserError("peers: auto is expanded later")
    return float(len(parse_peers(text, what).addresses))


def _parity(text: str, what: str) -> float:
    """The P of an ``erasure`` value: whole shards each commit sends."""
    try:
        return float(stripes.parse_shape(text).p)
    except stripes.BadGroup as e:
        raise UserError(f"invalid {what}: {e}") from None


def _duration(text: str, what: str) -> float:
    seconds = parse_duration(text, what)
    if seconds < 0:
        raise UserError(f"invalid {what} {text!r}: a duration is not negative")
    return seconds


def _show_duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and not seconds % size:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _show_size(n: float) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n and not n % (1 << shift):
            return f"{int(n) >> shift}{unit}"
    return str(int(n))


@dataclass(frozen=True)
class Bound:
    key: str  # the ConfigMap key
    attribute: str  # the volume attribute it bounds
    default: str  # the bound when the admin sets none, as an admin writes it
    upper: bool  # a ceiling (the attribute at most this) or a floor (at least this)
    read: Callable[[str, str], float]  # a value as written -> a number to compare; UserError if malformed
    show: Callable[[float], str]  # a number -> as an admin or a pod author writes it
    least: float  # the smallest bound that leaves a valid daemon configuration
    spends: str  # what it keeps from the node, as KEYS and the docs say it
    measure: Callable[[str, str], float] | None = None  # the attribute's number, when not ``read``
    unit: str = ""  # what ``measure`` counts, in a refusal: " addresses"

    def value_of(self, text: str) -> float:
        """The attribute's value as a number; UserError when the daemon would refuse it anyway."""
        return (self.measure or self.read)(text, f"volume attribute {self.attribute}")

    def daemons_default(self) -> str:
        """What the daemon runs with when nobody sets the attribute."""
        value = getattr(Config, self.attribute.replace("-", "_"), None)
        if value is None or isinstance(value, tuple):  # no default worth bounding (peers: none)
            return ""
        return _show_duration(value) if self.read is _duration else str(value)


def _int(n: float) -> str:
    return str(int(n))


BOUNDS = (
    Bound(
        "max-restore-wait",
        "restore-wait",
        "10m",
        True,
        _duration,
        _show_duration,
        0,
        "the longest `restore-wait` a volume may ask: the pod's start and a plugin thread wait that long for "
        "silent peers (default 10m)",
    ),
    Bound(
        "max-prefetch",
        "prefetch",
        "32",
        True,
        _count,
        _int,
        0,
        "the most chunks a volume's restore may fetch at once (`prefetch`; default 32)",
    ),
    Bound(
        "max-chunk-size",
        "chunk-size",
        "16M",
        True,
        lambda t, w: float(parse_size(t, w)),
        _show_size,
        chunks.MIN_CHUNK_SIZE,
        "the largest `chunk-size` a volume may ask: prefetch x chunk-size bytes sit in the daemon's memory "
        "(default 16M)",
    ),
    Bound(
        "max-replicas",
        "replicas",
        "3",
        True,
        _count,
        _int,
        1,
        "the most peers a volume's `replicas` may send every commit to (default 3)",
    ),
    Bound(
        "max-keep",
        "keep",
        "10",
        True,
        _count,
        _int,
        1,
        "the most committed steps a volume's `keep` may hold on the node's --disk and in GCS (default 10)",
    ),
    Bound(
        "max-peers",
        "peers",
        "4096",
        True,
        _count,
        _int,
        1,
        "the most addresses a volume's `peers` may expand to, each surveyed and connected to (default 4096)",
        measure=_addresses,
        unit=" addresses",
    ),
    Bound(
        "max-erasure-parity",
        "erasure",
        "3",
        True,
        _count,
        _int,
        1,
        "the most parity parts P a volume's `erasure` (D+P) may ask: each commit sends P shards' worth over the "
        "node's network (default 3)",
        measure=_parity,
        unit=" parity parts",
    ),
    Bound(
        "min-survey-interval",
        "survey-interval",
        "10s",
        False,
        _duration,
        _show_duration,
        0,
        "the shortest `survey-interval` a volume may ask: each survey asks every peer (default 10s)",
    ),
    Bound(
        "min-backup-interval",
        "backup-interval",
        "0s",
        False,
        _duration,
        _show_duration,
        0,
        "the shortest `backup-interval` a volume may ask (default 0s: a backup at every commit, the daemon's default)",
    ),
    Bound(
        "min-log-level",
        "log-level",
        "info",
        False,
        _level,
        lambda n: LOG_LEVELS[int(n)],
        0,
        "the most verbose `log-level` a volume may ask: debug logs every request to the node's disk (default info)",
    ),
)
BY_KEY = {b.key: b for b in BOUNDS}
KEYS = {b.key: b.spends for b in BOUNDS}
DEFAULTS = {b.key: b.read(b.default, b.key) for b in BOUNDS}


class OutOfBounds(Exception):
    """A volume asks past one of the bounds; the message says which, and what to do."""

    def __init__(self, message: str, bound: Bound, asked: str, limit: float):
        super().__init__(message)
        self.bound, self.asked, self.limit = bound, asked, limit

    def for_admin(self, where: str) -> str:
        """The same refusal of the ConfigMap's own default, which the admin alone can fix."""
        b = self.bound
        side = "over the ceiling" if b.upper else "under the floor"
        return (
            f"{where}: the default {b.attribute} {self.asked[:40]!r} is {side} {b.key}={b.show(self.limit)}: "
            "change the default or the bound"
        )


def parse(raw: dict[str, str], where: str) -> dict[str, float]:
    """The bounds among a config file's keys, the defaults for the others; a bad one is one line."""
    values = dict(DEFAULTS)
    for key in (k for k in raw if k in BY_KEY):
        bound = BY_KEY[key]
        try:
            value = bound.read(raw[key], key)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if value < bound.least:
            raise UserError(f"{where}: invalid {key} {raw[key][:40]!r}: use at least {bound.show(bound.least)}")
        values[key] = value
    return values


def check(bounds: dict[str, float], options: dict[str, str], chosen: set[str] | None = None) -> None:
    """Every bounded attribute in ``options`` (only those in ``chosen``, when given) is within its bound."""
    for bound in BOUNDS:
        if bound.attribute not in options or (chosen is not None and bound.attribute not in chosen):
            continue
        try:
            value = bound.value_of(options[bound.attribute])
        except UserError:
            continue  # malformed: the daemon's own check says so, in its words
        limit = bounds[bound.key]
        if (value > limit) if bound.upper else (value < limit):
            raise OutOfBounds(
                _refusal(bound, options[bound.attribute], value, limit), bound, options[bound.attribute], limit
            )


def fill(bounds: dict[str, float], options: dict[str, str]) -> None:
    """Unset attributes whose daemon default is past the admin's bound get the bound, in place."""
    for bound in BOUNDS:
        default = bound.daemons_default()
        if bound.attribute in options or not default:
            continue
        value, limit = bound.read(default, bound.attribute), bounds[bound.key]
        if (value > limit) if bound.upper else (value < limit):
            options[bound.attribute] = bound.show(limit)


def _refusal(bound: Bound, asked: str, value: float, limit: float) -> str:
    what = f"({value:.0f}{bound.unit})" if bound.measure else repr(asked[:40])
    side, verb = ("over the node's ceiling", "at most") if bound.upper else ("under the node's floor", "at least")
    change = "raise the ceiling" if bound.upper else "lower the floor"
    return (
        f"volume attribute {bound.attribute!r} {what} is {side} {bound.key}={bound.show(limit)} ({WHERE}): "
        f"ask for {verb} {bound.show(limit)}{bound.unit}, or ask the admin to {change}"
    )
