"""The admin's ceilings: how much of a node a pod's volume attributes may ask for.

The ConfigMap's defaults are only defaults: a volume's attributes override them key by key.
Some attributes, though, spend the node rather than the job: ``capacity`` sizes a tmpfs
(and, on the daemon path, RAM charged to the plugin's container), every new job id keeps
a daemon and its RAM for ``--gc-after``, ``data-path: daemon`` puts every byte in the
plugin's container (and so does ``engine: pyfuse3``, which serves the daemon path only),
``wake-cpus`` keeps the node's idle CPUs awake, and ``listen`` binds a port on the node's
network as root. The tuning attributes that spend the node's time, memory or network
(``restore-wait``, ``prefetch``, ``chunk-size``...) have bounds of their own
(:mod:`tierfs.csi.bounds`). One pod asking for too much of any of them could starve every
other tenant of the node, so for each the ConfigMap also holds a ceiling that a volume may
stay under but never raise; a request over one is refused with one line naming the
ceiling and the value asked, before anything starts.

One more is about trust rather than size: a job with a GCS tier but no peer secret
restores manifests nobody signed, from a bucket every job's daemon on the node can write
(they share the node's GCS identity unless Workload Identity splits it); so such a volume
is refused unless the admin allows it (``allow-unauthenticated-gcs``).

Every ceiling has a default, so a cluster whose admin sets none is still bounded.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.core.errors import UserError
from tierfs.core.parse import format_size, parse_size
from tierfs.csi import bounds

WHERE = "ConfigMap tierfs-config"  # where the admin changes a ceiling, as messages name it
MEMINFO = Path("/proc/meminfo")
PRIVILEGED_PORTS = 1024  # ports below this are root's on Linux: system services listen there

# Ceiling key -> what it bounds, with its default (the keys beside the option defaults).
KEYS = {
    "max-capacity": "the most RAM one volume's `capacity` may ask, e.g. 64G (default: no bound but the share)",
    "max-capacity-share": "the share of the node's RAM (MemTotal) the capacities of all jobs on the node may "
    "add up to, e.g. 50% (default 50%)",
    "max-jobs-per-node": "job ids the plugin may hold on the node at once (default 8)",
    "max-jobs-per-namespace": "job ids one namespace may hold on the node at once (default 4)",
    "allow-pod-data-path": "may a volume choose `data-path`? (default false: the ConfigMap's `data-path`)",
    "allow-pod-wake-cpus": "may a volume choose `wake-cpus`? (default false: the ConfigMap's `wake-cpus`)",
    "allow-pod-engine": "may a volume choose `engine`? (default false: the ConfigMap's `engine`); `pyfuse3` "
    "is a choice of the daemon data path too, which also needs allow-pod-data-path",
    "allow-unauthenticated-gcs": "may a volume with a GCS tier have no peer secret, so that its manifests in "
    "GCS are not signed? (default false)",
    "listen-hosts": "addresses a volume's `listen` may name besides the plugin's --node-ip, comma-separated "
    "(default: none)",
    "listen-ports": "the ports a volume's `listen` may name, LOW-HIGH (default 7420-7499)",
    "allow-privileged-ports": "may `listen-ports` reach below 1024? (default false)",
    **bounds.KEYS,
}
SWITCHES = (
    "allow-pod-data-path",
    "allow-pod-wake-cpus",
    "allow-pod-engine",
    "allow-privileged-ports",
    "allow-unauthenticated-gcs",
)
_PORTS_RE = re.compile(r"^\s*(\d{1,5})\s*(?:-\s*(\d{1,5})\s*)?$")
_SHARE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class OverCeiling(Exception):
    """A volume asks for more than a ceiling allows; the message says which, and what to do."""


@dataclass(frozen=True)
class Ceilings:
    max_capacity: int | None = None
    max_capacity_share: float = 0.5
    max_jobs_per_node: int = 8
    max_jobs_per_namespace: int = 4
    allow_pod_data_path: bool = False
    allow_pod_wake_cpus: bool = False
    listen_hosts: frozenset[str] = frozenset()
    listen_ports: tuple[int, int] = (7420, 7499)
    allow_privileged_ports: bool = False
    allow_pod_engine: bool = False
    allow_unauthenticated_gcs: bool = False
    limits: dict[str, float] = field(default_factory=lambda: dict(bounds.DEFAULTS))  # bounds.KEYS -> value

    @classmethod
    def parse(cls, raw: dict[str, str], where: str) -> Ceilings:
        """The ceilings among a config file's keys (strings); a bad value is one line naming it."""
        v: dict = {}

        def bad(key: str, hint: str) -> UserError:
            return UserError(f"{where}: invalid {key} {raw[key][:40]!r}: {hint}")

        if "max-capacity" in raw:
            try:
                v["max_capacity"] = parse_size(raw["max-capacity"], "max-capacity")
            except UserError as e:
                raise UserError(f"{where}: {e}") from None
            if v["max_capacity"] < 1 << 20:
                raise bad("max-capacity", "use at least 1M")
        if "max-capacity-share" in raw:
            m = _SHARE_RE.match(raw["max-capacity-share"])
            if not m or not 0 < float(m.group(1)) <= 100:
                raise bad("max-capacity-share", "use a percentage of the node's RAM above 0 and at most 100, e.g. 50%")
            v["max_capacity_share"] = float(m.group(1)) / 100
        for key in ("max-jobs-per-node", "max-jobs-per-namespace"):
            if key in raw:
                text = raw[key].strip()
                if not text.isdigit() or not 1 <= int(text) <= 10000:
                    raise bad(key, "use a whole number from 1 to 10000")
                v[key.replace("-", "_")] = int(text)
        for key in SWITCHES:
            if key in raw:
                text = raw[key].strip().lower()
                if text not in _TRUE + _FALSE:
                    raise bad(key, "use true or false")
                v[key.replace("-", "_")] = text in _TRUE
        if "listen-hosts" in raw:
            hosts = [h.strip().strip("[]") for h in raw["listen-hosts"].split(",") if h.strip()]
            if any(not re.fullmatch(r"[A-Za-z0-9.:_-]{1,253}", h) for h in hosts):
                raise bad("listen-hosts", "use addresses or host names, comma-separated, e.g. 10.0.0.2,0.0.0.0")
            v["listen_hosts"] = frozenset(_host_key(h) for h in hosts)
        if "listen-ports" in raw:
            m = _PORTS_RE.match(raw["listen-ports"])
            low, high = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
            if not 0 < low <= high < 65536:
                raise bad("listen-ports", "use LOW-HIGH within 1-65535, e.g. 7420-7499")
            v["listen_ports"] = (low, high)
        v["limits"] = bounds.parse(raw, where)
        ceilings = cls(**v)
        if ceilings.listen_ports[0] < PRIVILEGED_PORTS and not ceilings.allow_privileged_ports:
            raise bad(
                "listen-ports",
                f"ports below {PRIVILEGED_PORTS} are the node's system services'; start the "
                "range at 1024 or above, or set allow-privileged-ports: \"true\"",
            )
        return ceilings

    # -- capacity ----------------------------------------------------------------------

    def default_capacity(self, mem_total: int) -> int:
        """A volume's capacity when neither it nor the ConfigMap names one.

        The node's share divided among as many jobs as the node may hold, so that jobs of
        the default size always fit side by side; never above ``max-capacity``.
        """
        size = int(mem_total * self.max_capacity_share) // self.max_jobs_per_node
        if self.max_capacity is not None:
            size = min(size, self.max_capacity)
        return max(size >> 20 << 20, 1 << 20)

    def check_capacity(self, capacity: int, what: str, mem_total: int, held: int) -> None:
        """``capacity`` bytes (``what``: who asked, as written) beside ``held`` bytes of the node's other jobs."""
        if self.max_capacity is not None and capacity > self.max_capacity:
            raise OverCeiling(
                f"{what} is over the node's ceiling max-capacity={_size(self.max_capacity)} "
                f"({WHERE}): ask for less or raise the ceiling"
            )
        share = int(mem_total * self.max_capacity_share)
        if capacity + held > share:
            others = f", of which the node's other jobs hold {format_size(held)}" if held else ""
            raise OverCeiling(
                f"{what} is over the node's ceiling max-capacity-share={self.max_capacity_share * 100:g}% of its "
                f"{format_size(mem_total)} RAM ({format_size(share)}{others}) ({WHERE}): ask for less, wait for "
                "idle jobs to be collected, or raise the ceiling"
            )

    # -- what pods may choose ----------------------------------------------------------

    def check_choice(self, key: str, asked: str, admins: str) -> None:
        """``data-path``, ``wake-cpus`` and ``engine``: the admin's value unless pods may choose."""
        allowed = {
            "data-path": self.allow_pod_data_path,
            "wake-cpus": self.allow_pod_wake_cpus,
            "engine": self.allow_pod_engine,
        }[key]
        if allowed or _switch(key, asked) == _switch(key, admins):
            return
        raise OverCeiling(
            f"volume attribute {key!r} {asked[:40]!r} is over the node's ceiling allow-pod-{key}=false ({WHERE}: "
            f"pods take the admin's {key}={admins}): remove the attribute, or ask the admin to allow it"
        )

    def check_engine(self, asked: str, admins: str, admins_data_path: str) -> None:
        """``engine``: the admin's unless pods may choose; and since pyfuse3 serves the daemon
        data path only, choosing it chooses that path too, which allow-pod-data-path governs."""
        self.check_choice("engine", asked, admins)
        if (
            _switch("engine", asked) != "pyfuse3"
            or _switch("engine", admins) == "pyfuse3"
            or self.allow_pod_data_path
            or _switch("data-path", admins_data_path) == "daemon"
        ):
            return
        raise OverCeiling(
            f"volume attribute 'engine' {asked[:40]!r} serves every byte through the daemon (data-path daemon), "
            f"over the node's ceiling allow-pod-data-path=false ({WHERE}: pods take the admin's "
            f"data-path={admins_data_path}): remove the attribute, or ask the admin to allow it"
        )

    def check_attributes(self, options: dict[str, str], chosen: set[str]) -> None:
        """The tuning attributes a volume set (``chosen``) against the admin's bounds, in place of
        the daemon's defaults where those are past a bound (:mod:`tierfs.csi.bounds`)."""
        try:
            bounds.check(self.limits, options, chosen)
        except bounds.OutOfBounds as e:
            raise OverCeiling(str(e)) from None
        bounds.fill(self.limits, options)

    def check_gcs_secret(self, job: str, gcs: str | None, secret: str | None) -> None:
        """A GCS tier without the job's secret restores manifests nobody signed: refused unless allowed."""
        if not gcs or secret or self.allow_unauthenticated_gcs:
            return
        raise OverCeiling(
            f"job {job} backs up to GCS ({gcs[:120]}) but its volume has no peer secret, so its manifests there "
            f"would be unsigned and any writer of the bucket could choose what it restores: reference a Secret with "
            f"key 'secret' in the volume's nodePublishSecretRef, or ask the admin to set "
            f"allow-unauthenticated-gcs: \"true\" ({WHERE})"
        )

    def check_listen(self, host: str, port: int, node_ip: str | None) -> None:
        """The peer service binds as root on the node's network: only the admin's addresses and ports."""
        low, high = self.listen_ports
        if not low <= port <= high:
            raise OverCeiling(
                f"volume attribute 'listen' port {port} is outside the node's ceiling listen-ports={low}-{high} "
                f"({WHERE}): pick a port in the range, or ask the admin to widen it"
            )
        allowed = self.listen_hosts | ({_host_key(node_ip)} if node_ip else set())
        if _host_key(host) not in allowed:
            named = ", ".join(sorted(allowed)) or "none"
            raise OverCeiling(
                f"volume attribute 'listen' address {host[:80]!r} is not one of the node's listen addresses "
                f"({named}; --node-ip and the ceiling listen-hosts, {WHERE}): use ':{port}' for the node's "
                "address, or ask the admin to add it to listen-hosts"
            )

    # -- jobs --------------------------------------------------------------------------

    def check_jobs(self, job: str, namespace: str, node_id: str, held: Mapping[str, str | None]) -> None:
        """``held``: job -> namespace of every job the plugin holds on the node, ``job`` not among them
        (None where an older plugin's record names none)."""
        if len(held) >= self.max_jobs_per_node:
            raise OverCeiling(
                f"job {job} would make {len(held) + 1} jobs on node {node_id}, over the node's ceiling "
                f"max-jobs-per-node={self.max_jobs_per_node} ({WHERE}): reuse a job id, remove an idle job "
                "(`tierfs csi --gc JOB`), or raise the ceiling"
            )
        mine = sum(1 for ns in held.values() if ns == namespace)
        if mine >= self.max_jobs_per_namespace:
            raise OverCeiling(
                f"job {job} would make {mine + 1} jobs of namespace {namespace} on node {node_id}, over the node's "
                f"ceiling max-jobs-per-namespace={self.max_jobs_per_namespace} ({WHERE}): reuse a job id, wait "
                "for idle jobs to be collected (--gc-after), or raise the ceiling"
            )


