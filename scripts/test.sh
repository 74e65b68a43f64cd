#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, type-check and run the whole test suite. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k gcs -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_GCE_CHECK=true
.venv/bin/ruff check src tests scripts
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
