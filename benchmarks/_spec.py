"""What one benchmark run is, and the one config dict every implementation is built from.

A run is (implementation, stage, offload, delayed update, world size, dtype) on a shared model
shape and step recipe. Specs travel to the rank processes as JSON, so they hold plain values only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

IMPLS = ("torch", "engine", "deepspeed")
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

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"Run.impl must be one of {IMPLS}, got {self.impl!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Run.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.stage not in (0, 1, 2):
            raise ValueError(f"Run.stage must be 0, 1 or 2, got {self.stage!r}")
        if self.offload and self.stage == 0:
            raise ValueError("Run.offload needs stage 1 or 2")
        if self.delayed and not self.offload:
            raise ValueError("Run.delayed needs offload")
        if self.impl == "torch" and (self.stage or self.offload):
            raise ValueError("the plain PyTorch run is stage 0 without offload")

    @property
    def mode(self) -> str:
        """Offload column: '-', 'cpu' or 'cpu+delayed'."""
        if not self.offload:
            return "-"
        return "cpu+delayed" if self.delayed else "cpu"

    @property
    def label(self) -> str:
        return f"{self.impl} stage {self.stage} offload {self.mode} world {self.world} {self.dtype}"


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
        if run.delayed:
            zero["offload_optimizer"]["delayed_update"] = True
    return {
        "train_micro_batch_size_per_gpu": shape.micro,
        "gradient_accumulation_steps": 1,
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