def check_admin_defaults(defaults: dict[str, str], ceilings: Ceilings, where: str, mem_total: int) -> None:
    """The ConfigMap's own defaults must be ones a volume could ask for: its capacity, its tuning."""
    try:
        bounds.check(ceilings.limits, defaults)
    except bounds.OutOfBounds as e:
        raise UserError(e.for_admin(where)) from None
    if "capacity" not in defaults:
        return
    try:
        capacity = parse_size(defaults["capacity"], "capacity")
        ceilings.check_capacity(capacity, f"the default capacity {defaults['capacity']}", mem_total, 0)
    except (UserError, OverCeiling) as e:
        raise UserError(f"{where}: {e}") from None


def mem_total(path: Path = MEMINFO) -> int:
    """The node's RAM in bytes (a container sees the host's /proc/meminfo)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise UserError(f"cannot read the node's RAM (MemTotal) from {path}: the capacity ceilings need it")


def _size(n: int) -> str:
    """A size as an admin writes it (64G) when it is whole in some unit, else rounded (1.5 GiB)."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20)):
        if n and not n % (1 << shift):
            return f"{n >> shift}{unit}"
    return format_size(n)


def _host_key(host: str) -> str:
    """One spelling per address: ``::ffff:10.0.0.1`` and ``[::1]`` compare as the kernel would bind them."""
    host = host.strip().strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _switch(key: str, value: str) -> str:
    """Compare on/off and data paths the way the daemon reads them."""
    text = value.strip().lower()
    if key == "wake-cpus":
        return "on" if text in _TRUE else "off" if text in _FALSE else text
    return text
