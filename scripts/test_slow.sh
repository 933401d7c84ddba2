#!/usr/bin/env bash
# Install, then run the long multi-rank sweeps (4-rank parity, 2-rank delayed update, ...) that the
# default suite leaves out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest -m slow "$@"
