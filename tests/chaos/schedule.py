"""A seeded schedule of faults against a job of real daemons, and the invariants checked after each.

The job: N daemons (one rank each) on 127.0.0.2, ..., a GCS emulator of their own, and a
writer that commits one step on every rank after another, as a training job's
checkpoints would. Between steps, the schedule draws a fault: a kill -9 of one, several or
all daemons 0-500 ms after a commit, a replica confirmation or a backup (the RAM of some
wiped), a kill before every rank committed, a node's network cut (its address dropped
both ways) or GCS frozen for a while. Killed nodes come back, together if several.

The harness keeps what it has *seen confirmed* of every (rank, step): the rank's own RAM
from its commit, each peer its replica was confirmed on, GCS once backed up; wipes remove
what they destroy. After every restart it checks, for each node that came back:

- its step is at least the newest step confirmed for every rank on tiers that still hold
  it (the newest step always comes back), and at most the newest step every rank
  committed (nothing incomplete is restored);
- when those bounds meet, exactly that step;
- its files of that step are byte-identical to what the writer wrote;
- after a whole-job restart, every rank runs from the same step.

With erasure-coded groups (``--erasure D+P`` instead of replicas) a copy confirmed on a peer
is the group's: once a node reports a step encoded in every member, each rank's step counts
as held by the group while D members other than that rank keep their parts (a wipe takes a
member's parts; a member that comes back holds none of the older steps' parity). A start the
product refuses because more of a group was lost than its parity covers is checked to be
one the harness also sees no copy of, then made with ``--start-fresh``.

A violation names the seed and the fault; the same seed replays the same schedule.
"""

from __future__ import annotations

import hashlib
import random
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tierfs_testing.cluster import LocalCluster
from tierfs_testing.gcs_emulator import GcsEmulator

from tests.helpers import write_orbax_step
from tierfs.commands.status import fetch

KILL_DELAY = 0.5  # a kill comes 0-KILL_DELAY s after the event that triggers it
CONFIRM_WAIT = 15.0  # the longest a trigger (replica confirmed, backed up) is waited for


class Violation(AssertionError):
    pass


def files_of(rank: int, step: int, seed: int) -> dict[str, bytes]:
    tag = f"{seed}-{rank}-{step}".encode()
    return {"params": hashlib.shake_256(tag).digest(192 << 10), "meta/opt": tag * 50}


class NetCut:
    """Cuts nodes off the network by dropping every packet from or to their address (nftables)."""

    def __init__(self, name: str):
        self.table = name
        self.cut: set[str] = set()
        self._nft(f"add table inet {self.table}")
        self._nft(f"add chain inet {self.table} out {{ type filter hook output priority 0 ; }}")

    def _nft(self, command: str) -> None:
        subprocess.run(["nft", command], check=True, capture_output=True, text=True)

    def apply(self, hosts: set[str]) -> None:
        self._nft(f"flush chain inet {self.table} out")
        for host in sorted(hosts):
            self._nft(f"add rule inet {self.table} out ip saddr {host} drop")
            self._nft(f"add rule inet {self.table} out ip daddr {host} drop")
        self.cut = set(hosts)

    def close(self) -> None:
        subprocess.run(["nft", f"delete table inet {self.table}"], capture_output=True)


