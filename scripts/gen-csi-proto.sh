#!/usr/bin/env bash
# Regenerate the CSI message classes from csi/csi.proto (needs the test extra's grpcio-tools).
# tests/csi/test_proto.py fails when the checked-in module and the proto disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-src/tierfs/csi}
.venv/bin/python -m grpc_tools.protoc -I csi --python_out="$out" --pyi_out="$out" csi/csi.proto
# The stub is checked like the code: the house's format, and a header saying what it is.
.venv/bin/ruff format --quiet "$out/csi_pb2.pyi"
.venv/bin/ruff check --quiet --fix --exit-zero "$out/csi_pb2.pyi" >/dev/null
{
    printf '%s\n' "# The types of csi_pb2.py, for mypy: generated with it (grpc_tools.protoc --pyi_out, from" \
        "# csi/csi.proto), then \`ruff check --fix\` and \`ruff format\`. \`type\` is a field the CSI spec names." \
        "# ruff: noqa: A002"
    cat "$out/csi_pb2.pyi"
} > "$out/csi_pb2.pyi.new" && mv "$out/csi_pb2.pyi.new" "$out/csi_pb2.pyi"
.venv/bin/ruff format --quiet "$out/csi_pb2.pyi"
