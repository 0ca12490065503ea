# The types of csi_pb2.py, for mypy: generated with it (grpc_tools.protoc --pyi_out, from
# csi/csi.proto), then `ruff check --fix` and `ruff format`. `type` is a field the CSI spec names.
# ruff: noqa: A002
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class GetPluginInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPluginInfoResponse(_message.Message):
    __slots__ = ("name", "vendor_version", "manifest")
    class ManifestEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    NAME_FIELD_NUMBER: _ClassVar[int]
    VENDOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    vendor_version: str
    manifest: _containers.ScalarMap[str, str]
    def __init__(
        self, name: str | None = ..., vendor_version: str | None = ..., manifest: _Mapping[str, str] | None = ...
    ) -> None: ...

class GetPluginCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPluginCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _containers.RepeatedCompositeFieldContainer[PluginCapability]
    def __init__(self, capabilities: _Iterable[PluginCapability | _Mapping] | None = ...) -> None: ...

class PluginCapability(_message.Message):
    __slots__ = ("service",)
    class Service(_message.Message):
        __slots__ = ("type",)
        class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            UNKNOWN: _ClassVar[PluginCapability.Service.Type]
            CONTROLLER_SERVICE: _ClassVar[PluginCapability.Service.Type]
            VOLUME_ACCESSIBILITY_CONSTRAINTS: _ClassVar[PluginCapability.Service.Type]
            GROUP_CONTROLLER_SERVICE: _ClassVar[PluginCapability.Service.Type]

        UNKNOWN: PluginCapability.Service.Type
        CONTROLLER_SERVICE: PluginCapability.Service.Type
        VOLUME_ACCESSIBILITY_CONSTRAINTS: PluginCapability.Service.Type
        GROUP_CONTROLLER_SERVICE: PluginCapability.Service.Type
        TYPE_FIELD_NUMBER: _ClassVar[int]
        type: PluginCapability.Service.Type
        def __init__(self, type: PluginCapability.Service.Type | str | None = ...) -> None: ...

    SERVICE_FIELD_NUMBER: _ClassVar[int]
    service: PluginCapability.Service
    def __init__(self, service: PluginCapability.Service | _Mapping | None = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: _wrappers_pb2.BoolValue
    def __init__(self, ready: _wrappers_pb2.BoolValue | _Mapping | None = ...) -> None: ...

class VolumeCapability(_message.Message):
    __slots__ = ("block", "mount", "access_mode")
    class BlockVolume(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...

    class MountVolume(_message.Message):
        __slots__ = ("fs_type", "mount_flags", "volume_mount_group")
        FS_TYPE_FIELD_NUMBER: _ClassVar[int]
        MOUNT_FLAGS_FIELD_NUMBER: _ClassVar[int]
        VOLUME_MOUNT_GROUP_FIELD_NUMBER: _ClassVar[int]
        fs_type: str
        mount_flags: _containers.RepeatedScalarFieldContainer[str]
        volume_mount_group: str
        def __init__(
            self,
            fs_type: str | None = ...,
            mount_flags: _Iterable[str] | None = ...,
            volume_mount_group: str | None = ...,
        ) -> None: ...

    class AccessMode(_message.Message):
        __slots__ = ("mode",)
        class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            UNKNOWN: _ClassVar[VolumeCapability.AccessMode.Mode]
            SINGLE_NODE_WRITER: _ClassVar[VolumeCapability.AccessMode.Mode]
            SINGLE_NODE_READER_ONLY: _ClassVar[VolumeCapability.AccessMode.Mode]
            MULTI_NODE_READER_ONLY: _ClassVar[VolumeCapability.AccessMode.Mode]
            MULTI_NODE_SINGLE_WRITER: _ClassVar[VolumeCapability.AccessMode.Mode]
            MULTI_NODE_MULTI_WRITER: _ClassVar[VolumeCapability.AccessMode.Mode]
            SINGLE_NODE_SINGLE_WRITER: _ClassVar[VolumeCapability.AccessMode.Mode]
            SINGLE_NODE_MULTI_WRITER: _ClassVar[VolumeCapability.AccessMode.Mode]

        UNKNOWN: VolumeCapability.AccessMode.Mode
        SINGLE_NODE_WRITER: VolumeCapability.AccessMode.Mode
        SINGLE_NODE_READER_ONLY: VolumeCapability.AccessMode.Mode
        MULTI_NODE_READER_ONLY: VolumeCapability.AccessMode.Mode
        MULTI_NODE_SINGLE_WRITER: VolumeCapability.AccessMode.Mode
        MULTI_NODE_MULTI_WRITER: VolumeCapability.AccessMode.Mode
        SINGLE_NODE_SINGLE_WRITER: VolumeCapability.AccessMode.Mode
        SINGLE_NODE_MULTI_WRITER: VolumeCapability.AccessMode.Mode
        MODE_FIELD_NUMBER: _ClassVar[int]
        mode: VolumeCapability.AccessMode.Mode
        def __init__(self, mode: VolumeCapability.AccessMode.Mode | str | None = ...) -> None: ...

    BLOCK_FIELD_NUMBER: _ClassVar[int]
    MOUNT_FIELD_NUMBER: _ClassVar[int]
    ACCESS_MODE_FIELD_NUMBER: _ClassVar[int]
    block: VolumeCapability.BlockVolume
    mount: VolumeCapability.MountVolume
    access_mode: VolumeCapability.AccessMode
    def __init__(
        self,
        block: VolumeCapability.BlockVolume | _Mapping | None = ...,
        mount: VolumeCapability.MountVolume | _Mapping | None = ...,
        access_mode: VolumeCapability.AccessMode | _Mapping | None = ...,
    ) -> None: ...

class CapacityRange(_message.Message):
    __slots__ = ("required_bytes", "limit_bytes")
    REQUIRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    required_bytes: int
    limit_bytes: int
    def __init__(self, required_bytes: int | None = ..., limit_bytes: int | None = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("segments",)
    class SegmentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.ScalarMap[str, str]
    def __init__(self, segments: _Mapping[str, str] | None = ...) -> None: ...

class NodeStageVolumeRequest(_message.Message):
    __slots__ = (
        "volume_id",
        "publish_context",
        "staging_target_path",
        "volume_capability",
        "secrets",
        "volume_context",
    )
    class PublishContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    class SecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    class VolumeContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STAGING_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    publish_context: _containers.ScalarMap[str, str]
    staging_target_path: str
    volume_capability: VolumeCapability
    secrets: _containers.ScalarMap[str, str]
    volume_context: _containers.ScalarMap[str, str]
    def __init__(
        self,
        volume_id: str | None = ...,
        publish_context: _Mapping[str, str] | None = ...,
        staging_target_path: str | None = ...,
        volume_capability: VolumeCapability | _Mapping | None = ...,
        secrets: _Mapping[str, str] | None = ...,
        volume_context: _Mapping[str, str] | None = ...,
    ) -> None: ...

class NodeStageVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeUnstageVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "staging_target_path")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    STAGING_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    staging_target_path: str
    def __init__(self, volume_id: str | None = ..., staging_target_path: str | None = ...) -> None: ...

class NodeUnstageVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodePublishVolumeRequest(_message.Message):
    __slots__ = (
        "volume_id",
        "publish_context",
        "staging_target_path",
        "target_path",
        "volume_capability",
        "readonly",
        "secrets",
        "volume_context",
    )
    class PublishContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    class SecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    class VolumeContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STAGING_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    publish_context: _containers.ScalarMap[str, str]
    staging_target_path: str
    target_path: str
    volume_capability: VolumeCapability
    readonly: bool
    secrets: _containers.ScalarMap[str, str]
    volume_context: _containers.ScalarMap[str, str]
    def __init__(
        self,
        volume_id: str | None = ...,
        publish_context: _Mapping[str, str] | None = ...,
        staging_target_path: str | None = ...,
        target_path: str | None = ...,
        volume_capability: VolumeCapability | _Mapping | None = ...,
        readonly: bool | None = ...,
        secrets: _Mapping[str, str] | None = ...,
        volume_context: _Mapping[str, str] | None = ...,
    ) -> None: ...

class NodePublishVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeUnpublishVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "target_path")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    target_path: str
    def __init__(self, volume_id: str | None = ..., target_path: str | None = ...) -> None: ...

class NodeUnpublishVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeGetVolumeStatsRequest(_message.Message):
    __slots__ = ("volume_id", "volume_path", "staging_target_path")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    VOLUME_PATH_FIELD_NUMBER: _ClassVar[int]
    STAGING_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    volume_path: str
    staging_target_path: str
    def __init__(
        self, volume_id: str | None = ..., volume_path: str | None = ..., staging_target_path: str | None = ...
    ) -> None: ...

class NodeGetVolumeStatsResponse(_message.Message):
    __slots__ = ("usage", "volume_condition")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONDITION_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[VolumeUsage]
    volume_condition: VolumeCondition
    def __init__(
        self,
        usage: _Iterable[VolumeUsage | _Mapping] | None = ...,
        volume_condition: VolumeCondition | _Mapping | None = ...,
    ) -> None: ...

class VolumeUsage(_message.Message):
    __slots__ = ("available", "total", "used", "unit")
    class Unit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[VolumeUsage.Unit]
        BYTES: _ClassVar[VolumeUsage.Unit]
        INODES: _ClassVar[VolumeUsage.Unit]

    UNKNOWN: VolumeUsage.Unit
    BYTES: VolumeUsage.Unit
    INODES: VolumeUsage.Unit
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    available: int
    total: int
    used: int
    unit: VolumeUsage.Unit
    def __init__(
        self,
        available: int | None = ...,
        total: int | None = ...,
        used: int | None = ...,
        unit: VolumeUsage.Unit | str | None = ...,
    ) -> None: ...

class VolumeCondition(_message.Message):
    __slots__ = ("abnormal", "message")
    ABNORMAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    abnormal: bool
    message: str
    def __init__(self, abnormal: bool | None = ..., message: str | None = ...) -> None: ...

class NodeExpandVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "volume_path", "capacity_range", "staging_target_path", "volume_capability", "secrets")
    class SecretsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: str | None = ..., value: str | None = ...) -> None: ...

    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    VOLUME_PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_RANGE_FIELD_NUMBER: _ClassVar[int]
    STAGING_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    SECRETS_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    volume_path: str
    capacity_range: CapacityRange
    staging_target_path: str
    volume_capability: VolumeCapability
    secrets: _containers.ScalarMap[str, str]
    def __init__(
        self,
        volume_id: str | None = ...,
        volume_path: str | None = ...,
        capacity_range: CapacityRange | _Mapping | None = ...,
        staging_target_path: str | None = ...,
        volume_capability: VolumeCapability | _Mapping | None = ...,
        secrets: _Mapping[str, str] | None = ...,
    ) -> None: ...

