"""Host update path benchmark: params/s of one ZeRO-Offload host optimizer step (bf16 grad in,
bf16 param out) for this package's kernel, the PyTorch fused AdamW path and DeepSpeedCPUAdam,
against the 28 B/param memory-bandwidth bound measured in the same run.

    python benchmarks/host_update.py                 # 10M, 50M, 200M params
    python benchmarks/host_update.py --sizes 50M     # one size
    python benchmarks/host_update.py --quick         # 1M params (smoke test; fits in cache)

Thin wrapper over zero_offload.kernels.bench (also ``zero-offload bench``).
"""

import sys

from zero_offload.kernels.bench import main

if __name__ == "__main__":
    sys.exit(main())
