"""The twins row of ``scripts/bench_gcs.py``: what a backup of D data-parallel twins costs in GCS.

Kept apart from the single-volume rows because it runs a different rig: D real daemons
(:class:`tierfs_testing.cluster.LocalCluster`, ``--data-parallel D``, nodes = D, every node
a twin of the others) whose GCS traffic goes through a byte-counting proxy
(:mod:`tierfs_testing.gcs_proxy`) in front of the emulator, and two builds of tierfs side
by side: this checkout and, as the baseline, the code before the twins shared the upload,
run from another checkout (``--reference DIR``: its ``src`` first on the daemons'
PYTHONPATH). Both sides run in the same process and rounds, so the comparison does not
depend on how fast this VM is that day.

Per round, per D and per side (the side that goes first alternates per round and per D):
a fresh bucket and cluster; the step's bytes (random, one set for every twin, as twins
hold the same data) copied into each node's ``ckpt/1.orbax-checkpoint-tmp`` (untimed);
a warm-up of the same size on tmpfs, deleted right away; the proxy's counters reset; every
node's directory renamed (t0: the first rename); each node's ``tierfs status`` polled until
it shows the step backed up. Then the bytes up and down and the requests the proxy saw,
every rank's manifest checked in the bucket, and the cluster and bucket deleted. The
table shows medians of the rounds. D values larger than the machine can run as daemons
(``--sim-twins``) come from the scale simulation (:mod:`tierfs_testing.backups`) with the
same per-rank size and every twin committing at once, labelled as simulated (their
seconds are the model's, not this machine's).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchlib import BenchError, aligned, drop_bucket, progress, warm_up  # (scripts/ is on sys.path)
from tierfs_testing.cluster import LocalCluster
from tierfs_testing.gcs_proxy import GcsProxy

import tierfs
from tierfs.commands.status import fetch as fetch_status

MiB = 1 << 20
SIDES = ("tierfs", "baseline")
STEP = 1
JOB = "twins"
THIS_SRC = Path(tierfs.__file__).resolve().parents[1]


def cluster_of(base: Path, nodes: int, src: Path, gcs_url: str, **options) -> LocalCluster:
    """A cluster whose daemons run the tierfs under ``src`` and reach GCS at ``gcs_url`` (the proxy)."""
    cluster = LocalCluster(base, nodes, job=JOB, **options)
    for node in cluster.nodes:
        node.environ = {"PYTHONPATH": str(src), "STORAGE_EMULATOR_HOST": gcs_url}
    return cluster


def reference_src(directory: str) -> Path:
    """The ``src`` of a checkout given to ``--reference``; an error if it holds no tierfs."""
    src = Path(directory).resolve() / "src"
    if not (src / "tierfs" / "__init__.py").is_file():
        raise BenchError(f"--reference {directory}: no src/tierfs there (give a checkout of the code before)")
    return src


def run_side(side: str, d: int, args, data: bytes, emu, proxy: GcsProxy, client, tmp: Path) -> dict:
    """One backup of one step by ``d`` twins; what it cost and how long until every rank was backed up."""
    bucket = f"twins-{side}-{d}-{os.urandom(4).hex()}"
    emu.make_bucket(bucket)
    src = THIS_SRC if side == "tierfs" else args.reference_src
    cluster = cluster_of(
        tmp / f"{side}-{d}",
        d,
        src,
        proxy.url,
        replicas=1,
        capacity=args.capacity,
        gcs=f"gs://{bucket}/t",
        data_parallel=d,
    )
    try:
        cluster.start_all()
        for node in cluster.nodes:
            tmpdir = node.mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp"
            tmpdir.mkdir(parents=True)
            (tmpdir / "shard").write_bytes(data)
        warm_up(str(tmp / "warm"), len(data) * d, aligned(MiB))
        proxy.reset()
        t0 = time.perf_counter()
        for node in cluster.nodes:
            os.rename(node.mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", node.mountpoint / "ckpt" / str(STEP))
        done: dict[int, dict] = {}
        while len(done) < d:
            if time.perf_counter() - t0 > args.timeout:
                raise BenchError(
                    f"{side}, D = {d}: ranks {sorted(set(range(d)) - set(done))} not backed up "
                    f"within {args.timeout:.0f} s"
                )
            for i, node in enumerate(cluster.nodes):
                if i in done:
                    continue
                st = next((s for s in fetch_status(node.mountpoint)["steps"] if s["step"] == STEP), None)
                if st and st["backed_up"]:
                    done[i] = {**st["backup"], "observed_s": time.perf_counter() - t0}
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
        counts = proxy.counts()
        manifests = sum(1 for b in client.list_blobs(bucket, prefix="t/") if "/manifests/" in f"/{b.name}")
        if manifests < d:
            raise BenchError(f"{side}, D = {d}: {manifests} manifests in GCS for {d} ranks")
        return {
            "side": side,
            "d": d,
            "unique_bytes": len(data),
            "seconds": seconds,
            "bytes_up": counts["up"],
            "bytes_down": counts["down"],
            "requests": counts["requests"],
            "methods": counts["methods"],
            "manifests": manifests,
            "ranks": done,
        }
    finally:
        cluster.close()
        drop_bucket(client, bucket)


def run(args, emu, client) -> dict:
    """Every round of every D on both sides, then the simulated D values; raw runs and medians."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-gcs-twins-", dir="/dev/shm"))
    raw: list[dict] = []
    try:
        with GcsProxy(emu.url) as proxy:
            for rnd in range(args.rounds):
                data = os.urandom(args.size)
                for k, d in enumerate(args.twins):
                    order = SIDES if (rnd + k) % 2 == 0 else SIDES[::-1]
                    for side in order:
                        r = run_side(side, d, args, data, emu, proxy, client, tmp)
                        r["round"] = rnd
                        raw.append(r)
                        progress(
                            f"round {rnd + 1} D = {d} {side}: {r['bytes_up'] / r['unique_bytes']:.2f}x up, "
                            f"{r['bytes_down'] / r['unique_bytes']:.2f}x down, {r['requests']} requests, "
                            f"every rank backed up after {r['seconds']:.2f} s"
                        )
                del data
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"raw": raw, "medians": medians(raw), "simulated": simulate(args)}