@dataclass
class Job:
    """The cluster, the writer, and what the harness has seen confirmed."""

    cluster: LocalCluster
    gcs: GcsEmulator
    net: NetCut
    seed: int
    rng: random.Random
    step: int = 0
    committed: dict[int, set[int]] = field(default_factory=dict)  # rank -> steps it committed
    places: dict[tuple[int, int], set[str]] = field(default_factory=dict)  # (rank, step) -> where confirmed
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    log: list[str] = field(default_factory=list)
    erasure: tuple[int, int] | None = None  # (D, P) of --erasure, or None: --replicas
    parts: dict[int, set[int]] = field(default_factory=dict)  # step -> members seen holding its parts (erasure)
    wiped_at: dict[int, float] = field(default_factory=dict)  # node -> when its RAM was last wiped

    @property
    def n(self) -> int:
        return len(self.cluster.nodes)

    def node_of(self, address: str) -> int:
        return next(n.index for n in self.cluster.nodes if n.address == address)

    # -- the writer --------------------------------------------------------------------

    def commit(self, step: int, ranks) -> None:
        for r in ranks:
            write_orbax_step(self.cluster.nodes[r].mountpoint, step, files_of(r, step, self.seed))
            self.committed.setdefault(r, set()).add(step)
            self.places.setdefault((r, step), set()).add(f"ram {r}")

    # -- what is confirmed where -----------------------------------------------------------

    def status(self, i: int) -> dict:
        return fetch(self.cluster.nodes[i].mountpoint)

    def observe(self, nodes=None) -> None:
        """Record every copy the live nodes report confirmed: replicas on peers, backups in GCS."""
        for i in range(self.n) if nodes is None else nodes:
            if self.cluster.nodes[i].pid is None:
                continue
            st = self.status(i)
            for s in st["steps"]:
                places = self.places.setdefault((i, s["step"]), {f"ram {i}"})
                replicas = s.get("replicas") or {}
                if replicas.get("version") == s["version"] and self.erasure is None:
                    # A confirmation from before the peer's last wipe is news of a copy known lost:
                    # a node rechecks only its newest step, so its status may keep it for long.
                    peers = [self.node_of(a) for a in replicas.get("peers", ())]
                    places.update(f"peer {j}" for j in peers if replicas.get("at", 0) > self.wiped_at.get(j, 0))
                if s["backed_up"]:
                    places.add("gcs")
            if self.erasure is not None:
                for step, held in st["peers"]["erasure"]["steps"].items():
                    if held["survives"] == self.erasure[1]:  # every member holds its parts of it now
                        self.parts[int(step)] = set(range(self.n))

    def held(self, rank: int, step: int) -> bool:
        """Whether the harness saw a copy of (rank, step) confirmed that it has not seen lost since."""
        if self.places.get((rank, step)):
            return True
        return self.erasure is not None and len(self.parts.get(step, set()) - {rank}) >= self.erasure[0]

    def wait_confirmed(self, i: int, step: int, what: str) -> bool:
        """Wait until node i's ``step`` is on a peer (``replica``) or in GCS (``backup``); False if it never was."""
        deadline = time.monotonic() + CONFIRM_WAIT
        while time.monotonic() < deadline:
            for s in self.status(i)["steps"]:
                if s["step"] != step:
                    continue
                replicas = s.get("replicas") or {}
                if what == "replica" and replicas.get("version") == s["version"] and replicas.get("peers"):
                    return True
                if what == "backup" and s["backed_up"]:
                    return True
            time.sleep(0.02)
        return False

    def lose(self, i: int, wiped: bool) -> None:
        """Node i is killed; with ``wiped``, its RAM (own steps and the replicas it kept) is gone."""
        self.cluster.kill(i)
        if wiped:
            self.cluster.wipe(i)
            self.wiped_at[i] = time.time()
            for places in self.places.values():
                places.discard(f"ram {i}")
                places.discard(f"peer {i}")
            for members in self.parts.values():
                members.discard(i)

    # -- the bounds a restore must meet --------------------------------------------------------

    # A step is complete when every *writing* rank (one with a manifest anywhere) holds it:
    # early steps of a job where some ranks have not written yet count. The harness knows
    # which ranks wrote, not whether an unconfirmed copy of a wiped one survived, so:

    def newest_confirmed(self) -> int | None:
        """The newest step each rank that ever wrote has somewhere the harness saw confirmed and not lost.

        None when a rank that wrote has no confirmed copy left: whether it still counts
        as writing then depends on copies nobody confirmed, and nothing is claimed.
        """
        held = {rank: {s for s in steps if self.held(rank, s)} for rank, steps in self.committed.items()}
        if not held or not all(held.values()):
            return None
        return max(set.intersection(*held.values()), default=None)

    def newest_committed(self) -> int | None:
        """The newest step committed by every rank that still has a confirmed copy of anything."""
        ranks = [r for r, steps in self.committed.items() if any(self.held(r, s) for s in steps)]
        if not ranks:
            return None
        return max(set.intersection(*(self.committed[r] for r in ranks)), default=None)

    def check_restart(self, nodes: list[int], fault: str) -> None:
        self.restarts += 1
        low, high = self.newest_confirmed(), self.newest_committed()
        chosen = {}
        for i in nodes:
            st = self.status(i)
            step = chosen[i] = st["cluster"]["restore_step"]
            where = f"seed {self.seed}, fault {sum(self.faults.values())} ({fault}), node {i}"
            if low is not None and (step is None or step < low):
                raise Violation(
                    f"{where}: restored step {step}, but step {low} is held for every rank ({self.summary(low)})"
                )
            if step is not None and high is not None and step > high:
                raise Violation(f"{where}: restored step {step}, newer than any step every rank committed ({high})")
            if low == high and step != low:
                raise Violation(f"{where}: restored step {step}, expected {low}")
            if step is not None and step in self.committed.get(i, ()):  # else the rank wrote nothing in it
                if self.check_files(i, step, where):
                    self.places.setdefault((i, step), set()).add(f"ram {i}")
                for s in [s for s in self.committed.get(i, ()) if s > step]:
                    self.places.get((i, s), set()).discard(f"ram {i}")  # set aside: not complete on every rank
        # Ranks with files in the step they chose must agree; a rank with none restored nothing.
        with_files = {i: s for i, s in chosen.items() if s in self.committed.get(i, ())}
        if len(nodes) == self.n and len(set(with_files.values())) > 1:
            raise Violation(f"seed {self.seed}: after a whole-job restart the ranks run from different steps: {chosen}")
        self.log.append(f"{fault}: restored {chosen} (bounds {low}..{high})")

    def check_files(self, i: int, step: int, where: str) -> bool:
        """Whether node i presents its files of ``step``, byte-identical to what the writer wrote.

        A rank whose every copy of the step was lost before any was confirmed (killed and
        wiped right after its commit) left nothing a restore could know of: it counts as
        not having written, so it may present no file of that step, but never some of them
        or other bytes.
        """
        base = self.cluster.nodes[i].mountpoint / "ckpt" / str(step)
        found = {}
        for name in files_of(i, step, self.seed):
            try:
                found[name] = (base / name).read_bytes()
            except FileNotFoundError:
                pass
        if not found and not self.held(i, step):
            return False
        for name, data in files_of(i, step, self.seed).items():
            if found.get(name) != data:
                state = "missing" if name not in found else "different"
                raise Violation(
                    f"{where}: {base / name} is {state}, not what rank {i} wrote at step {step} "
                    f"(held: {sorted(self.places.get((i, step), ()))})"
                )
        return True

    def summary(self, step: int) -> str:
        return "; ".join(f"rank {r}: {sorted(self.places.get((r, step), ()))}" for r in range(self.n))


