#!/usr/bin/env bash
# The GPU check: what a lent GPU machine (one command of at most 10 minutes, no network) runs
# first, in at most 8 minutes, figures first; on a machine without CUDA the same command is its
# CPU rehearsal (every step's wiring, the CUDA steps reported skipped). docs/gpu.md says what
# each step does; scripts/gpu_rehearse.sh rehearses the lease itself (offline, Python 3.12).
#
#   bash scripts/gpu_check.sh OUTDIR [--rehearsal] [--install] [--cap SECONDS]
#                                    [--steps NAME... | --failed]
#
# OUTDIR gets summary.json (each step: name, status, seconds, details file), the steps' logs
# (install, bench, cuda_tests, cuda_probes, sanitizer), data.tgz (the benchmarks' JSON): at
# most 8 files. --failed (a second call on the same machine) reruns only what the last call left
# failed, timed out or unreached; GPU_CHECK_STEPS="a b" is --steps. PYTHON picks the
# interpreter (default python3). The check stops its steps at its cap; `timeout` here is only
# the backstop that keeps one command under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec timeout -k 10 540 "$PY" scripts/gpu_check.py --python "$PY" "$@"
