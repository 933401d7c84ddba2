"""Each placement's update path (device, host, NVMe) on one flat group equals
torch's AdamW on the same params, driven by the group's step protocol (stage, commit); NVMe: a
rolled back staged step leaves the state at the last committed one."""

import pytest
import torch
from components import HYPER, feed, optimizer_group, tiny_params


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in tiny_params()]


def _reference(steps: int) -> list[torch.Tensor]:
    params = tiny_params()
    opt = torch.optim.AdamW(params, **HYPER)
    for t in range(steps):
        for p, g in zip(params, _grads(t)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _run(og, steps: int) -> None:
    for t in range(steps):
        feed(og, list(reversed(_grads(t))))  # flat order is reverse registration order
        og.stage(1.0, t)
        og.commit()
        og.grads.zero()


@pytest.mark.parametrize("where", ["device", "host", "nvme"])
def test_each_placement_equals_torch_adamw(where, tmp_path):
    params = tiny_params()
    og = optimizer_group(params, where, tmp_path)
    assert og.placement.optimizer == where and og.state.where == where
    _run(og, 3)
    assert og.save().step_count == 3
    for got, want in zip(params, _reference(3)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)


def test_nvme_rollback_keeps_the_committed_step(tmp_path):
    params = tiny_params()
    og = optimizer_group(params, "nvme", tmp_path)
    _run(og, 1)
    committed = [p.detach().clone() for p in params]
    feed(og, list(reversed(_grads(1))))
    og.stage(1.0, 1)  # written, some chunks already in the params
    og.rollback()
    assert og.save().step_count == 1
    for got, want in zip(params, committed):
        assert torch.equal(got.detach(), want)
    master = og.state.read("master", 0, og.flat.layout.total)
    torch.testing.assert_close(master[:3000], params[2].detach().flatten())