def run_schedule(job: Job, faults: int) -> None:
    """Commit steps and inject ``faults`` faults, drawn from the job's seed; check after every restart."""
    kinds = ["kill one", "kill one", "kill several", "kill all", "kill mid-commit", "net cut", "gcs outage"]
    while sum(job.faults.values()) < faults:
        job.step += 1
        kind = job.rng.choice(kinds)
        job.faults[kind] += 1
        if kind == "kill mid-commit":
            _kill_mid_commit(job)
        elif kind.startswith("kill"):
            _kill_after(job, kind)
        elif kind == "net cut":
            _net_cut(job)
        else:
            _gcs_outage(job)


def _victims(job: Job, kind: str) -> list[int]:
    if kind == "kill one":
        return [job.rng.randrange(job.n)]
    if kind == "kill several":
        return sorted(job.rng.sample(range(job.n), job.rng.randint(2, job.n - 1)))
    return list(range(job.n))


def _kill_after(job: Job, kind: str) -> None:
    victims = _victims(job, kind)
    job.commit(job.step, range(job.n))
    trigger = job.rng.choice(["commit", "replica", "backup"])
    if trigger != "commit":
        job.wait_confirmed(victims[0], job.step, trigger)
    time.sleep(job.rng.uniform(0.0, KILL_DELAY))
    _restart(job, victims, f"{kind} {victims} {trigger}+delay at step {job.step}")


