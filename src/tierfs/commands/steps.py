"""``tierfs steps``: every step the job's tiers hold, newest first.

With MOUNTPOINT, that mount's daemon answers from a survey of every tier it reaches: its
RAM, its --disk, its peers (their RAM and the replicas they keep for other ranks) and the
bucket, so any node of the job sees every rank. With --job and --gcs instead, from a
machine with no mount, the bucket's manifests are listed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tierfs.config import env_value
from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError
from tierfs.core.keys import ManifestKeys, bucket_seals, manifest_keys, split_secrets
from tierfs.core.manifest import ManifestError, split_seal
from tierfs.core.milestones import Milestones
from tierfs.core.parse import check_job_id, format_size, parse_duration, parse_gcs_url
from tierfs.daemon.steps import MAX_MISSING, Facts, manifest_facts

if TYPE_CHECKING:
    from tierfs.tiers.gcs_store import GcsStore

ASK_TIMEOUT = 60.0  # the daemon bounds its survey well within this (tierfs.daemon.steps)
MAX_SIZED_STEPS = 50  # bucket mode: the newest steps whose manifests are read for their sizes...
MAX_READS = 2000  # ... and at most this many manifests in all
READ_THREADS = 16
MAX_NOTES = 3  # silent tiers named one by one; past that, counted


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("steps", help="list every step the job's tiers hold", description=__doc__.splitlines()[0])
    p.add_argument("mountpoint", metavar="MOUNTPOINT", nargs="?", help="a tierfs mount of the job")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    bucket = p.add_argument_group("without a mount", "list what the job's bucket holds")
    bucket.add_argument("--job", help="the job id")
    bucket.add_argument("--gcs", metavar="gs://BUCKET/PREFIX", help="the job's --gcs")
    bucket.add_argument("--nodes", type=int, help="ranks in the job (default: the highest rank listed, plus 1)")
    bucket.add_argument(
        "--secret-file", metavar="F", help="the job's secret, to verify the manifests (or set TIERFS_SECRET)"
    )
    bucket.add_argument("--keep-every", type=int, metavar="N", help="the job's --keep-every, to mark milestones")
    bucket.add_argument("--keep-for", metavar="D", help="the job's --keep-for, to mark milestones")
    bucket.add_argument(
        "--discard-set-aside",
        type=int,
        metavar="STEP",
        help="delete the steps the rollback to STEP set aside (and forget that rollback)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.gcs is None:
        if args.mountpoint is None:
            raise UserError("give a MOUNTPOINT, or --job JOB --gcs gs://BUCKET/PREFIX to list a bucket without a mount")
        given = [
            f"--{a.replace('_', '-')}"
            for a in ("job", "nodes", "secret_file", "keep_every", "keep_for", "discard_set_aside")
            if getattr(args, a) is not None
        ]
        if given:
            raise UserError(f"{', '.join(given)} only go with --gcs: with a MOUNTPOINT its daemon knows the job")
        steps, notes = from_daemon(Path(args.mountpoint).absolute())
    else:
        if args.mountpoint is not None:
            raise UserError(
                f"give MOUNTPOINT or --gcs, not both: {args.mountpoint} lists what its daemon "
                "reaches, --gcs what the bucket holds"
            )
        if args.job is None:
            raise UserError(f"--gcs {args.gcs} needs --job JOB: a bucket holds each job under its own name")
        if args.discard_set_aside is not None:
            print(discard(args.gcs, args.job, args.discard_set_aside, read_secret(args.secret_file)))
            return 0
        steps, notes = from_bucket(
            args.gcs,
            args.job,
            args.nodes,
            read_secret(args.secret_file),
            args.keep_every or 0,
            parse_duration(args.keep_for or "0", "keep-for"),
        )
    for note in notes:
        print(f"tierfs: note: {note}", file=sys.stderr)
    print(json.dumps(steps, indent=2) if args.json else render(steps))
    return 0


# -- from a mount's daemon ---------------------------------------------------------------


def from_daemon(mountpoint: Path) -> tuple[list[dict], list[str]]:
    """The daemon's answer (:func:`tierfs.daemon.steps.answer`): the steps, and what it could not reach."""
    entry = mounts.find_mount(mountpoint)
    if entry is None or entry.fstype != mounts.FSTYPE:
        raise UserError(
            f"{mountpoint} is not a tierfs mount: give the mountpoint of a volume, "
            "or --job and --gcs to list a bucket without one"
        )
    if mounts.is_dead(mountpoint):
        raise UserError(f"the daemon of {mountpoint} is gone: run tierfs mount again to recover it")
    try:
        reply = control_client.request(mounts.Registration(mountpoint).socket_path, {"op": "steps"}, ASK_TIMEOUT)
    except UserError as e:
        if "unknown request" in str(e):
            raise UserError(
                f"the daemon of {mountpoint} predates tierfs steps: run tierfs upgrade {mountpoint}"
            ) from None
        raise
    silent = sorted(reply.get("unanswered", {}).items())
    notes = [f"{name} did not answer ({why}): what it holds is not counted" for name, why in silent[:MAX_NOTES]]
    if len(silent) > MAX_NOTES:
        notes.append(f"{len(silent) - MAX_NOTES} more tiers did not answer: what they hold is not counted")
    return reply["steps"], notes


