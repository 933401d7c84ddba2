#!/usr/bin/env bash
# Install, then run the main job: train a small GPT-2 on the built-in corpus (no download).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec zero-offload train "$@"
