#!/usr/bin/env bash
# Regenerate the CSI message classes from csi/csi.proto (needs the test extra's grpcio-tools).
# tests/csi/test_proto.py fails when the checked-in module and the proto disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src/tierfs/csi}
.venv/bin/python -m grpc_tools.protoc -I csi --python_out="$out" csi/csi.proto
