"""Small builders for the component tests: one flat group of a tiny fp32 model on the CPU at
world 1 (no process group), and the pieces an optimizer group is made of."""

from __future__ import annotations

from pathlib import Path

import torch

from zero_offload.core.flat_group import FlatGroup
from zero_offload.core.streams import Streams
from zero_offload.nvme.io.aio import AioEngine
from zero_offload.runtime.reduce.grad_shard import GradShard
from zero_offload.runtime.update.group import OptimizerGroup, build_shard_optimizer
from zero_offload.runtime.update.param_home import FlatHome
from zero_offload.runtime.update.placement import NvmePolicy, Placement
from zero_offload.runtime.update.shard_optimizer import UpdatePolicy
from zero_offload.runtime.update.state_build import build_states

CPU = torch.device("cpu")
HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def tiny_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3000,)]  # the last param spans more than one 2048-element chunk
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def flat_group(params, stage: int = 2, bucket: int = 64) -> FlatGroup:
    names = [f"p{i}" for i in range(len(params))]
    return FlatGroup(0, params, names, dict(HYPER), torch.float32, CPU, 1, 0, bucket)


def placement(optimizer: str, tmp_path: Path | None = None) -> Placement:
    nvme = None
    if optimizer == "nvme":
        assert tmp_path is not None
        nvme = NvmePolicy(optimizer_dir=tmp_path / "optimizer", optimizer_buffer_count=3)
    return Placement(optimizer=optimizer, chunk=2048, threads=1, nvme=nvme)


def optimizer_group(params, where: str, tmp_path: Path | None = None, stage: int = 2):
    """An ``OptimizerGroup`` for ``params`` with its optimizer state placed ``where``."""
    place = placement(where, tmp_path)
    g = flat_group(params, stage)
    streams = Streams(CPU)
    aio = AioEngine(place.nvme.aio) if place.nvme is not None else None
    (state,) = build_states([g], stage >= 1, place, aio, True)
    grads = GradShard(g, stage, place.host_update, 1, streams, False)
    home = FlatHome(g, streams, stage >= 1, 1 << 20)
    so = build_shard_optimizer(
        g, grads, home, state, UpdatePolicy(stage >= 1, True, place), streams
    )
    return OptimizerGroup(g, grads, home, so, place)


def feed(og: OptimizerGroup, grads: list[torch.Tensor]) -> None:
    """Put ``grads`` (one per param, flat order) into the group's gradient shard as a completed
    window's last backward would: each segment written, norm and host copy done."""
    og.grads.begin_backward(first=True)
    layout = og.flat.layout
    flat = torch.zeros(layout.total, dtype=og.flat.dtype)
    for p_grad, off, n in zip(grads, layout.offsets, layout.numels):  # stage 3: p is empty
        flat[off : off + n].copy_(p_grad.reshape(-1))
    for seg in og.grads.segs:
        target = og.grads.reduce_target(seg)
        piece = flat[seg.flat_start : seg.flat_start + seg.numel]
        if target is not None:
            target.copy_(piece)
            piece = target
        og.grads.accept(seg, piece, last=True)
