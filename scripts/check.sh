#!/usr/bin/env bash
# The checks that need no mount: lint and format (ruff) and types (mypy), as configured in
# pyproject.toml. Each failure is printed where it is; the script fails if any check does.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
.venv/bin/ruff check --quiet src testing scripts tests || failed+=("ruff check (fix: .venv/bin/ruff check --fix)")
.venv/bin/ruff format --quiet --check src testing scripts tests || failed+=("ruff format (fix: .venv/bin/ruff format)")
.venv/bin/mypy || failed+=("mypy")
if [ ${#failed[@]} -gt 0 ]; then
    printf 'check: failed: %s\n' "${failed[@]}" >&2
    exit 1
fi