# -- from the bucket alone -------------------------------------------------------------


def read_secret(secret_file: str | None) -> bytes | None:
    """The job's secret (and older ones on later lines), from --secret-file or TIERFS_SECRET."""
    if secret_file is not None:
        try:
            return Path(secret_file).read_bytes()
        except OSError as e:
            raise UserError(f"cannot read --secret-file {secret_file}: {e.strerror}") from None
    secret = env_value("secret")
    return secret.encode() if secret else None


def from_bucket(
    url: str, job: str, nodes: int | None, secret: bytes | None, keep_every: int = 0, keep_for: float = 0.0
) -> tuple[list[dict], list[str]]:
    """The job's steps in ``url``, as a bucket listing shows them (rank -> steps), with sizes
    of the newest :data:`MAX_SIZED_STEPS` (the sum over their ranks)."""
    if nodes is not None and nodes < 1:
        raise UserError(f"invalid --nodes {nodes}: a job has at least 1 node")
    if keep_every < 0 or keep_for < 0:
        raise UserError("invalid --keep-every or --keep-for: use the job's own, 0 (none, for good) or more")
    milestones = Milestones(keep_every, keep_for)
    store, keys = open_bucket(url, job, secret)
    with ignored_objects() as ignored:
        with bucket_errors(url, "list"):
            store.check()
            listing = store.list_manifests()
            aside = store.list_aside()
        by_step: dict[int, list[int]] = {}
        for rank, held in listing.items():
            for step in held:
                by_step.setdefault(step, []).append(rank)
        facts, sealed = bucket_facts(store, by_step, keys, job)
    notes = []
    if sealed:
        notes.append(
            f"the manifests in {url} are sealed with the job's secret: without it their steps are "
            "listed unverified and their sizes are unknown; give --secret-file F or TIERFS_SECRET"
        )
    if ignored:
        more = f" (and {len(ignored) - 1} more like it)" if len(ignored) > 1 else ""
        notes.append(f"left out of the listing: {ignored[0]}{more}")
    for to, set_aside in aside.items():
        steps = sorted({step for ranks in set_aside.values() for step in ranks})
        shown = ", ".join(map(str, steps[:MAX_MISSING])) + (
            f" and {len(steps) - MAX_MISSING} more" if len(steps) > MAX_MISSING else ""
        )
        notes.append(
            f"the rollback to step {to} set aside step(s) {shown}, kept until "
            f"'tierfs steps --job {job} --gcs {url} --discard-set-aside {to}'"
        )
    nodes = nodes or (max(listing) + 1 if listing else 1)
    now = time.time()
    listed = []
    for step in sorted(by_step, reverse=True):
        ranks = set(by_step[step])
        known = [f for r in sorted(ranks) if (f := facts.get((r, step))) is not None]
        at = max((f.created for f in known), default=None)
        age = round(max(0.0, now - at), 1) if at is not None else None
        listed.append(
            {
                "step": step,
                "tiers": ["gcs"],
                "peers": [],
                "complete": sum(1 for r in ranks if 0 <= r < nodes),
                "nodes": nodes,
                "missing_ranks": [r for r in range(nodes) if r not in ranks][:MAX_MISSING],
                "size": sum(f.size for f in known) if len(known) == len(ranks) else None,  # of every rank, or unknown
                "committed_at": at,
                "age_s": age,
                "milestone": milestones.is_milestone(step, at, now),
            }
        )
    return listed, notes


