"""The four implementations behind one interface: ``step(x, y) -> loss``, ``finish()``.

Every trainer gets the same fp32-initialised GPT-2 (:func:`build_model`) and the same recipe:
AdamW (lr, betas, eps, weight decay on 2-D weights only, via ``param_groups``), global-norm
clipping, ``shape.gas`` micro-steps per step. Only the machinery differs:

- ``torch``: the model in the run's dtype, ``torch.optim.AdamW(fused=True)`` on it (no fp32
  master copy: plain bf16 training), ``clip_grad_norm_``; DDP on the process group when world > 1.
- ``engine``: ``zero_offload.initialize`` with the run's config dict.
- ``deepspeed``: ``deepspeed.initialize`` with the same dict (see ``_ds_compat``).
- ``fsdp2``: PyTorch FSDP2, ``fully_shard`` on every transformer block and then on the root
  (embeddings, final norm, tied head), ``MixedPrecisionPolicy`` in the run's dtype (fp32 master
  params), ``CPUOffloadPolicy`` for the offload run (unpinned without a GPU), ``AdamW`` and ``clip_grad_norm_`` on the
  sharded (DTensor) params; stage 3 only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from _spec import Run, Shape, ds_config, for_deepspeed

from zero_offload.models.gpt2 import GPT2Config, GPT2Model, param_groups

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _engine_step(engine: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """DeepSpeed's loop, the same for both engines: forward, backward, step per micro-step (the
    engine updates at the accumulation boundary); returns the mean loss."""
    total = torch.zeros((), device=batches[0][0].device)
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    return total / len(batches)


def build_model(config: GPT2Config, shape: Shape, run: Run, device: torch.device) -> GPT2Model:
    """The run's GPT-2, the same values for every implementation (same seed, same construction
    order): on the GPU when there is one (no host copy, fast init), and for the engine's stage-3
    runs with ``shape.zero_init`` under ``zero_offload.zero.Init`` (partitioned as built; the
    values are the same). DeepSpeed's runs build the whole model: GPT2Model's init re-initializes
    its submodules' params, which under ``deepspeed.zero.Init`` needs DeepSpeed's own gathering;
    how a model is built changes the build's peak memory, not the step."""
    torch.manual_seed(shape.seed)
    where = torch.device(device) if device.type == "cuda" else contextlib.nullcontext()
    if shape.zero_init and run.stage == 3 and run.impl == "engine":
        import zero_offload

        remote = "cpu" if run.offload_param else None
        init = zero_offload.zero.Init(
            remote_device=remote, config_dict_or_path=ds_config(shape, run)
        )
        with where, init:
            return GPT2Model(config)
    with where:
        return GPT2Model(config)


class TorchTrainer:
    def __init__(self, model: torch.nn.Module, shape: Shape, run: Run, device: torch.device):
        model.to(device=device, dtype=TORCH_DTYPES[run.dtype])
        groups = param_groups(model)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=shape.lr,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=shape.weight_decay,
            fused=True,
        )
        self.ddp = run.world > 1
        if self.ddp:
            ids = [device.index] if device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        self.model, self.clip = model, shape.clip
        self.info = "AdamW(fused)" + (" + DDP" if run.world > 1 else "")

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over ``batches`` (its micro-steps); returns their mean loss."""
        total = torch.zeros((), device=batches[0][0].device)
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            sync = self.model.no_sync() if (self.ddp and not last) else contextlib.nullcontext()
            with sync:
                loss = self.model(x, y)
                (loss / len(batches)).backward()
            total += loss.detach()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / len(batches)

    def finish(self) -> None:
        pass

    def accounting(self) -> tuple[dict[str, int], dict[str, int]] | None:
        return None


class EngineTrainer:
    def __init__(self, model: torch.nn.Module, shape: Shape, run: Run, device: torch.device):
        import zero_offload

        config = ds_config(shape, run)
        if (
            run.offload
        ):  # the host update gets the rank's threads, as DeepSpeedCPUAdam's OpenMP does
            config["zero_optimization"]["offload_optimizer"]["threads"] = torch.get_num_threads()
        self.engine, _, _, _ = zero_offload.initialize(
            model=model, model_parameters=param_groups(model), config=config
        )
        self.info = "zero_offload"

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return _engine_step(self.engine, batches)

    def finish(self) -> None:
        self.engine.flush_delayed_update()

    def accounting(self) -> tuple[dict[str, int], dict[str, int]]:
        """(``memory_report()``, ``expected_memory()``), each in bytes by category."""
        return self.engine.memory_report(), self.engine.expected_memory()


class DeepSpeedTrainer:
    def __init__(self, model: torch.nn.Module, shape: Shape, run: Run, device: torch.device):
        import _ds_compat

        config = for_deepspeed(ds_config(shape, run))
        self.engine = _ds_compat.initialize(model, param_groups(model), config)
        self.info = _ds_compat.optimizer_name(self.engine)

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return _engine_step(self.engine, batches)

    def finish(self) -> None:
        pass

    def accounting(self) -> tuple[dict[str, int], dict[str, int]] | None:
        return None


class FSDP2Trainer(TorchTrainer):
    """Plain PyTorch's step (backward, clip, AdamW) over FSDP2-sharded params."""

    def __init__(self, model: torch.nn.Module, shape: Shape, run: Run, device: torch.device):
        import torch.distributed as dist
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():  # FSDP2 needs a process group even at world 1
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model.to(device)
        dtype = TORCH_DTYPES[run.dtype]
        kwargs: dict[str, Any] = {
            # Compute and reduce in the run's dtype, fp32 params as the master copy: the same
            # split as the engine's and DeepSpeed's bf16 mode (fp32 runs: no casts at all).
            "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype),
            "reshard_after_forward": True,
        }
        if run.offload_param:
            # Pinned host memory needs an accelerator: without one, pin_memory() raises.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in model.layers:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        groups = param_groups(model)  # after fully_shard: the DTensor params
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = torch.optim.AdamW(
            groups, lr=shape.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=shape.weight_decay
        )
        self.model, self.clip, self.ddp = model, shape.clip, False
        self.info = "fully_shard + AdamW" + (" + CPUOffloadPolicy" if run.offload_param else "")


def build_trainer(model: torch.nn.Module, shape: Shape, run: Run, device: torch.device) -> Any:
    cls = {
        "torch": TorchTrainer,
        "engine": EngineTrainer,
        "deepspeed": DeepSpeedTrainer,
        "fsdp2": FSDP2Trainer,
    }[run.impl]
    return cls(model, shape, run, device)
