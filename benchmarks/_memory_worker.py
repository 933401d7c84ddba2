"""One run of ``memory_model.py`` in a process of its own (fresh RSS): build a GPT-2, initialize
this library's engine or DeepSpeed with the given config, take two steps, then measure a third.

Usage: ``python _memory_worker.py SPEC_JSON OUT_JSON``. Writes:
- ``working``: the most bytes the third step allocated above what was allocated when it began,
  counted from the allocator's own events (PyTorch's memory profiler timeline): allocated bytes,
  as a GPU allocator counts them, not only the pages that were touched;
- ``states``: bytes of every tensor reachable after the steps (what a run keeps between steps:
  params or shards, gradients, master, moments, buffers);
- ``rss_peak``, ``rss_base``: peak and pre-build resident set size;
- for the engine: ``report`` (``memory_report()``) and ``predicted`` (``expected_memory``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]


def rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def step_working_set(step) -> int:
    """Peak bytes allocated during ``step()`` above the bytes allocated when it began."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:  # fmt: skip
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return max(sum(s) for s in sizes) - sum(sizes[0])


def build(spec: dict):
    import torch

    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(num_layers=spec["layers"], hidden_size=spec["hidden"],
                     num_attention_heads=spec["heads"], seq_length=spec["seq"],
                     vocab_size=spec["vocab"], checkpoint_activations=spec["ckpt"])  # fmt: skip
    return GPT2Model(cfg)


def initialize(spec: dict, model):
    if spec["impl"] == "deepspeed":
        import _ds_compat

        params = [{"params": [p for p in model.parameters()]}]
        return _ds_compat.initialize(model, params, spec["config"])
    import zero_offload

    return zero_offload.initialize(model=model, config=spec["config"])[0]


def main(spec_path: str, out_path: str) -> None:
    import torch
    from _step_worker import live_tensor_bytes

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    rss_base = rss_now()
    model = build(spec)
    engine = initialize(spec, model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["vocab"], (spec["micro"], spec["seq"]), generator=g)

    def step() -> None:
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()

    step()
    step()
    working = step_working_set(step)
    out = {
        "working": working,
        "states": live_tensor_bytes().get("cpu", 0),
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_base": rss_base,
    }
    if spec["impl"] == "engine":
        out["report"] = engine.memory_report()
        out["predicted"] = engine.expected_memory(seq_length=spec["seq"])
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
