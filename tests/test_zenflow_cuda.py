"""ZenFlow on CUDA (one GPU): stages 2 and 3 (the param shard in device memory or in pinned host
memory), with and without ``overlap_step``, train as the plain-PyTorch reference of DeepSpeed's
algorithm (on the CPU) says; stage 3 trains as stage 2 on the same GPU, "auto" included; the
device part's moments live on the GPU. Skipped without an NVIDIA GPU."""

from __future__ import annotations

import os

import pytest
import torch
from test_zenflow import AUTO, max_diff, reference
from zenflow_run import TOPK, batches, config, make_model

import zero_offload
from zero_offload.runtime.update.zenflow.update import ZenFlowRunner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

OVERLAP = {**TOPK, "overlap_step": True, "select_interval": 3, "full_warm_up_rounds": 1}
HOST = {"offload_param": {"device": "cpu", "pin_memory": True}}


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))


def _run(zf: dict, stage: int, zero: dict | None = None, steps: int = 7):
    cfg = config(zf, 0.0, stage)
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    cfg["zero_optimization"].update(zero or {})
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)  # fmt: skip
    update = engine.opt_groups[0].optimizer
    assert isinstance(update.runner, ZenFlowRunner) and engine.device.type == "cuda"
    out = []
    for x, y in batches(steps):
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        params = list(engine.module.parameters())
        with zero_offload.zero.GatheredParameters(params):
            out.append([p.detach().float().cpu().clone() for p in params])
    moments = [c.exp_avg for c in update.columns if c.exp_avg is not None]
    assert moments and all(m.is_cuda for m in moments)
    return out


@pytest.mark.parametrize(
    "zf, stage, zero",
    [(TOPK, 2, None), (TOPK, 3, None), (TOPK, 3, HOST), (OVERLAP, 2, None), (OVERLAP, 3, HOST)],
    ids=["stage2", "stage3", "stage3_host", "stage2_overlap", "stage3_host_overlap"],
)
def test_cuda_zenflow_equals_reference(zf, stage, zero):
    got = _run(zf, stage, zero)
    assert max_diff(got, reference(zf, 7)) < 1e-4


@pytest.mark.parametrize("zf", [TOPK, AUTO], ids=["fixed", "auto"])
def test_cuda_zenflow_stage3_equals_stage2(zf):
    two = _run(zf, 2)
    assert max_diff(_run(zf, 3), two) < 1e-6
    assert max_diff(_run(zf, 3, HOST), two) < 1e-6


def test_cuda_device_part_moves_in_one_copy_each_way(monkeypatch):
    """Stage 3, the param shard in pinned host memory: per micro-step the device part's
    gradient and values go up, and its new values come down, in one batched copy each (not one
    per param), and the shard positions are int32 (``tests/test_zenflow_hot_paths.py`` on the
    CPU)."""
    from zero_offload.runtime.update.zenflow import update as update_mod
    from zero_offload.runtime.update.zenflow import values as values_mod

    crossings = []
    real = values_mod.transfer_all

    def counted(ts, device):
        crossings.append(sum(t.device != device for t in ts))
        return real(ts, device)

    monkeypatch.setattr(values_mod, "transfer_all", counted)
    monkeypatch.setattr(update_mod, "transfer_all", counted)
    cfg = config(TOPK, 0.0, 3)
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, **HOST)
    model = make_model()
    engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)  # fmt: skip
    for x, y in batches(4):
        before = len(crossings)
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        assert 1 <= sum(1 for c in crossings[before:] if c) <= 3  # up: grad, values; down
    values = engine.opt_groups[0].optimizer.runner.values
    assert all(ix.dtype == torch.int32 for ix in values.index)
    engine.destroy()
