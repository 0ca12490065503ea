"""The CSI Identity service: who the plugin is, and whether it is ready."""

from __future__ import annotations

import grpc

from tierfs import __version__
from tierfs.csi import DRIVER_NAME
from tierfs.csi import csi_pb2 as pb
from tierfs.csi.rpc import service


def handler() -> grpc.GenericRpcHandler:
    def get_plugin_info(request: pb.GetPluginInfoRequest) -> pb.GetPluginInfoResponse:
        return pb.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    def get_plugin_capabilities(request: pb.GetPluginCapabilitiesRequest) -> pb.GetPluginCapabilitiesResponse:
        return pb.GetPluginCapabilitiesResponse()  # a node plugin only: no controller service

    def probe(request: pb.ProbeRequest) -> pb.ProbeResponse:
        return pb.ProbeResponse()  # no readiness field: ready as soon as it answers

    return service("Identity", {
        "GetPluginInfo": get_plugin_info,
        "GetPluginCapabilities": get_plugin_capabilities,
        "Probe": probe,
    })
