#!/usr/bin/env bash
# Create .venv (if missing) and install trainckpt with its test tools. Idempotent and quick when
# everything is already installed. torch is pinned first: an unpinned torch can pull a multi-GB
# CUDA build, and pip then keeps the CPU build for every package that asks for "torch>=...".
# Says what it is doing on stderr: the first run downloads about 1 GB and takes a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
stamp=.venv/.trainckpt-installed
want=$(cat pyproject.toml scripts/setup.sh src/trainckpt/format/*.c src/trainckpt/format/safe_unpickle/*.c | sha1sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  start=$SECONDS
  say "installing into .venv (first run: about 1 GB of downloads, typically 2-5 minutes;"
  say "later runs skip this until pyproject.toml or this script changes)"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  say "1/3 torch==${TORCH_VERSION:-2.13.0} (CPU build, the largest download)"
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  say "2/3 trainckpt and its test and docs tools (-e '.[test]': pytest, ruff, mypy, OLMo-core, moto, mkdocs, ...)"
  .venv/bin/python -m pip install -q -e ".[test]"
  # torchtitan for its tests without its training-only dependencies (see pyproject's test extra)
  say "3/3 torchtitan==0.3.0 (without its training-only dependencies)"
  .venv/bin/python -m pip install -q --no-deps "torchtitan==0.3.0"
  echo "$want" > "$stamp"
  say "done in $((SECONDS - start)) s"
else
  say ".venv is up to date"
fi
