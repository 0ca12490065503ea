#!/usr/bin/env bash
# Set everything up, then run the demo (scripts/demo.py): a volume on a RAM tier backed up
# to a local GCS emulator; a checkpoint committed, deduplicated, lost with its node and
# restored from GCS byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
