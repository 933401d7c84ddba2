"""GPU probe: stages 0/1 with ``grad_accum_dtype: "fp32"`` and ``overlap_comm``. The compute
stream is held open (``torch.cuda._sleep``) just before each bucket's ``accum.add_``, so a
reduce stream that waited before the add was queued reads ``accum`` first: the norm, the clip
factor and the update would differ from the run without overlap. They must be equal."""

from __future__ import annotations

import pytest
import torch
from parity import batches, engine_config, make_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GAS, MICRO, STEPS = 2, 2, 2
SLEEP_CYCLES = 20_000_000  # ~10 ms at GPU clocks: far longer than the norm's kernels


def _run(stage: int, overlap: bool, monkeypatch) -> tuple[list[float], list[torch.Tensor]]:
    import zero_offload
    from zero_offload.runtime.reduce.grad_shard import GradShard

    orig = GradShard.bucket_input

    def held_open(self, b):
        if self.accum is not None:
            torch.cuda._sleep(SLEEP_CYCLES)  # on the compute stream, before the add
        return orig(self, b)

    monkeypatch.setattr(GradShard, "bucket_input", held_open)
    cfg = engine_config(stage, False, GAS, MICRO, 0.01, overlap=overlap, dtype="bf16")
    cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    torch.manual_seed(0)
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    norms = []
    for x, y in batches(STEPS, 1, GAS, MICRO):
        x, y = x.to(engine.device), y.to(engine.device)
        for k in range(GAS):
            sl = slice(k * MICRO, (k + 1) * MICRO)
            engine.backward(engine(x[sl], y[sl]))
            engine.step()
        norms.append(float(engine.get_global_grad_norm()))
    params = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    engine.destroy()
    monkeypatch.undo()
    return norms, params


@pytest.mark.parametrize("stage", [0, 1])
def test_overlap_equals_no_overlap_with_the_add_held_open(stage, monkeypatch):
    ref_norms, ref_params = _run(stage, False, monkeypatch)
    norms, params = _run(stage, True, monkeypatch)
    assert norms == ref_norms
    for a, b in zip(params, ref_params):
        assert torch.equal(a, b)
