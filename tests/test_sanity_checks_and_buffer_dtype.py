"""DeepSpeed's ``zero_optimization.enable_sanity_checks`` (stage 3: an in-place edit inside
``GatheredParameters`` without ``modifier_rank`` refused on every rank) and
``data_types.buffer_dtype`` (floating buffers cast when the engine is built)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

import zero_offload


def _config(**zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        return (self.b(self.a(x))).sum()


def _both(fn) -> list:
    return [fn(True), fn(False)]


def _edit_without_modifier(checks: bool) -> list:
    torch.manual_seed(0)
    engine = zero_offload.initialize(model=Branchy(), config=_config(enable_sanity_checks=checks))[
        0
    ]
    w = engine.module.a.weight
    assert all(p.numel() == 0 for p in engine.module.parameters())  # really partitioned
    with zero_offload.zero.GatheredParameters(w):
        before = w.detach().clone()
    got = "kept quiet"
    try:
        with zero_offload.zero.GatheredParameters(w):
            if tdist.get_rank() == 1:
                with torch.no_grad():
                    w.add_(1.0)  # only rank 1 edits: every rank must learn it
    except RuntimeError as e:
        got = str(e)
    with zero_offload.zero.GatheredParameters(w):
        discarded = torch.equal(w, before)
    engine.destroy()
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, (got, discarded))
    return out


def test_sanity_checks_refuse_an_in_place_edit_without_modifier_rank() -> None:
    from distributed import run_ranks

    on, off = run_ranks(2, _both, _edit_without_modifier)
    for got, discarded in on:
        assert "in-place modification" in got and "modifier_rank" in got
        assert discarded
    assert [g for g, _ in off] == ["kept quiet"] * 2


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.rand(4, dtype=torch.float32))
        self.register_buffer("count", torch.arange(3))

    def forward(self, x):
        return (self.lin(x) * self.inv_freq.to(x.dtype)).sum()


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("buffer_dtype", [None, "bf16", "FP16"])
def test_buffer_dtype_casts_floating_buffers(stage: int, buffer_dtype) -> None:
    cfg = _config()
    cfg["zero_optimization"]["stage"] = stage
    if buffer_dtype is not None:
        cfg["data_types"] = {"buffer_dtype": buffer_dtype}
    model = WithBuffers()
    expected = model.inv_freq.clone()
    engine = zero_offload.initialize(model=model, config=cfg)[0]
    want = {None: torch.float32, "bf16": torch.bfloat16, "FP16": torch.float16}[buffer_dtype]
    assert engine.module.inv_freq.dtype == want
    assert torch.equal(engine.module.inv_freq, expected.to(want))
    assert engine.module.count.dtype == torch.int64
    engine.backward(engine(torch.randn(2, 4)))
    engine.step()
    engine.destroy()


def _init_params_edit() -> list:
    """DeepSpeed's TestGatheredParametersAllRanksErrorOnModification: zero.Init params, no
    engine, every rank edits."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    cfg["zero_optimization"]["enable_sanity_checks"] = True
    with zero_offload.zero.Init(config_dict_or_path=cfg):
        model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    try:
        with zero_offload.zero.GatheredParameters([model[0].weight, model[1].weight]):
            with torch.no_grad():
                model[0].weight.add_(0.0)
        got = "kept quiet"
    except RuntimeError as e:
        got = "in-place modification" in str(e)
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, got)
    return out


def test_sanity_checks_for_zero_init_params_before_any_engine() -> None:
    from distributed import run_ranks

    assert run_ranks(2, _init_params_edit) == [True, True]