def medians(raw: list[dict]) -> list[dict]:
    med = statistics.median
    rows = []
    for d in sorted({r["d"] for r in raw}):
        for side in SIDES:
            runs = [r for r in raw if r["d"] == d and r["side"] == side]
            unique = runs[0]["unique_bytes"]
            rows.append(
                {
                    "d": d,
                    "side": side,
                    "rounds": len(runs),
                    "unique_bytes": unique,
                    "up_per_unique": med(r["bytes_up"] for r in runs) / unique,
                    "down_per_unique": med(r["bytes_down"] for r in runs) / unique,
                    "requests": med(r["requests"] for r in runs),
                    "seconds": med(r["seconds"] for r in runs),
                }
            )
    return rows


def simulate(args) -> list[dict]:
    """The D values too many for this machine's daemons, from the scale simulation: the per-rank size
    measured here, and every twin committing at once, as the renames here do."""
    if not args.sim_twins:
        return []
    from tierfs_testing.backups import backup

    chunk = 4 * MiB
    rows = []
    for d in args.sim_twins:
        for side, mode in (("tierfs", "twins"), ("baseline", "today")):
            b = backup(d, d, mode, chunks=max(1, args.size // chunk), chunk_size=chunk, spread=0.0)
            rows.append(
                {
                    "d": d,
                    "side": side,
                    "simulated": True,
                    "unique_bytes": b["unique_bytes"],
                    "up_per_unique": b["up_per_unique"],
                    "down_per_unique": b["down_per_unique"],
                    "requests": b["requests"],
                    "seconds": b["backed_up_s_max"],
                }
            )
    return rows


def render(result: dict) -> str:
    out = [
        f"{'D':>3}  {'side':<9}  {'up/unique':>9}  {'down/unique':>11}  {'requests':>8}  "
        f"{'commit to every rank backed up':>30}",
        "-" * 82,
    ]
    for r in result["medians"] + result["simulated"]:
        sim = "  (simulated: model seconds)" if r.get("simulated") else ""
        out.append(
            f"{r['d']:>3}  {r['side']:<9}  {r['up_per_unique']:9.3f}  {r['down_per_unique']:11.3f}  "
            f"{r['requests']:8.0f}  {r['seconds']:28.2f} s{sim}"
        )
    return "\n".join(out)


def plot(path: str, result: dict, title: str, pyplot, save_figure) -> str | None:
    """GCS bytes per unique byte and the time to every rank backed up, against D, for both sides."""
    plt = pyplot()
    if plt is None:
        return "matplotlib is not importable"
    rows = result["medians"] + result["simulated"]
    fig, (bx, tx) = plt.subplots(1, 2, figsize=(10, 4))
    for side, label, style in (("tierfs", "twins share the upload", "o-"), ("baseline", "code before", "s--")):
        real = [r for r in rows if r["side"] == side and not r.get("simulated")]
        sim = [r for r in rows if r["side"] == side and r.get("simulated")]
        (line,) = bx.plot(
            [r["d"] for r in real],
            [r["up_per_unique"] + r["down_per_unique"] for r in real],
            style,
            label=f"{label} (daemons)",
        )
        if sim:
            bx.plot(
                [r["d"] for r in sim],
                [r["up_per_unique"] + r["down_per_unique"] for r in sim],
                "x",
                color=line.get_color(),
                ms=9,
                label=f"{label} (simulated)",
            )
        tx.plot([r["d"] for r in real], [r["seconds"] for r in real], style, label=label)
    bx.set(
        xscale="log",
        xlabel="data-parallel twins D (nodes)",
        ylabel="GCS bytes (up + down) / unique bytes",
        title="GCS traffic of one step's backup",
    )
    bx.set_xticks(sorted({r["d"] for r in rows}), [str(d) for d in sorted({r["d"] for r in rows})])
    bx.legend(fontsize=7)
    tx.set(
        xscale="log",
        xlabel="data-parallel twins D (nodes)",
        ylabel="seconds (median)",
        title="commit to every rank backed up (daemons)",
        ylim=(0, None),
    )
    tx.set_xticks(
        sorted({r["d"] for r in rows if not r.get("simulated")}),
        [str(d) for d in sorted({r["d"] for r in rows if not r.get("simulated")})],
    )
    tx.legend(fontsize=7)
    for ax in (bx, tx):
        ax.minorticks_off()
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None
