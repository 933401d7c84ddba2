#!/usr/bin/env bash
# Install, then run the test suite (CPU; multi-rank tests spawn gloo ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
