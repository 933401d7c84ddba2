"""What one benchmark run is, and the one config dict every implementation is built from.

A run is (implementation, stage, optimizer offload, delayed update, world size, dtype, param
offload) on a shared model shape and step recipe. Specs travel to the rank processes as JSON, so they hold plain values only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

IMPLS = ("torch", "engine", "deepspeed", "fsdp2")
DTYPES = ("fp32", "bf16")

# Keys of offload_optimizer that only this project reads; DeepSpeed rejects unknown keys.
PROJECT_ONLY_OFFLOAD_KEYS = ("delayed_update", "delayed_update_after", "threads")


@dataclass(frozen=True)
class Shape:
    """Model shape and the step recipe, identical for every run of one benchmark."""

    layers: int
    hidden: int
    heads: int
    seq: int
    micro: int
    steps: int
    warmup: int
    bucket: int  # reduce_bucket_size and allgather_bucket_size, elements
    # Stage 3 only, the same numbers for the engine and DeepSpeed (elements / elements / params).
    prefetch_bucket: int = 50_000_000  # stage3_prefetch_bucket_size
    persistence_threshold: int = 100_000  # stage3_param_persistence_threshold
    max_live: int = 1_000_000_000  # stage3_max_live_parameters
    vocab: int = 256  # GPT-2's BPE is 50257; the byte vocabulary keeps CPU runs small
    gas: int = 1  # micro-steps per step (gradient_accumulation_steps)
    checkpoint: bool = False  # activation checkpointing (recompute each block in backward)
    # Stage 3, the engine: build the model under zero_offload.zero.Init, partitioned as each
    # module is made (remote_device "cpu" with offload_param).
    zero_init: bool = False
    lr: float = 1e-4
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 1234


@dataclass(frozen=True)
class Run:
    impl: str  # one of IMPLS
    stage: int
    offload: bool
    delayed: bool
    world: int
    dtype: str  # one of DTYPES
    offload_param: bool = False  # stage 3: offload_param {device: cpu} (FSDP2: CPUOffloadPolicy)
    # stage 3 with offload: offload_optimizer.ratio, the host's share of the optimizer state
    # (partial offload; 1.0: all of it)
    ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"Run.impl must be one of {IMPLS}, got {self.impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Run.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Run.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.offload and self.stage == 0:
            raise ValueError("Run.offload needs stage 1, 2 or 3")
        if self.delayed and not self.offload:
            raise ValueError("Run.delayed needs offload")
        if self.offload_param and self.stage != 3:
            raise ValueError("Run.offload_param needs stage 3")
        if self.ratio < 1.0 and not (self.stage == 3 and self.offload and not self.delayed):
            raise ValueError("Run.ratio < 1 needs stage 3 with offload, no delayed update")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"Run.ratio must be in [0, 1], got {self.ratio!r}")
        if self.impl == "torch" and (self.stage or self.offload):
            raise ValueError("the plain PyTorch run is stage 0 without offload")
        if self.impl == "fsdp2":
            if self.stage != 3:
                raise ValueError("the FSDP2 run is stage 3")
            if self.delayed or self.offload != self.offload_param:
                raise ValueError(
                    "FSDP2's CPUOffloadPolicy moves params and optimizer state together: "
                    "offload and offload_param both or neither, no delayed update"
                )

    @property
    def base_mode(self) -> str:
        """``mode`` without a partial offload's ratio (what ``--modes`` names)."""
        return self.mode.replace(f"@{self.ratio:g}", "")

    @property
    def mode(self) -> str:
        """Offload column: '-', 'cpu' (optimizer), 'cpu+delayed' or 'cpu+param' (optimizer and
        params); a partial offload's ratio follows cpu ('cpu@0.5')."""
        cpu = "cpu" if self.ratio >= 1.0 else f"cpu@{self.ratio:g}"
        opt = ("cpu+delayed" if self.delayed else cpu) if self.offload else ""
        if self.offload_param:
            return f"{opt}+param" if opt else "param"
        return opt or "-"

    @property
    def label(self) -> str:
        return f"{self.impl} stage {self.stage} offload {self.mode} world {self.world} {self.dtype}"


def stage3_auto(hidden: int) -> dict[str, int]:
    """``Shape``'s stage-3 sizes as DeepSpeed's ``"auto"`` fills them for this hidden size (the
    library's own rule): ``prefetch_bucket`` and ``persistence_threshold``."""
    from zero_offload.config.loading.auto_sizes import auto_sizes

    sizes = auto_sizes(hidden)
    return {
        "prefetch_bucket": sizes["stage3_prefetch_bucket_size"],
        "persistence_threshold": sizes["stage3_param_persistence_threshold"],
    }


def to_json(shape: Shape, run: Run) -> dict[str, Any]:
    return {"shape": dataclasses.asdict(shape), "run": dataclasses.asdict(run)}


def from_json(data: dict[str, Any]) -> tuple[Shape, Run]:
    return Shape(**data["shape"]), Run(**data["run"])


def ds_config(shape: Shape, run: Run) -> dict[str, Any]:
    """The DeepSpeed JSON config of a run; the engine and DeepSpeed both read this dict (DeepSpeed
    without the project-only keys, see :func:`for_deepspeed`)."""
    zero: dict[str, Any] = {
        "stage": run.stage,
        "contiguous_gradients": True,
        "overlap_comm": False,
        "reduce_scatter": True,
        "reduce_bucket_size": shape.bucket,
        "allgather_bucket_size": shape.bucket,
    }
    if run.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if run.ratio < 1.0:
            zero["offload_optimizer"]["ratio"] = run.ratio
        if run.delayed:
            zero["offload_optimizer"]["delayed_update"] = True
    if run.stage == 3:
        zero["stage3_prefetch_bucket_size"] = shape.prefetch_bucket
        zero["stage3_param_persistence_threshold"] = shape.persistence_threshold
        zero["stage3_max_live_parameters"] = shape.max_live
        if run.offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": shape.micro,
        "gradient_accumulation_steps": shape.gas,
        "gradient_clipping": shape.clip,
        "steps_per_print": 1_000_000,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": shape.lr,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "weight_decay": shape.weight_decay,
            },
        },
        "bf16": {"enabled": run.dtype == "bf16"},
        "zero_optimization": zero,
    }


def for_deepspeed(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` without the keys only this project defines."""
    out = {**config, "zero_optimization": dict(config["zero_optimization"])}
    off = out["zero_optimization"].get("offload_optimizer")
    if off is not None:
        out["zero_optimization"]["offload_optimizer"] = {
            k: v for k, v in off.items() if k not in PROJECT_ONLY_OFFLOAD_KEYS
        }
    return out
