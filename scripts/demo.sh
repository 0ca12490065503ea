#!/usr/bin/env bash
# Set everything up, then run the demo (scripts/demo.py): three nodes replicating to each
# other and backing up to a local GCS emulator; a daemon killed and replaced while a file
# is open; a node lost with its RAM and restored from its peer byte for byte.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
