#!/usr/bin/env bash
# Set everything up, check style and types, then run the test suite. Extra arguments go to
# pytest, e.g. `scripts/test.sh -m slow` for the long benchmark-style tests.
#
# The whole suite (no arguments) runs on two workers: most of a test's time is spent waiting
# for daemons, mounts and the network, not computing. Tests named by arguments run one at a
# time, as benchmarks must; add `-n 2` to spread them too.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/check.sh
workers=()
[ $# -eq 0 ] && workers=(-n 2)
exec .venv/bin/python -m pytest --durations=25 "${workers[@]}" "$@"