def _kill_mid_commit(job: Job) -> None:
    """Some ranks commit the step; the victim dies before it does, or right after its own commit."""
    order = job.rng.sample(range(job.n), job.n)
    done = job.rng.randrange(job.n)
    job.commit(job.step, order[: done + 1])
    victim = order[job.rng.randrange(done + 1)] if job.rng.random() < 0.5 else order[-1]
    _restart(job, [victim], f"kill mid-commit {victim} after {done + 1} of {job.n} ranks committed step {job.step}")


def _restart(job: Job, victims: list[int], what: str) -> None:
    job.observe()
    wiped = {i: job.rng.random() < 0.5 for i in victims}
    for i in victims:
        job.lose(i, wiped[i])
    what += f", wiped {[i for i in victims if wiped[i]]}"
    try:
        if len(victims) == 1:
            job.cluster.start(victims[0])
        else:
            job.cluster.start_all()
    except AssertionError as e:
        if job.erasure is None:
            raise
        _start_fresh_where_refused(job, str(e), what)
    job.check_restart(victims, what)
    job.observe(victims)


def _start_fresh_where_refused(job: Job, failure: str, what: str) -> None:
    """Starts refused because more of a group was lost than its parity covers: each must be of a
    (rank, step) the harness sees no copy of either; then started with ``--start-fresh``."""
    refused = {(int(r), int(s)) for r, s in re.findall(r"rank (\d+)'s step (\d+) was erasure-coded", failure)}
    failed = {n.index for n in job.cluster.nodes if n.pid is None}
    if not refused or failed != {rank for rank, _ in refused}:
        raise Violation(f"seed {job.seed} ({what}): a start failed: {failure}")
    for rank, step in sorted(refused):
        if job.held(rank, step):
            raise Violation(
                f"seed {job.seed} ({what}): rank {rank} refused to start without step {step}, "
                f"which the harness saw held ({job.summary(step)}, members with parts {job.parts.get(step)})"
            )
    job.log.append(f"{what}: refused for {sorted(refused)}, started fresh")
    for node in (job.cluster.nodes[rank] for rank in failed):
        node.environ["TIERFS_START_FRESH"] = "1"
    try:
        job.cluster.start_all()
    finally:
        for node in (job.cluster.nodes[rank] for rank in failed):
            del node.environ["TIERFS_START_FRESH"]


def _net_cut(job: Job) -> None:
    node = job.rng.randrange(job.n)
    job.net.apply({job.cluster.nodes[node].host})
    try:
        job.commit(job.step, range(job.n))
        time.sleep(job.rng.uniform(0.2, 1.0))
    finally:
        job.net.apply(set())
    job.log.append(f"net cut of node {node} during step {job.step}")


def _gcs_outage(job: Job) -> None:
    job.gcs.pause()
    try:
        job.commit(job.step, range(job.n))
        time.sleep(job.rng.uniform(0.2, 1.0))
    finally:
        job.gcs.resume()
    job.log.append(f"GCS frozen during step {job.step}")


def make_job(base: Path, nodes: int, seed: int, erasure: str | None = None) -> tuple[Job, list]:
    """The job and the things to close afterwards (in order); ``erasure``: ``--erasure`` instead of ``--replicas 1``."""
    gcs = GcsEmulator(base / "gcs")
    closers: list = [gcs.stop]
    gcs.start()
    gcs.make_bucket("chaos")
    cluster = LocalCluster(
        base / "nodes",
        nodes,
        "chaos",
        **({"erasure": erasure} if erasure else {"replicas": 1}),
        capacity="256M",
        chunk_size="1M",
        gcs="gs://chaos/ckpt",
        restore_wait="5s",
        survey_interval="2s",
    )
    closers.insert(0, cluster.close)
    net = NetCut(f"tierfs_chaos_{seed % 100000}")
    closers.insert(0, net.close)
    shape = tuple(int(x) for x in erasure.split("+")) if erasure else None
    return Job(cluster, gcs, net, seed, random.Random(seed), erasure=shape), closers  # type: ignore[arg-type]
