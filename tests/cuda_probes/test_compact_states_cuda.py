"""GPU probe: compact optimizer states on CUDA. The device placement (no offload) keeps a bf16
master and bf16 or 8-bit moments on the GPU (the reference arithmetic, its 8-bit tables on the
codes' device); offload "cpu" with ``pin_memory`` keeps them in host memory and the bf16
master uploads itself. Each trains as the fp32-state run of the same script does (to bf16
noise), and the states live where the placement says."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from parity import batches, engine_config, global_step, make_model, with_states

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

STEPS, MICRO = 6, 4


def _cfg(offload: bool, states: str) -> dict:
    cfg = engine_config(2, offload, 1, MICRO, 0.0, False, "bf16", pin_memory=offload)
    return with_states(cfg, states)


def _run(cfg: dict) -> tuple[list[float], object]:
    import zero_offload

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=make_model(), config=copy.deepcopy(cfg))
    losses = []
    for x, y in batches(STEPS, 1, 1, MICRO):
        losses.append(global_step(engine, x.to(engine.device), y.to(engine.device)))
    return losses, engine


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload-cpu"])
@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_compact_states_train_on_cuda(offload, states):
    got, engine = _run(_cfg(offload, states))
    so = engine.opt_groups[0].optimizer
    m = so.state.exp_avg
    held = m if isinstance(m, torch.Tensor) else m.codes
    assert engine.device.type == "cuda" and held.device.type == ("cpu" if offload else "cuda")
    if offload:
        assert so.staging.kind == "none"  # the bf16 master uploads itself
    fp32 = engine_config(2, offload, 1, MICRO, 0.0, False, "bf16", pin_memory=offload)
    want, _ = _run(fp32)  # fp32 states, the same run
    assert all(torch.isfinite(torch.tensor(got)))
    assert got[-1] == pytest.approx(want[-1], rel=0.05) and got[-1] < 0.9 * got[0]
