"""ZeRO-3 leaf modules: DeepSpeed's ``set_z3_leaf_modules`` family and the
``zero_optimization.leaf_module`` config key. A leaf is fetched whole, so a Mixture-of-Experts
block whose experts run by the data (differently on each rank) trains, on 2 ranks, like plain
PyTorch on the global batch; a Hugging Face Mixtral's MoE blocks are leaves by default."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import displacement_err, engine_config

import zero_offload
from zero_offload.utils import (
    get_z3_leaf_modules,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

D, EXPERTS, MICRO, STEPS = 8, 4, 4, 3


class Routed(torch.nn.Module):
    """Top-1 routing that calls only the experts some token chose: which expert modules run
    depends on the data."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(D, EXPERTS)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, choice = torch.softmax(self.gate(x), -1).max(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(x[rows]) * weight[rows, None])
        return out


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.moe = Routed()
        self.out = torch.nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.out(torch.relu(self.moe(self.inp(x)))).squeeze(-1) - y).square().mean()


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _data(world: int):
    g = torch.Generator().manual_seed(3)
    n = world * MICRO
    return [(torch.randn(n, D, generator=g), torch.randn(n, generator=g)) for _ in range(STEPS)]


def _config(offload: bool, how: str) -> dict:
    zero = {"stage3_param_persistence_threshold": 0}
    if how == "config-class":
        zero["leaf_module"] = {"classes": ["Routed"]}
    elif how == "config-name":
        zero["leaf_module"] = {"names": ["moe"]}
    return engine_config(
        3, offload, 1, MICRO, 0.0, overlap=True, offload_param=offload, zero_extra=zero
    )


def _reference(world: int):
    model = _net()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    for x, y in _data(world):
        opt.zero_grad()
        model(x, y).backward()
        for p in model.parameters():  # an expert no token chose: reduced as zeros
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return init, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(offload: bool, how: str, world: int = 1, rank: int = 0):
    from zero_offload.utils import safe_get_full_fp32_param

    model = _net()
    if how == "api":
        assert set_z3_leaf_modules(model, [Routed]) == [model.moe]
    engine, *_ = zero_offload.initialize(model=model, config=_config(offload, how))
    assert get_z3_leaf_modules(model) == [model.moe]
    assert all(z3_leaf_parameter(p) for p in model.moe.parameters())
    assert not z3_leaf_parameter(model.inp.weight)
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned
    for x, y in _data(world):
        lo = rank * MICRO
        engine.backward(engine(x[lo : lo + MICRO], y[lo : lo + MICRO]))
        engine.step()
    out = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    engine.destroy()
    return out


@pytest.mark.parametrize("how", ["api", "config-class", "config-name"])
@pytest.mark.parametrize("offload", [False, True])
def test_leaf_moe_matches_plain_pytorch_one_rank(offload, how):
    init, ref = _reference(1)
    assert displacement_err(_train(offload, how), ref, init) < 1e-3


def _two_ranks():
    rank = zero_offload.comm.get_rank()
    return {(o, h): _train(o, h, 2, rank) for o in (False, True) for h in ("api", "config-name")}


def test_leaf_moe_with_rank_dependent_experts_two_ranks():
    """The two ranks route their own tokens, so without a leaf they would call different expert
    modules (and gather different params); as a leaf the block fetches every expert."""
    model = _net()
    halves = [x[r * MICRO : (r + 1) * MICRO] for x, _ in _data(2) for r in range(2)]
    with torch.no_grad():
        used = [set(model.moe.gate(model.inp(h)).argmax(-1).tolist()) for h in halves]
    assert any(a != b for a, b in zip(used[::2], used[1::2]))  # the ranks do differ
    init, ref = _reference(2)
    for key, got in run_ranks(2, _two_ranks).items():
        assert displacement_err(got, ref, init) < 1e-3, key


def test_leaf_api_semantics():
    model = _net()
    with pytest.raises(ValueError, match="No modules of type"):
        set_z3_leaf_modules(model, [torch.nn.Conv1d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv1d], raise_if_not_found=False) == []
    assert set_z3_leaf_modules(model, ["test_leaf_modules.Routed"]) == [model.moe]  # qualified
    assert z3_leaf_module(model.moe) and not z3_leaf_module(model)
    assert unset_z3_leaf_modules(model, ["Routed"]) == [model.moe]
    assert get_z3_leaf_modules(model) == []
    with pytest.raises(TypeError, match="module classes"):
        set_z3_leaf_modules(model, [3])


def test_hf_mixtral_moe_blocks_are_leaves_by_default():
    transformers = pytest.importorskip("transformers")
    from zero_offload.hf import CausalLMLoss

    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    ref = CausalLMLoss(copy.deepcopy(hf))
    model = CausalLMLoss(hf)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 9), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    zc = engine_config(3, True, 1, 2, 0.0, overlap=True, offload_param=True)
    zc["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = zero_offload.initialize(model=model, config=zc)
    blocks = get_z3_leaf_modules(model)
    assert len(blocks) == 2 and all(type(b).__name__ == "MixtralSparseMoeBlock" for b in blocks)
    loss = engine(x, y)
    with torch.no_grad():
        assert float(loss) == pytest.approx(float(ref(x, y)), rel=1e-5)
    engine.backward(loss)
    engine.step()
    engine.destroy()
