"""Restore onto an empty RAM tier: the newest step of this rank that a peer or GCS holds.

Peers are asked which steps of this rank they hold and GCS lists its manifests; the newest
step wins, and a peer copy is preferred to GCS for the same step. Chunks are fetched by
several tasks at once, spread over every peer that holds the step; each chunk is verified
against its name, and one that fails from a peer (down, wrong bytes) is fetched from the
next peer, then from GCS.

The step is rebuilt in a staging tree beside the real one and swapped in only when every
chunk has been fetched and verified, so a failed or interrupted restore never shows a
partial checkpoint: the next start finds an empty tree and tries again.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from dataclasses import dataclass, field

import trio

from tierfs import chunks
from tierfs.config import Config, format_size
from tierfs.errors import UserError
from tierfs.manifest import Manifest, ManifestError
from tierfs.peers.wire import PeerError
from tierfs.ramtier import RankDir
from tierfs.steps import StepState, Steps

log = logging.getLogger(__name__)

FETCH_TASKS = 8
GCS_ATTEMPTS = 4  # per request, on top of the GCS module's own quick retries


def tree_is_empty(tree) -> bool:
    with os.scandir(tree) as it:
        return next(it, None) is None


@dataclass
class Plan:
    step: int
    peers: list[tuple[str, int]] = field(default_factory=list)  # peers holding the step
    in_gcs: bool = False


class Restorer:
    def __init__(self, cfg: Config, rank: RankDir, steps: Steps, gcs=None, peers=None):
        self.cfg, self.rank, self.steps, self.gcs, self.peers = cfg, rank, steps, gcs, peers
        self.bytes_from: dict[str, int] = {}

    async def plan(self) -> Plan | None:
        """The newest step of this rank on any reachable tier, and who holds it."""
        held: dict[int, list[tuple[str, int]]] = {}
        if self.peers is not None:
            for address, manifests in (await self.peers.holdings()).items():
                for rank, step in manifests:
                    if rank == self.cfg.rank:
                        held.setdefault(step, []).append(address)
        gcs_steps: list[int] = []
        if self.gcs is not None:
            try:
                gcs_steps = await self._gcs(self.gcs.list_steps, self.cfg.rank)
            except UserError as e:
                if not held:
                    raise
                log.warning("restoring from peers only: %s", e)
                self.gcs = None
        newest = max([*held, *gcs_steps], default=None)
        if newest is None:
            return None
        return Plan(newest, held.get(newest, []), newest in gcs_steps)

    async def restore(self) -> dict | None:
        cfg = self.cfg
        plan = await self.plan()
        if plan is None:
            log.info("no tier holds a step of %s rank %d: starting empty", cfg.job, cfg.rank)
            return None
        started = time.time()
        manifest = await self._manifest(plan)
        if cfg.capacity is not None and manifest.total_bytes > cfg.capacity:
            raise UserError(
                f"step {plan.step} of rank {cfg.rank} holds {format_size(manifest.total_bytes)}, "
                f"more than --capacity {format_size(cfg.capacity)}: raise the capacity"
            )
        staging = self.rank.path / ".restoring"
        shutil.rmtree(staging, ignore_errors=True)
        os.mkdir(staging)
        os.chmod(staging, 0o1777)
        try:
            await self._materialize(manifest, staging, plan)
            os.rmdir(self.rank.tree)  # empty, checked by the caller
            os.rename(staging, self.rank.tree)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._record(manifest, plan)
        took = time.time() - started
        sources = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(self.bytes_from.items()))
        log.info("restored step %d: %s in %.2fs from %s", plan.step, format_size(manifest.total_bytes), took, sources)
        peer_bytes = {k: v for k, v in self.bytes_from.items() if k.startswith("peer ")}
        origin = max(peer_bytes, key=peer_bytes.get) if peer_bytes else cfg.gcs
        return {"step": plan.step, "tier": "peer" if peer_bytes else "gcs", "from": origin,
                "bytes": manifest.total_bytes,
                "bytes_from": dict(self.bytes_from),
                "files": sum(e.kind == "file" for e in manifest.entries), "seconds": round(took, 3),
                "at": time.time()}

    def _record(self, manifest: Manifest, plan: Plan) -> None:
        """The restored step is committed; it is already where it came from."""
        for root in manifest.roots:
            self.steps.snapshots.freeze(plan.step, root, set())
        state = StepState(plan.step, sorted(manifest.roots), time.time(),
                          source="peer" if plan.peers else "gcs")
        if plan.peers:  # the peers it came from hold it: nothing to send them again
            state.replicas = {"version": state.version, "peers": [_name(a) for a in plan.peers],
                              "at": time.time(), "sent_bytes": 0, "skipped_bytes": 0, "restored": True}
        if plan.in_gcs:
            state.backup = {"version": state.version, "at": time.time(), "bytes": manifest.total_bytes,
                            "uploaded_bytes": 0, "dedup_bytes": manifest.total_bytes, "restored": True}
        self.steps.states[plan.step] = state
        self.steps.save(state)
        (self.steps.snapshots.step_dir(plan.step) / "manifest.json").write_bytes(manifest.to_json())

    # -- sources -------------------------------------------------------------------------

    async def _manifest(self, plan: Plan) -> Manifest:
        errors = []
        for address in plan.peers:
            try:
                async with await self.peers.connect(address) as client:
                    return _parse(await client.get_manifest(self.cfg.rank, plan.step), f"peer {_name(address)}")
            except (PeerError, OSError, trio.TooSlowError, UserError) as e:
                errors.append(f"peer {_name(address)}: {e}")
        if plan.in_gcs:
            return _parse(await self._gcs(self.gcs.get_manifest, self.cfg.rank, plan.step), self.cfg.gcs)
        raise UserError(f"no peer could send step {plan.step} of rank {self.cfg.rank}: {'; '.join(errors)}")

    async def _fetch(self, h: str, length: int, index: int, plan: Plan, alive: list, clients: dict) -> bytes:
        """Chunk ``h`` from the peers (starting at a different one per chunk), then GCS.

        ``clients`` holds the calling worker's open connections, one per peer, so a chunk
        costs one request, not a handshake.
        """
        errors, tried = [], set()
        while candidates := [a for a in alive if a not in tried]:
            address = candidates[index % len(candidates)]
            tried.add(address)
            try:
                if address not in clients:
                    clients[address] = await self.peers.connect(address)
                data = await clients[address].get_chunk(h, 0, length)
                if chunks.chunk_hash(data) != h:
                    raise PeerError("sent bytes that do not match the chunk's hash")
                self._count(f"peer {_name(address)}", len(data))
                return data
            except (PeerError, OSError, trio.TooSlowError) as e:
                errors.append(f"peer {_name(address)}: {e}")
                log.warning("chunk %s from peer %s failed (%s); trying the next source", h, _name(address), e)
                if address in clients:
                    await clients.pop(address).aclose()
                if address in alive:  # down or untrustworthy: not asked again in this restore
                    alive.remove(address)
        if self.gcs is None:
            raise UserError(f"chunk {h} of step {plan.step} is on no reachable peer and there is no --gcs: "
                            f"{'; '.join(errors)}")
        url = self.gcs.chunk_url(h)
        from tierfs.gcs import MissingObject  # noqa: PLC0415 (only with --gcs)

        try:
            frame = await self._gcs(self.gcs.get_chunk_frame, h)
        except MissingObject:
            raise UserError(f"chunk {url} is missing from GCS: the step cannot be restored from it") from None
        try:
            data = await trio.to_thread.run_sync(chunks.decode, frame, h)
        except chunks.CorruptChunk as e:
            raise UserError(f"chunk {url} is corrupt ({e}): the step cannot be restored from GCS") from None
        self._count("gcs", len(data))
        return data

    def _count(self, source: str, n: int) -> None:
        self.bytes_from[source] = self.bytes_from.get(source, 0) + n

    async def _gcs(self, fn, *args):
        from tierfs.gcs import GcsUnavailable  # noqa: PLC0415 (only with --gcs)

        for attempt in range(GCS_ATTEMPTS):
            try:
                return await trio.to_thread.run_sync(fn, *args)
            except GcsUnavailable as e:
                if attempt == GCS_ATTEMPTS - 1:
                    raise UserError(f"GCS is unreachable while restoring: {e}") from None
                await trio.sleep(2**attempt)

    # -- writing ---------------------------------------------------------------------------

    async def _materialize(self, manifest: Manifest, root, plan: Plan) -> None:
        """Create every entry under ``root`` and fill files with verified chunks."""
        fds: dict[str, int] = {}
        wanted: dict[str, list[tuple[int, int]]] = {}  # chunk -> (fd, offset) it fills
        lengths: dict[str, int] = {}
        try:
            for e in manifest.entries:
                path = root / e.path
                if e.kind == "dir":
                    path.mkdir(exist_ok=True)
                elif e.kind == "symlink":
                    os.symlink(e.target, path)
                else:
                    fd = fds[e.path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    os.ftruncate(fd, e.size)
                    for i, h in enumerate(e.chunks):
                        offset = i * manifest.chunk_size
                        wanted.setdefault(h, []).append((fd, offset))
                        lengths[h] = min(manifest.chunk_size, e.size - offset)
            alive = list(plan.peers)
            send, receive = trio.open_memory_channel(len(wanted) or 1)
            for item in enumerate(wanted):
                send.send_nowait(item)
            send.close()

            async def worker() -> None:
                clients: dict = {}
                try:
                    async for index, h in receive:
                        data = await self._fetch(h, lengths[h], index, plan, alive, clients)
                        for fd, offset in wanted[h]:
                            os.pwrite(fd, data, offset)
                finally:
                    for client in clients.values():
                        await client.aclose()

            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(FETCH_TASKS):
                        nursery.start_soon(worker)
            except* UserError as group:  # one clear line, not a group of them
                raise group.exceptions[0] from None
        finally:
            for fd in fds.values():
                os.close(fd)
        for e in reversed(manifest.entries):  # children before parents: directory mtimes stick
            path = root / e.path
            os.chown(path, e.uid, e.gid, follow_symlinks=False)
            if e.kind != "symlink":
                os.chmod(path, stat.S_IMODE(e.mode))
            os.utime(path, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)


def _parse(data: bytes, where: str) -> Manifest:
    try:
        return Manifest.from_json(data)
    except ManifestError as e:
        raise UserError(f"the manifest from {where} is unusable: {e}") from None


def _name(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"
