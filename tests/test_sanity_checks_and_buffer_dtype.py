"""DeepSpeed's ``zero_optimization.enable_sanity_checks`` (stage 3: ranks' gather orders compared
in every training backward, not only the first; an in-place edit inside
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
    """Runs ``a`` or ``b`` depending on the data: ranks diverge when their inputs differ."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        return (self.b(x) if use_b else self.a(x)).sum()


def _diverge_in_second_step(checks: bool) -> list:
    torch.manual_seed(0)
    engine = zero_offload.initialize(model=Branchy(), config=_config(enable_sanity_checks=checks))[
        0
    ]
    assert all(p.numel() == 0 for p in engine.module.parameters())
    got = "trained"
    try:
        for step in range(2):
            use_b = step == 1 and tdist.get_rank() == 1  # step 1: rank 1 takes the other branch
            engine.backward(engine(torch.randn(2, 4), use_b))
            engine.step()
    except Exception as e:  # noqa: BLE001 (the outcome is compared)
        got = f"{type(e).__name__}: {e}"
    engine.destroy()
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, got)
    return out


def _both(fn) -> list:
    return [fn(True), fn(False)]


def test_sanity_checks_compare_the_gather_order_every_step() -> None:
    from distributed import run_ranks

    on, off = run_ranks(2, _both, _diverge_in_second_step)
    assert all("different orders in training backward 2" in m for m in on), on
    assert off == ["trained", "trained"]  # same sizes: nothing notices without the checks


def _edit_without_modifier(checks: bool) -> list:
    torch.manual_seed(0)
    engine = zero_offload.initialize(model=Branchy(), config=_config(enable_sanity_checks=checks))[
        0
    ]
    w = engine.module.a.weight
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
