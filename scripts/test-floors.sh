#!/usr/bin/env bash
# Run the test suite against the oldest release of each dependency that pyproject.toml
# allows, in .venv-floors. `scripts/test.sh` tests the newest releases; users who install
# tierfs into an environment with pinned packages get the oldest ones, so every floor in
# pyproject.toml has to be one the suite passed on. Extra arguments go to pytest.
#
# The resolution is uv's `lowest-direct`: each package pyproject.toml names at its floor,
# what those need at whatever version satisfies them.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
[ -x .venv/bin/uv ] || .venv/bin/pip install -q --disable-pip-version-check uv
[ -x .venv-floors/bin/python ] || .venv/bin/uv venv -q -p "$(command -v python3)" .venv-floors
# Bytecode compiled at install, as pip does: the tests start many daemons.
VIRTUAL_ENV="$PWD/.venv-floors" .venv/bin/uv pip install -q --compile-bytecode \
    --resolution lowest-direct -e ".[test,frameworks]" -e ./testing
.venv-floors/bin/python -m compileall -q src/tierfs testing/tierfs_testing >/dev/null
exec .venv-floors/bin/python -m pytest "$@"
