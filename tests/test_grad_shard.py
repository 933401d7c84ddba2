"""GradShard: stages 0/1 make p.grad views of a flat grad buffer; stage 2 writes the first
backward's reduced segments, adds later ones, and at the window's end sums the squared norm and
(offload) copies the final gradient to the host."""

import torch
from components import CPU, flat_group, tiny_params

from zero_offload.core.streams import Streams
from zero_offload.runtime.reduce.grad_shard import GradShard


def test_stage1_grads_are_views_of_the_flat_grad():
    g = flat_group(tiny_params())
    gs = GradShard(g, 1, False, 1, Streams(CPU), False)
    for p in g.params:
        p.grad.fill_(2.0)
    assert bool((gs.flat_grad[: g.layout.offsets[-1] + g.params[-1].numel()] != 0).any())
    gs.zero()
    assert not gs.flat_grad.any() and all(not p.grad.any() for p in g.params)


def _fold(gs, value: float, first: bool, last: bool) -> None:
    gs.begin_backward(first)
    for seg in gs.segs:
        reduced = torch.full((seg.numel,), value)
        target = gs.reduce_target(seg)
        if target is not None:
            target.copy_(reduced)
            reduced = target
        gs.accept(seg, reduced, last)


def test_stage2_offload_accumulates_then_copies_to_the_host():
    g = flat_group(tiny_params())
    gs = GradShard(g, 2, True, 2, Streams(CPU), False)  # GAS 2: a device accumulator
    _fold(gs, 1.0, first=True, last=False)
    _fold(gs, 2.0, first=False, last=True)
    numel = g.shard_numel(True)
    assert torch.equal(gs.host_grad()[:numel], torch.full((numel,), 3.0))
    assert abs(float(gs.sumsq) - 9.0 * numel) < 1e-2
    gs.zero()
    _fold(gs, 5.0, first=False, last=True)  # after zero(): the next backward writes
    assert torch.equal(gs.host_grad()[:numel], torch.full((numel,), 5.0))
