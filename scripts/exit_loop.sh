#!/usr/bin/env bash
# Run N (default 100) two-rank jobs through `zero-offload launch` and count the runs that did not
# exit 0 or that printed "terminate called" (the exit-time abort this loop guards against).
# Usage: scripts/exit_loop.sh [N] [stage] [offload]
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-100}
STAGE=${2:-1}
MODE=${3:-}
BIN=${ZERO_OFFLOAD_BIN:-.venv/bin/zero-offload}
LOG=$(mktemp -d)
failed=0
aborts=0
for i in $(seq 1 "$N"); do
  port=$((20000 + (RANDOM % 20000)))
  if ! "$BIN" launch --num_gpus 2 --master_port "$port" scripts/exit_job.py "$STAGE" $MODE \
      >"$LOG/run$i.txt" 2>&1; then
    failed=$((failed + 1))
    echo "run $i: exit status non-zero (log kept: $LOG/run$i.txt)"
  fi
  if grep -q "terminate called" "$LOG/run$i.txt"; then
    aborts=$((aborts + 1))
    echo "run $i: terminate called (log kept: $LOG/run$i.txt)"
  fi
done
echo "exit loop: $N two-rank runs (stage $STAGE ${MODE:-no offload}): $failed failed, $aborts aborted"
[ "$failed" -eq 0 ] && [ "$aborts" -eq 0 ]
