"""The CSI Identity service: who the plugin is, and whether it is ready.

Ready means the plugin can serve new volumes (:func:`tierfs.csi.health.can_serve`), not that
every job's daemon is well: a sick daemon is its job's trouble, shown on ``/daemons`` and in
its pods' Events, and a plugin marked unready for it would keep serving nobody better.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc
from google.protobuf.wrappers_pb2 import BoolValue

from tierfs import __version__
from tierfs.csi import DRIVER_NAME, health
from tierfs.csi import csi_pb2 as pb
from tierfs.csi.rpc import service
from tierfs.csi.settings import PluginConfig

log = logging.getLogger("tierfs.csi")
NOT_READY_LOG_EVERY = 60.0  # seconds


@dataclass
class _Said:
    """What the log said last of the plugin's readiness (its reason), and when (monotonic)."""

    reason: str
    at: float


def handler(cfg: PluginConfig) -> grpc.GenericRpcHandler:
    # What the log said last, and when: probes come every few seconds, the log hears of a
    # change at once and of an unready plugin once a minute.
    said = _Said(health.READY, 0.0)
    said_lock = threading.Lock()

    def get_plugin_info(request: pb.GetPluginInfoRequest) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def get_plugin_capabilities(request: pb.GetPluginCapabilitiesRequest) -> pb.GetPluginCapabilitiesResponse:
        return pb.GetPluginCapabilitiesResponse()  # a node plugin only: no controller service

    def probe(request: pb.ProbeRequest) -> pb.ProbeResponse:
        ready, reason = health.can_serve(cfg)
        now = time.monotonic()
        with said_lock:
            tell = said.reason != reason or (not ready and now - said.at >= NOT_READY_LOG_EVERY)
            if tell:
                said.reason, said.at = reason, now
        if tell and ready:
            log.info("ready to serve volumes again")
        elif tell:
            log.warning("not ready to serve volumes: %s", reason)
        return pb.ProbeResponse(ready=BoolValue(value=ready))

    return service(
        "Identity", {"GetPluginInfo": get_plugin_info, "GetPluginCapabilities": get_plugin_capabilities, "Probe": probe}
    )
