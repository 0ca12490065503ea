"""The CSI Node service: check each request as the spec asks, then let ``Volumes`` act."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from tierfs.core.errors import UserError
from tierfs.csi import csi_pb2 as pb
from tierfs.csi.errors import Aborted, InvalidArgument, VolumeError
from tierfs.csi.rpc import Gate, service
from tierfs.csi.settings import PublishRequest
from tierfs.csi.volumes import Volumes

Mode = pb.VolumeCapability.AccessMode.Mode
Unit = pb.VolumeUsage.Unit
RPC = pb.NodeServiceCapability.RPC
# One node uses a tierfs volume; read-only modes are served by a read-only bind mount.
ACCESS_MODES = {
    Mode.SINGLE_NODE_WRITER,
    Mode.SINGLE_NODE_SINGLE_WRITER,
    Mode.SINGLE_NODE_MULTI_WRITER,
    Mode.SINGLE_NODE_READER_ONLY,
    Mode.MULTI_NODE_READER_ONLY,
}
READ_ONLY_MODES = {Mode.SINGLE_NODE_READER_ONLY, Mode.MULTI_NODE_READER_ONLY}


class Unimplemented(VolumeError):
    code = "UNIMPLEMENTED"


def _require(value: str, name: str) -> str:
    if not value:
        raise InvalidArgument(f"{name} is missing")
    return value


def _check_capability(request: pb.NodePublishVolumeRequest) -> None:
    if not request.HasField("volume_capability"):
        raise InvalidArgument("volume_capability is missing")
    cap = request.volume_capability
    if cap.HasField("block"):
        raise InvalidArgument("tierfs volumes are filesystems: block access is not supported")
    if cap.access_mode.mode not in ACCESS_MODES:
        raise InvalidArgument(
            f"access mode {Mode.Name(cap.access_mode.mode)} is not supported: a tierfs volume belongs to one node"
        )
    if cap.mount.mount_flags:
        raise InvalidArgument(f"mount flags {list(cap.mount.mount_flags)} are not supported: use volume attributes")


def handler(
    volumes: Volumes, node_id: str, calls: int, refused: Callable[[dict[str, str], str], None] | None = None
) -> grpc.GenericRpcHandler:
    """The Node service; at most ``calls`` of its calls run at once (:class:`tierfs.csi.rpc.Gate`).

    ``refused(volume_context, message)`` hears of each publish refused for good (not a
    busy job's ABORTED, which kubelet retries at once): the pod's TierfsStartRefused Event.
    """

    def publish(request: pb.NodePublishVolumeRequest) -> pb.NodePublishVolumeResponse:
        _require(request.volume_id, "volume_id")
        _require(request.target_path, "target_path")
        _check_capability(request)
        try:
            volumes.publish(
                PublishRequest(
                    volume_id=request.volume_id,
                    target=request.target_path,
                    read_only=request.readonly or request.volume_capability.access_mode.mode in READ_ONLY_MODES,
                    context=dict(request.volume_context),
                    secrets=dict(request.secrets),
                )
            )
        except (VolumeError, UserError) as e:
            if refused is not None and not isinstance(e, Aborted):
                refused(dict(request.volume_context), str(e))
            raise
        return pb.NodePublishVolumeResponse()

    def unpublish(request: pb.NodeUnpublishVolumeRequest) -> pb.NodeUnpublishVolumeResponse:
        volumes.unpublish(_require(request.volume_id, "volume_id"), _require(request.target_path, "target_path"))
        return pb.NodeUnpublishVolumeResponse()

    def volume_stats(request: pb.NodeGetVolumeStatsRequest) -> pb.NodeGetVolumeStatsResponse:
        st, problem = volumes.stats(
            _require(request.volume_id, "volume_id"), _require(request.volume_path, "volume_path")
        )
        if st is None:
            return pb.NodeGetVolumeStatsResponse(volume_condition=pb.VolumeCondition(abnormal=True, message=problem))
        return pb.NodeGetVolumeStatsResponse(
            usage=[
                pb.VolumeUsage(
                    unit=Unit.BYTES,
                    total=st.f_blocks * st.f_frsize,
                    available=st.f_bavail * st.f_frsize,
                    used=(st.f_blocks - st.f_bfree) * st.f_frsize,
                ),
                pb.VolumeUsage(unit=Unit.INODES, total=st.f_files, available=st.f_favail, used=st.f_files - st.f_ffree),
            ],
            volume_condition=pb.VolumeCondition(abnormal=False, message="tierfs is serving the volume"),
        )

    def capabilities(request: pb.NodeGetCapabilitiesRequest) -> pb.NodeGetCapabilitiesResponse:
        return pb.NodeGetCapabilitiesResponse(
            capabilities=[
                pb.NodeServiceCapability(rpc=RPC(type=t)) for t in (RPC.GET_VOLUME_STATS, RPC.VOLUME_CONDITION)
            ]
        )

    def info(request: pb.NodeGetInfoRequest) -> pb.NodeGetInfoResponse:
        return pb.NodeGetInfoResponse(node_id=node_id)

    def unimplemented(what: str):
        def refuse(request):
            raise Unimplemented(f"{what} is not supported: tierfs volumes are ephemeral and published directly")

        return refuse

    return service(
        "Node",
        {
            "NodePublishVolume": publish,
            "NodeUnpublishVolume": unpublish,
            "NodeGetVolumeStats": volume_stats,
            "NodeGetCapabilities": capabilities,
            "NodeGetInfo": info,
            "NodeStageVolume": unimplemented("NodeStageVolume"),
            "NodeUnstageVolume": unimplemented("NodeUnstageVolume"),
            "NodeExpandVolume": unimplemented("NodeExpandVolume"),
        },
        Gate(calls, "volume calls"),
    )
