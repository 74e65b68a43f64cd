#!/usr/bin/env bash
# README's first command: set up .venv (scripts/setup.sh), train the tiny example language model
# with checkpoints, and print where they went. Extra arguments go to scripts/train.py, e.g.
#   bash scripts/run-example.sh --save-folder /tmp/ckpts --steps 100
# Run it again with the same save folder and it resumes from the newest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NO_GCE_CHECK=true
.venv/bin/python scripts/train.py configs/train-tiny.yaml "$@"
