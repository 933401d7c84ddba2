"""A client ``torch.optim.Optimizer`` (SGD, Lion, a custom one, ...) run over this rank's fp32
master shard, where the built-in Adam(W) path does not apply.

As in DeepSpeed, the client's update runs on the flattened partition: one 1-D fp32 tensor per
param group holding this rank's slices of many params (and bucket padding, whose gradient is
zero). Elementwise updates are therefore exact; an optimizer whose update depends on a param's
shape or on whole-tensor statistics (Adafactor's factored moments, LAMB's trust ratio, Shampoo,
Muon) sees flat slices instead and is not the same optimizer: such optimizers are out of scope,
as they are in DeepSpeed's ZeRO.

Checkpoints (``checkpoint_spec``, ``shard``, ``prepare_load``, ``write``): the client's state
for the master shard is saved as the built-in Adam's is. A tensor of the shard's size (an
elementwise state: SGD's ``momentum_buffer``, Adagrad's ``sum``) is a shard kind
``client.<key>``, laid out like the master and resliced like it for another world size; a
one-element tensor or a number (``step``) is a scalar in ``meta.json``, the same on every rank.
Any other state cannot be cut per element and refuses the save, naming the key.

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
        self._initial_state(client, group)

    def _initial_state(self, client: torch.optim.Optimizer, group: dict) -> None:
        """A class that makes its state when constructed (torch's Adagrad before 2.13: ``sum``
        and ``step``) gets that state for the master too, as its own constructor makes it."""
        if not any(client.state.get(p) for g in client.param_groups for p in g["params"]):
            return
        kwargs = {k: v for k, v in group.items() if k != "params"}
        try:
            fresh = type(client)([self.param], **kwargs)
        except TypeError:  # a constructor of its own: its step makes what it needs
            return
        made = fresh.state.get(self.param)
        if made:
            self.optimizer.state[self.param] = made

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

    # ---- checkpoints ---------------------------------------------------------------------------
    def checkpoint_spec(self) -> dict:
        """What a checkpoint records of this client's state: its class, the elementwise state
        keys (shard kinds ``client.<key>``) and the scalars. Raises ``ValueError`` naming a key
        whose state is neither."""
        shard, scalars = [], {}
        n = self.param.numel()
        for key, v in self.optimizer.state.get(self.param, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n and n > 1:
                if v.dtype != torch.float32:
                    raise ValueError(f"state {key!r} is {v.dtype}; a checkpoint holds fp32 shards")
                shard.append(str(key))
            elif isinstance(v, torch.Tensor) and v.numel() == 1:
                scalars[str(key)] = {
                    "value": v.item(),
                    "tensor": str(v.dtype).removeprefix("torch."),
                }
            elif v is None or isinstance(v, bool | int | float):
                scalars[str(key)] = {"value": v}
            else:
                raise ValueError(
                    f"state {key!r} ({type(v).__name__}"
                    f"{' ' + str(list(v.shape)) if isinstance(v, torch.Tensor) else ''}) is neither "
                    "elementwise over the shard nor a scalar"
                )
        return {"class": type(self.optimizer).__name__, "shard": sorted(shard), "scalars": scalars}

    def shard(self, key: str) -> torch.Tensor:
        return self.optimizer.state[self.param][key]

    def prepare_load(self, spec: dict) -> None:
        """The state a checkpoint holds, allocated (shards zeroed, scalars set) before the
        shards are written in."""
        state = self.optimizer.state[self.param] = {}
        for key in spec["shard"]:
            state[key] = torch.zeros_like(self.param, dtype=torch.float32)
        for key, s in spec["scalars"].items():
            dtype = s.get("tensor")
            state[key] = (
                torch.tensor(s["value"], dtype=getattr(torch, dtype)) if dtype else s["value"]
            )

    def write(self, key: str, lo: int, src: torch.Tensor) -> None:
        self.optimizer.state[self.param][key][lo : lo + src.numel()].copy_(src)
