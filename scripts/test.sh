#!/usr/bin/env bash
# Set up (scripts/setup.sh), lint, type-check and run the whole test suite, one pytest-xdist
# worker per core (at most 4; TEST_WORKERS overrides). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh -k gcs -x`; `-n 0` runs the tests serially in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_GCE_CHECK=true
.venv/bin/ruff check src tests scripts
.venv/bin/mypy
# the public modules, strictly: what the type checkers of trainckpt's users read
.venv/bin/mypy --strict --follow-imports=silent src/trainckpt/__init__.py \
  src/trainckpt/checkpointer.py src/trainckpt/manager.py src/trainckpt/integrations
cores=$(nproc 2>/dev/null || echo 2)
workers=${TEST_WORKERS:-$((cores < 4 ? cores : 4))}
# --dist loadfile: a file's tests stay on one worker, so its module fixtures are built once;
# --no-loadscope-reorder: files go out in collection order (tests/conftest.py puts the slow first).
status=0
# --max-worker-restart 0: a worker that dies (a native crash) fails the run at once, naming the
# test; pytest-xdist 3.8's loadfile scheduler can otherwise deadlock after replacing the worker.
# --durations 25: every run names its slowest tests, so CI time stays watched.
.venv/bin/python -m pytest -q -n "$workers" --dist loadfile --no-loadscope-reorder \
  --max-worker-restart 0 --durations 25 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "test.sh: pytest collected no tests (exit code 5); that is a failure, not a pass" >&2
fi
exit "$status"
