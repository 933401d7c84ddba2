"""A client ``torch.optim.Optimizer`` (SGD, Lion, a custom one, ...) run over this rank's fp32
master shard, where the built-in Adam(W) path does not apply.

As in DeepSpeed, the client's update runs on the flattened partition: one 1-D fp32 tensor per
param group holding this rank's slices of many params (and bucket padding, whose gradient is
zero). Elementwise updates are therefore exact; an optimizer whose update depends on a param's
shape or on whole-tensor statistics (Adafactor's factored moments, LAMB's trust ratio, Shampoo,
Muon) sees flat slices instead and is not the same optimizer: such optimizers are out of scope,
as they are in DeepSpeed's ZeRO.

The client object the caller built is left as it was; the engine runs a shallow copy of it
(same class and attributes) whose only param group is the master shard and whose state is its
own. The group's hyperparameters are copied from the engine's live dict before every step, so
an LR scheduler writing ``group["lr"]`` reaches the update. The optimizer runs where the master
lives: the device, or the host with ``offload_optimizer`` (torch optimizers run on CPU tensors).
"""

from __future__ import annotations

import collections

import torch

ADAM_FAMILY_NAMES = ("Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam")


def shallow_copy(client: torch.optim.Optimizer, group: dict) -> torch.optim.Optimizer:
    inner = object.__new__(type(client))
    inner.__dict__.update(client.__dict__)
    inner.param_groups = [group]
    inner.state = collections.defaultdict(dict)
    return inner


class ClientUpdate:
    def __init__(self, client: torch.optim.Optimizer, hyper: dict, master: torch.Tensor) -> None:
        self.hyper = hyper
        # Shares the master's storage: the client's in-place update is the master update.
        self.param = torch.nn.Parameter(master, requires_grad=False)
        self.grad = torch.zeros_like(master)  # padding stays zero
        group = {k: v for k, v in hyper.items() if k != "params"}
        group["params"] = [self.param]
        self.optimizer = shallow_copy(client, group)

    def step(self, pieces: list[tuple[int, torch.Tensor]], factor: float) -> None:
        """``pieces``: (shard offset, this rank's reduced gradient there); ``factor``: unscale x
        clip, applied here so the client sees the true gradient."""
        for start, g in pieces:
            self.grad[start : start + g.numel()].copy_(g).mul_(factor)
        group = self.optimizer.param_groups[0]
        group.update({k: v for k, v in self.hyper.items() if k != "params"})
        self.param.grad = self.grad
        self.optimizer.step()
        self.param.grad = None

    def state_nbytes(self) -> int:
        state = self.optimizer.state.get(self.param, {})
        return sum(
            v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
        )
