#!/usr/bin/env bash
# README's first command: set up .venv (scripts/setup.sh), train the tiny example language model
# with checkpoints, and print where they went. Extra arguments go to scripts/train.py, e.g.
#   bash scripts/run-example.sh --save-folder /tmp/ckpts --steps 100
# Run it again with the same save folder and it resumes from the newest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_GCE_CHECK=true
echo "run-example: training the tiny example model (300 steps, under a minute on 2 CPU cores," \
  "after a few seconds of imports); checkpoints are listed at the end" >&2
.venv/bin/python scripts/train.py configs/train-tiny.yaml "$@"
