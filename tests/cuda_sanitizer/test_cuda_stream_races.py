"""Stream races, one parity case per ZeRO stage and placement, under PyTorch's CUDA sanitizer:
run with ``TORCH_CUDA_SANITIZER=1`` (``scripts/gpu_check.sh``, step ``sanitizer``), which
records every kernel's reads and writes per stream and fails the test on an access that no
event, wait or synchronisation orders after a write on another stream. Tiny models, few steps:
the sanitizer runs every op through Python. Skipped without CUDA or without the variable (the
other CUDA tests run these placements without it)."""

from __future__ import annotations

import os

import pytest
import torch
from parity import engine_config, make_model, run_cases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        os.environ.get("TORCH_CUDA_SANITIZER", "") in ("", "0"),
        reason="run with TORCH_CUDA_SANITIZER=1",
    ),
]

S3 = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 300}
PIN = {"pin_memory": True}
CASES = {
    "stage0-device": dict(stage=0, offload=False),
    "stage1-device": dict(stage=1, offload=False),
    "stage2-device": dict(stage=2, offload=False),
    "stage1-host": dict(stage=1, offload=True, **PIN),
    "stage2-host": dict(stage=2, offload=True, **PIN),
    "stage3-device": dict(stage=3, offload=False, zero_extra=S3),
    "stage3-host-params-host": dict(stage=3, offload=True, offload_param=True, zero_extra=S3),
    "stage3-nvme-params-nvme": dict(
        stage=3, offload="nvme", offload_param="nvme", zero_extra=S3, **PIN
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_no_stream_race(name: str, tmp_path) -> None:
    case = dict(CASES[name], gas=2, clip=0.05, overlap=True, steps=3)
    if "nvme" in name:
        case["nvme_path"] = str(tmp_path)
    (r,) = run_cases([case])
    torch.cuda.synchronize()
    assert r["grad_err"] < 1e-4, r["case"]
    assert r["param_err"] < 1e-3, r["case"]


def test_delayed_update_has_no_stream_race() -> None:
    """Stage 2 with the delayed update: the host pass of step k overlaps step k+1's forward and
    backward (its parity is a step behind, so only the run itself is checked)."""
    import zero_offload

    cfg = engine_config(stage=2, offload=True, gas=1, micro=2, clip=1.0, overlap=True,
                        dtype="bf16", pin_memory=True, delayed_update=True,
                        delayed_update_after=0)  # fmt: skip
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    x = torch.randint(0, 32, (2, 5), device=engine.device)
    for _ in range(3):
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    engine.flush_delayed_update()
    torch.cuda.synchronize()
    assert torch.isfinite(loss)