class NodeExpandVolumeResponse(_message.Message):
    __slots__ = ("capacity_bytes",)
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    def __init__(self, capacity_bytes: int | None = ...) -> None: ...

class NodeGetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeGetCapabilitiesResponse(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _containers.RepeatedCompositeFieldContainer[NodeServiceCapability]
    def __init__(self, capabilities: _Iterable[NodeServiceCapability | _Mapping] | None = ...) -> None: ...

class NodeServiceCapability(_message.Message):
    __slots__ = ("rpc",)
    class RPC(_message.Message):
        __slots__ = ("type",)
        class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
            __slots__ = ()
            UNKNOWN: _ClassVar[NodeServiceCapability.RPC.Type]
            STAGE_UNSTAGE_VOLUME: _ClassVar[NodeServiceCapability.RPC.Type]
            GET_VOLUME_STATS: _ClassVar[NodeServiceCapability.RPC.Type]
            EXPAND_VOLUME: _ClassVar[NodeServiceCapability.RPC.Type]
            VOLUME_CONDITION: _ClassVar[NodeServiceCapability.RPC.Type]
            SINGLE_NODE_MULTI_WRITER: _ClassVar[NodeServiceCapability.RPC.Type]
            VOLUME_MOUNT_GROUP: _ClassVar[NodeServiceCapability.RPC.Type]

        UNKNOWN: NodeServiceCapability.RPC.Type
        STAGE_UNSTAGE_VOLUME: NodeServiceCapability.RPC.Type
        GET_VOLUME_STATS: NodeServiceCapability.RPC.Type
        EXPAND_VOLUME: NodeServiceCapability.RPC.Type
        VOLUME_CONDITION: NodeServiceCapability.RPC.Type
        SINGLE_NODE_MULTI_WRITER: NodeServiceCapability.RPC.Type
        VOLUME_MOUNT_GROUP: NodeServiceCapability.RPC.Type
        TYPE_FIELD_NUMBER: _ClassVar[int]
        type: NodeServiceCapability.RPC.Type
        def __init__(self, type: NodeServiceCapability.RPC.Type | str | None = ...) -> None: ...

    RPC_FIELD_NUMBER: _ClassVar[int]
    rpc: NodeServiceCapability.RPC
    def __init__(self, rpc: NodeServiceCapability.RPC | _Mapping | None = ...) -> None: ...

class NodeGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeGetInfoResponse(_message.Message):
    __slots__ = ("node_id", "max_volumes_per_node", "accessible_topology")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_VOLUMES_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    ACCESSIBLE_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    max_volumes_per_node: int
    accessible_topology: Topology
    def __init__(
        self,
        node_id: str | None = ...,
        max_volumes_per_node: int | None = ...,
        accessible_topology: Topology | _Mapping | None = ...,
    ) -> None: ...
