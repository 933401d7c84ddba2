"""Stage 3's memory-efficient linear (DeepSpeed's ``memory_efficient_linear``, default true):
a released slot's gathered bucket is freed at once, not kept by autograd until the backward
(``weight.t()`` saved by torch's own linear), and the gradients are those of torch's linear."""

from __future__ import annotations

import copy

import pytest
import torch

import zero_offload

CFG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
    },
    "steps_per_print": 10**9,
}


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.layers:
            x = torch.tanh(m(x))
        return self.head(x).square().mean()


def _run(efficient: bool):
    torch.manual_seed(0)
    model = Net()
    cfg = copy.deepcopy(CFG)
    cfg["zero_optimization"]["memory_efficient_linear"] = efficient
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
    refs = []

    def keep_ref(m, args):  # after the engine's fetch: the gathered bucket, weakly
        assert m.weight.numel() > 0
        refs.append(m.weight.untyped_storage()._weak_ref())

    hooks = [m.register_forward_pre_hook(keep_ref) for m in model.layers]
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(1))
    loss = engine(x)
    alive = sum(not torch.UntypedStorage._expired(r) for r in refs)
    for h in hooks:
        h.remove()
    engine.backward(loss)
    from zero_offload.utils import safe_get_full_grad

    grads = {n: safe_get_full_grad(p).clone() for n, p in model.named_parameters()}
    engine.step()
    for r in refs:
        torch.UntypedStorage._free_weak_ref(r)
    engine.destroy()
    return alive, grads, float(loss)


def test_released_buckets_are_freed_and_grads_match_torch():
    alive, grads, loss = _run(True)
    assert alive == 0, f"{alive} released buckets still held by autograd"
    alive_plain, grads_plain, loss_plain = _run(False)
    assert alive_plain > 0  # torch's own linear keeps them: the check above can fail
    assert loss == loss_plain
    for n, g in grads_plain.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("efficient", [True, False])
def test_destroy_restores_linear_forward(efficient):
    torch.manual_seed(0)
    model = Net()
    cfg = copy.deepcopy(CFG)
    cfg["zero_optimization"]["memory_efficient_linear"] = efficient
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    swapped = "forward" in model.head.__dict__
    engine.destroy()
    assert swapped == efficient
    assert "forward" not in model.head.__dict__


def test_attached_linear_pickles_and_copies():
    import pickle

    from zero_offload.runtime.stage3.memory_efficient_linear import attach, detach

    layer = torch.nn.Linear(4, 3)
    assert attach(layer) == [layer]
    for clone in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert clone.forward.layer is clone  # the copy runs through its own weight
        x = torch.randn(2, 4)
        torch.testing.assert_close(
            clone(x), torch.nn.functional.linear(x, clone.weight, clone.bias)
        )
    detach([layer])
    assert "forward" not in layer.__dict__
