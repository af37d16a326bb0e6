#!/usr/bin/env bash
# Set up .venv on a fresh machine (idempotent): torch first (CPU build pinned), then dsmt and its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import toolkit, torch, megatron.core, deepspeed, transformers, datasets, peft, pytest, wandb, ruff" 2>/dev/null; then
    .venv/bin/pip install -q --upgrade pip
    .venv/bin/pip install -q -c constraints.txt torch==2.13.0
    .venv/bin/pip install -q -c constraints.txt -e ".[test]"
fi
