"""Data-parallel twins back a step up to GCS with each chunk sent once.

Four nodes, ``--data-parallel 4``: every node is a twin of every other and commits the same
bytes, as the ranks of a data-parallel job do. Each daemon reaches the GCS emulator
through a byte-counting proxy of its own (:class:`tierfs_testing.gcs_proxy.GcsProxy`), so
what the backup costs is measured on the wire, request and response bodies, not taken
from what the daemons say they sent. Without sharing, each twin would send every chunk and
those that lost the race would read it back: about 2D-1 times the step.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from tierfs_testing.gcs_proxy import GcsProxy

from tests.helpers import opened_manifest, sealed_key, wait_for
from tests.multinode.test_peers import MiB, commit_step
from tierfs.commands.status import render
from tierfs.core.manifest import Manifest

STEP = 5
NODES = 4
SHARD = 12 * MiB  # four files: a 48 MiB step, 48 chunks of 1 MiB
FILES = 4


@pytest.fixture
def proxies(gcs_emulator) -> Iterator[list[GcsProxy]]:
    made = [GcsProxy(gcs_emulator.url) for _ in range(NODES)]
    for p in made:
        p.start()
    yield made
    for p in made:
        p.stop()


def bucket_objects(gcs_emulator, bucket: str, prefix: str) -> dict[str, bytes]:
    """The objects under ``prefix``, read from the emulator itself (not through a proxy, not counted)."""
    client = storage.Client(
        credentials=AnonymousCredentials(), project="test", client_options={"api_endpoint": gcs_emulator.url}
    )
    return {b.name: b.download_as_bytes() for b in client.list_blobs(bucket, prefix=prefix)}


def twins_cluster(cluster, proxies, gcs_bucket):
    c = cluster(
        NODES,
        replicas=1,
        capacity="512M",
        chunk_size="1M",
        gcs=f"gs://{gcs_bucket}/tw",
        data_parallel=NODES,
        job=f"tw-{uuid.uuid4().hex[:6]}",
    )
    for node, proxy in zip(c.nodes, proxies, strict=True):
        node.environ = proxy.environ()
    c.start_all()
    for p in proxies:
        p.reset()  # the backup is what is measured, not the start
    return c


def commit_everywhere(c, ranks) -> dict[str, bytes]:
    """The same step on every rank at once, as data-parallel ranks save it."""
    files = {f"w{i}": os.urandom(SHARD) for i in range(FILES)}
    with ThreadPoolExecutor(len(ranks)) as pool:
        list(pool.map(lambda i: commit_step(c.nodes[i].mountpoint, STEP, files), ranks))
    return files


def backed_up(c, i: int) -> dict:
    return wait_for(
        lambda: next((s for s in c.status(i)["steps"] if s["step"] == STEP and s["backed_up"]), None),
        120,
        f"node {i} to back up step {STEP}",
    )


def moved(proxies) -> tuple[int, int, int]:
    counts = [p.counts() for p in proxies]
    return sum(n["up"] for n in counts), sum(n["down"] for n in counts), sum(n["requests"] for n in counts)


def check_manifests(gcs_emulator, gcs_bucket: str, job: str, ranks, secret: str) -> None:
    """A manifest for each rank, each naming only chunks the bucket holds (manifest-last),
    sealed under the job's secret."""
    objects = bucket_objects(gcs_emulator, gcs_bucket, f"tw/{job}/")
    manifests = {name: data for name, data in objects.items() if name.endswith(".json")}
    assert sorted(manifests) == [f"tw/{job}/manifests/rank-{r}/step-{STEP:012d}.json" for r in ranks]
    chunks = {name.rsplit("/", 1)[1] for name in objects if "/chunks/" in name}
    assert len(chunks) == FILES * SHARD // MiB
    for name, data in manifests.items():
        rank = int(name.split("/rank-")[1].split("/")[0])
        manifest = Manifest.from_json(opened_manifest(data, job, rank, STEP, secret))
        named = {sealed_key(job, h, secret) for entry in manifest.entries for h in entry.chunks}
        assert len(named) == len(chunks) and named <= chunks, f"{name} names chunks GCS does not hold"


# A peer may be too busy to confirm a replica in time on a small machine.
@pytest.mark.expect_log("not answer yet", "step 5 did not reach peer ", "step 5 is not confirmed by peer")
def test_four_twins_send_each_chunk_once_and_read_none_back(cluster, proxies, gcs_emulator, gcs_bucket):
    c = twins_cluster(cluster, proxies, gcs_bucket)
    commit_everywhere(c, range(NODES))
    states = [backed_up(c, i) for i in range(NODES)]
    unique = FILES * SHARD
    up, down, requests = moved(proxies)
    print(
        f"4 twins, {unique / MiB:.0f} MiB step: up {up / unique:.2f}x, down {down / unique:.3f}x "
        f"of the unique bytes, {requests} requests"
    )
    assert up + down <= 1.1 * unique, f"{up} bytes up and {down} down for {unique} unique"
    check_manifests(gcs_emulator, gcs_bucket, c.job, range(NODES), c.secret)
    backups = [s["backup"] for s in states]
    assert sum(b["sent_chunks"] for b in backups) == FILES * SHARD // MiB, "each chunk sent by one twin"
    assert all(b["sent_chunks"] > 0 for b in backups), "every twin sends a share"
    assert all(b["sent_chunks"] + b["twin_chunks"] == FILES * SHARD // MiB for b in backups)
    line = next(ln for ln in render(c.status(0)).splitlines() if ln.startswith(f"  step  {STEP}"))
    assert f"({backups[0]['sent_chunks']} chunks sent here, {backups[0]['twin_chunks']} by twins)" in line, line


@pytest.mark.expect_log(
    "not answer yet",
    "delayed, retrying",
    "step 5 did not reach peer ",
    "step 5 is not confirmed by peer",
    "peer 127.0.0.4:\\d+",
)
def test_a_twin_killed_in_the_middle_of_its_uploads_leaves_no_step_incomplete(
    cluster, proxies, gcs_emulator, gcs_bucket
):
    c = twins_cluster(cluster, proxies, gcs_bucket)
    victim = 2
    proxies[victim].hold_chunk_uploads(after=3)
    commit_everywhere(c, range(NODES))
    assert proxies[victim].holding.wait(60), "the victim never got to its fourth chunk upload"
    c.kill(victim)
    proxies[victim].release(drop=True)  # what it had in flight dies with it
    survivors = [i for i in range(NODES) if i != victim]
    states = {i: backed_up(c, i) for i in survivors}
    unique = FILES * SHARD
    up, down, requests = moved(proxies)
    print(
        f"4 twins, one killed: up {up / unique:.2f}x, down {down / unique:.3f}x of the unique bytes, "
        f"{requests} requests"
    )
    assert up + down <= 1.5 * unique, f"{up} bytes up and {down} down for {unique} unique"
    check_manifests(gcs_emulator, gcs_bucket, c.job, survivors, c.secret)
    taken = {i: s["backup"]["taken_over"] for i, s in states.items()}
    assert sum(taken.values()) > 0, "the victim's chunks were taken over"
    assert sum(1 for n in taken.values() if n) >= 2, f"split among the survivors, not all on one: {taken}"
