"""Run the plugin: the gRPC services on a unix socket, re-adoption at start, idle collection.

The main thread owns everything: it starts the server (whose worker threads it stops on
the way out), adopts what a previous run left, then sleeps between garbage collections
until SIGTERM or SIGINT. Daemons are separate processes and keep running when it exits.
Threads started and joined by it post the pods' Events (:mod:`tierfs.csi.events`), relay
the daemons' logs (:mod:`tierfs.csi.logrelay`) and serve the node's metrics (:mod:`tierfs.csi.metrics`).

The liveness probe calls Identity.Probe() on the same socket as kubelet's volume calls, so
no volume call may hold it up: the server has ``--volume-calls`` threads for the Node
service, which refuses any call beyond them (UNAVAILABLE, kubelet retries), and
``IDENTITY_THREADS`` more that only the Identity service's calls (and those refusals, which
take microseconds) ever use. Different jobs' calls run side by side
(:mod:`tierfs.csi.locks`), so one slow daemon start holds one thread, not the node.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
from concurrent import futures
from pathlib import Path

import grpc

from tierfs.core.errors import UserError
from tierfs.csi import events, identity, metrics, node
from tierfs.csi.logrelay import LogRelay
from tierfs.csi.settings import PluginConfig
from tierfs.csi.volumes import Volumes

log = logging.getLogger("tierfs.csi")
GC_CHECK_INTERVAL = 60.0
IDENTITY_THREADS = 4  # the server's threads beyond the volume calls': the probe's


def socket_path(endpoint: str) -> Path:
    """``unix:///csi/csi.sock`` (or ``unix:/csi/csi.sock``) -> ``/csi/csi.sock``."""
    if not endpoint.startswith("unix:") or not endpoint[5:].lstrip("/"):
        raise UserError(f"invalid --endpoint {endpoint!r}: use unix:///PATH/csi.sock")
    return Path("/" + endpoint[5:].lstrip("/"))


def serve(cfg: PluginConfig, endpoint: str, stop: threading.Event | None = None) -> None:
    path = socket_path(endpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
        path.unlink()  # left by a previous run; the registrar reconnects
    volumes = Volumes(cfg)
    # Before listening: no call may race a volume being brought back or taken over, and the
    # socket appears once this plugin can answer (a rollout's new pod is ready only then).
    volumes.adopt()
    watcher = events.EventWatcher(volumes, cfg)  # the pods' Events, from start() to stop()
    threads = futures.ThreadPoolExecutor(max_workers=cfg.volume_calls + IDENTITY_THREADS, thread_name_prefix="csi")
    server = grpc.server(threads)
    server.add_generic_rpc_handlers(
        (identity.handler(cfg), node.handler(volumes, cfg.node_id, cfg.volume_calls, refused=watcher.refused))
    )
    try:
        server.add_insecure_port(f"unix://{path}")
    except RuntimeError as e:
        raise UserError(f"cannot listen on {path}: {e}") from None
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    server.start()
    relay = LogRelay(cfg.state_dir / "logs", cfg.log_format)  # the daemons' logs to stdout, from now on
    http = None
    try:
        relay.start()
        watcher.start()
        http = metrics.serve(cfg, volumes)  # /metrics, /healthz, /daemons
        log.info("serving CSI for node %s on %s", cfg.node_id, path)
        while not stop.wait(min(GC_CHECK_INTERVAL, cfg.gc_after or GC_CHECK_INTERVAL)):
            for job in volumes.collect_idle():
                log.info("job %s was unused for %.0fs: its data on this node is gone", job, cfg.gc_after)
    finally:
        if http is not None:
            http.close()
        server.stop(grace=5).wait()
        relay.stop()  # after the calls: their daemons' last lines are relayed too
        watcher.stop()
        if path.exists():
            os.unlink(path)
