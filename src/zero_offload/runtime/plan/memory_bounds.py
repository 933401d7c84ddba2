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
    """Memory free now where the working set goes: on a GPU what this process can still
    allocate (``cuda_free``), on a CPU the host's ``MemAvailable``; None where it cannot be
    read."""
    if device.type == "cuda":
        return cuda_free(device)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cuda_free(device: torch.device) -> int:
    """What the caching allocator can still hand out: the driver's free memory plus the blocks
    it reserves but does not use (``cudaMemGetInfo`` counts those as used: a warm allocator
    after a freed tensor made a fitting config look too big), within the per-process fraction
    ``torch.cuda.set_per_process_memory_fraction`` set (the allocator stops there even when the
    driver has more)."""
    driver_free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated = torch.cuda.memory_allocated(device)
    free = int(driver_free) + max(0, reserved - allocated)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        free = min(free, int(fraction(device) * total) - allocated)
    return max(0, free)


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
