"""Before the first step: the working set the config allows must fit in the memory that is free,
or the run stops now with the key to change, not with an out-of-memory kill part way through.

The terms checked are the ones the engine knows exactly once it is built (reduce buffers, the
full gradients a bucket holds, gathered params); activations depend on the batch the caller
will feed and are predicted by ``engine.expected_memory(seq_length=...)`` instead.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Which config key bounds each working-set term.
TERM_KEYS = {
    "reduce_buffers": "zero_optimization.reduce_bucket_size",
    "held_grads": "zero_optimization.reduce_bucket_size (a module whose gradient is larger is "
    "reduced from that gradient: split the module or partition fewer params)",
    "gathered_params": "zero_optimization.stage3_max_live_parameters",
}


def free_bytes(device: torch.device) -> int | None:
    """Memory free now where the working set goes: the GPU's free memory, or on a CPU the
    host's ``MemAvailable``; None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_working_set(terms: dict[str, int], free: int | None, where: str) -> None:
    """Raise MemoryError naming the key of each term when their sum exceeds ``free``."""
    need = sum(terms.values())
    if free is None or need <= free:
        return
    parts = ", ".join(
        f"{name} {n / 2**20:.1f} MiB (bounded by {TERM_KEYS[name]})"
        for name, n in sorted(terms.items(), key=lambda kv: -kv[1])
        if n
    )
    raise MemoryError(
        f"a training step needs {need / 2**20:.1f} MiB of {where} memory on top of the model "
        f"states ({parts}) but only {free / 2**20:.1f} MiB is free; lower the first key named"
    )
