"""Reducer at world 1: the post-accumulate-grad hooks move each param's gradient into the grad
shard (stage 2) or leave it in the flat grad buffer (stage 0), scaled by the grad factor."""

import pytest
import torch
from components import CPU, flat_group, tiny_params

from zero_offload.core.streams import Streams
from zero_offload.runtime.backward_scope import ENGINE, BackwardScope
from zero_offload.runtime.reduce.grad_shard import GradShard
from zero_offload.runtime.reduce.reducer import Reducer


def _backward(params, weights, stage: int, factor: float) -> GradShard:
    g = flat_group(params)
    streams = Streams(CPU)
    gs = GradShard(g, stage, False, 1, streams, False)
    scope = BackwardScope(lambda driver: reducer.prepare(True, True, factor))
    positions = {id(p): i for i, p in enumerate(g.params)}
    reducer = Reducer([g], [gs], stage, False, True, streams, positions, scope)
    scope.begin(ENGINE)
    loss = sum((p * w).sum() for p, w in zip(params, weights))
    scope.attach_loss(loss)
    loss.backward()
    scope.end()
    reducer.remove()
    return gs


@pytest.mark.parametrize("stage", [0, 2])
def test_reduced_gradient_lands_in_the_grad_shard(stage):
    params = tiny_params()
    weights = [torch.randn(p.shape) for p in params]
    gs = _backward(params, weights, stage, 0.5)
    got = torch.cat(gs.device_grads())
    flat = torch.zeros(gs.group.layout.total)
    for view, w in zip(gs.group.param_views(flat), reversed(weights)):
        view.copy_(w)
    want = torch.cat([flat[s.flat_start : s.flat_start + s.numel] for s in gs.segs])
    torch.testing.assert_close(got, want * 0.5)
    assert float(gs.sumsq) == pytest.approx(float((want * 0.5).square().sum()), rel=1e-5)