def open_bucket(url: str, job: str, secret: bytes | None) -> tuple[GcsStore, ManifestKeys | None]:
    """The job's objects in ``url``, read with the job's secret (and older ones) if given."""
    from tierfs.tiers.gcs_store import GcsStore  # noqa: PLC0415 (slow import: only for a bucket)

    check_job_id(job)
    parse_gcs_url(url)
    current, older = split_secrets(secret or b"")
    if any(len(s) < 16 for s in (current or b"x" * 16, *older)):
        raise UserError(
            "the job secret is too short: use the job's own (at least 16 characters), "
            "from --secret-file or TIERFS_SECRET"
        )
    keys = manifest_keys(job, current or None, older)
    return GcsStore(url, job, keys=keys, seals=bucket_seals(job, current or None, older)), keys


@contextmanager
def bucket_errors(url: str, doing: str) -> Iterator[None]:
    """A bucket that cannot be reached or refuses, in one line."""
    from tierfs.tiers.gcs_http import GcsError, GcsUnavailable  # noqa: PLC0415 (slow import: only for a bucket)

    try:
        yield
    except GcsUnavailable as e:
        raise UserError(
            f"cannot reach {url} ({e}): check the network, the credentials or STORAGE_EMULATOR_HOST"
        ) from None
    except GcsError as e:
        raise UserError(f"cannot {doing} {url}: {e}") from None


def discard(url: str, job: str, to: int, secret: bytes | None) -> str:
    """Delete what the rollback to step ``to`` set aside in the bucket, and its record."""
    store, _ = open_bucket(url, job, secret)
    with bucket_errors(url, "discard in"):
        held = store.list_aside().get(to)
        gone = store.discard_aside(to)
    steps = sorted({step for ranks in (held or {}).values() for step in ranks})
    if not gone:
        return f"nothing set aside by a rollback to step {to} in {url} (job {job}); its record, if any, is gone"
    return (
        f"discarded {gone} manifest(s) of step(s) {', '.join(map(str, steps))} set aside by the rollback to "
        f"step {to}; the next GC frees the chunks only they used"
    )


def bucket_facts(
    store: GcsStore, by_step: dict[int, list[int]], keys: ManifestKeys | None, job: str
) -> tuple[dict[tuple[int, int], Facts], bool]:
    """Facts of the manifests of the newest steps (step -> ranks listed), read in parallel; and
    whether, no secret given, the manifests are sealed (then none is read past the first)."""
    from tierfs.tiers.gcs_http import CorruptObject, GcsError  # noqa: PLC0415 (slow import: only for a bucket)

    wanted: list[tuple[int, int]] = []
    for step in sorted(by_step, reverse=True)[:MAX_SIZED_STEPS]:
        if len(wanted) + len(by_step[step]) > MAX_READS:
            break
        wanted += [(rank, step) for rank in by_step[step]]
    if keys is None and wanted:  # unverifiable: a sealed manifest does not even open without the secret
        try:
            if split_seal(store.get_manifest(*wanted[0]))[1] is not None:
                return {}, True
        except CorruptObject:
            return {}, True
        except GcsError:
            pass

    def read(pair: tuple[int, int]) -> Facts | None:
        try:
            return manifest_facts(store.get_manifest(*pair), keys, job, *pair)
        except (GcsError, ManifestError, UserError):  # gone meanwhile, or not the job's: its step has no size
            return None

    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tierfs-steps") as pool:
        read_back = zip(wanted, pool.map(read, wanted), strict=True)
        return {pair: fact for pair, fact in read_back if fact is not None}, False


@contextmanager
def ignored_objects() -> Iterator[list[str]]:
    """What the store logs while it lists (objects it ignores), collected for one summary line."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("tierfs.tiers")
    handler, propagate = Collect(logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


# -- output ------------------------------------------------------------------------------


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h" if seconds < 172800 else f"{seconds / 86400:.1f}d"


def render(steps: list[dict]) -> str:
    """A table, newest step first: tiers, ranks holding it complete, size, age, milestone."""
    if not steps:
        return "no steps on any tier"
    rows = [("STEP", "TIERS", "COMPLETE", "SIZE", "AGE", "MILESTONE")]
    for s in steps:
        rows.append(
            (
                str(s["step"]),
                ",".join(s["tiers"]),
                f"{s['complete']}/{s['nodes']}",
                format_size(s["size"]) if s["size"] is not None else "-",
                _age(s["age_s"]),
                "yes" if s["milestone"] else "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
