"""The checked-in message module matches csi/csi.proto, and the proto matches csi.v1 on the wire.

kubelet, node-driver-registrar and livenessprobe speak the official csi.v1 package; a
wrong field number would be silently ignored or misread, so the numbers kubelet relies on
are checked against the spec's, one by one.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tierfs.csi import csi_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]

# (message, field) -> number, from the CSI spec v1 csi.proto.
SPEC_NUMBERS = {
    ("GetPluginInfoResponse", "name"): 1,
    ("GetPluginInfoResponse", "vendor_version"): 2,
    ("GetPluginInfoResponse", "manifest"): 3,
    ("GetPluginCapabilitiesResponse", "capabilities"): 1,
    ("ProbeResponse", "ready"): 1,
    ("NodePublishVolumeRequest", "volume_id"): 1,
    ("NodePublishVolumeRequest", "publish_context"): 2,
    ("NodePublishVolumeRequest", "staging_target_path"): 3,
    ("NodePublishVolumeRequest", "target_path"): 4,
    ("NodePublishVolumeRequest", "volume_capability"): 5,
    ("NodePublishVolumeRequest", "readonly"): 6,
    ("NodePublishVolumeRequest", "secrets"): 7,
    ("NodePublishVolumeRequest", "volume_context"): 8,
    ("NodeUnpublishVolumeRequest", "volume_id"): 1,
    ("NodeUnpublishVolumeRequest", "target_path"): 2,
    ("NodeGetVolumeStatsRequest", "volume_id"): 1,
    ("NodeGetVolumeStatsRequest", "volume_path"): 2,
    ("NodeGetVolumeStatsResponse", "usage"): 1,
    ("NodeGetVolumeStatsResponse", "volume_condition"): 2,
    ("VolumeUsage", "available"): 1,
    ("VolumeUsage", "total"): 2,
    ("VolumeUsage", "used"): 3,
    ("VolumeUsage", "unit"): 4,
    ("NodeGetCapabilitiesResponse", "capabilities"): 1,
    ("NodeGetInfoResponse", "node_id"): 1,
    ("NodeGetInfoResponse", "max_volumes_per_node"): 2,
    ("NodeGetInfoResponse", "accessible_topology"): 3,
    ("VolumeCapability", "block"): 1,
    ("VolumeCapability", "mount"): 2,
    ("VolumeCapability", "access_mode"): 3,
}


@pytest.mark.parametrize("message, field", sorted(SPEC_NUMBERS))
def test_field_numbers_are_the_specs(message, field):
    assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[field].number == SPEC_NUMBERS[message, field]


def test_package_and_services_are_csi_v1():
    assert pb.DESCRIPTOR.package == "csi.v1"
    node = [m.name for m in pb.DESCRIPTOR.services_by_name["Node"].methods]
    assert {"NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo"} <= set(node)
    assert pb.VolumeCapability.AccessMode.Mode.Value("SINGLE_NODE_MULTI_WRITER") == 7


def test_checked_in_module_is_generated_from_the_proto(tmp_path):
    subprocess.run([str(ROOT / "scripts" / "gen-csi-proto.sh"), str(tmp_path)], check=True)
    source = (tmp_path / "csi_pb2.py").read_text()
    checked_in = Path(pb.__file__).read_text()
    marker = "AddSerializedFile("  # the serialized descriptor: everything but the header
    fresh = source[source.index(marker) :].split("\n", 1)[0]
    assert fresh == checked_in[checked_in.index(marker) :].split("\n", 1)[0], (
        "src/tierfs/csi/csi_pb2.py is stale: run scripts/gen-csi-proto.sh"
    )
    stub = Path(pb.__file__).with_suffix(".pyi")
    assert (tmp_path / "csi_pb2.pyi").read_text() == stub.read_text(), (
        "src/tierfs/csi/csi_pb2.pyi, the types mypy checks the plugin against, is stale: run scripts/gen-csi-proto.sh"
    )
