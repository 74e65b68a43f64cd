#!/usr/bin/env bash
# Create .venv (if missing) and install trainckpt with its test tools. Idempotent and quick when
# everything is already installed. torch is pinned first: an unpinned torch can pull a multi-GB
# CUDA build, and pip then keeps the CPU build for every package that asks for "torch>=...".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.trainckpt-installed
want=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[test]"
  # torchtitan for its tests without its training-only dependencies (see pyproject's test extra)
  .venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0"
  echo "$want" > "$stamp"
fi
