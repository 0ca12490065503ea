#!/usr/bin/env bash
# Set everything up, check style and types, then run the test suite. Extra arguments go to
# pytest, e.g. `scripts/test.sh -m slow` for the long benchmark-style tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/check.sh
exec .venv/bin/python -m pytest --durations=25 "$@"
