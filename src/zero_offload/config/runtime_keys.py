"""DeepSpeed's top-level keys that change how the engine runs a step: ``data_types``,
``checkpoint`` and the spellings of ``gradient_allreduce_op``; values as DeepSpeed spells them
(case-insensitive where DeepSpeed upper- or lower-cases them)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator

from .errors import json_repr
from .fields import Section

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _lower(value: Any, allowed: tuple[str, ...]) -> Any:
    if isinstance(value, str) and value.lower() in allowed:
        return value.lower()
    if value is None:
        return value
    raise ValueError(f"allowed: {', '.join(allowed)}; got {json_repr(value)}")


class DataTypesConfig(Section):
    """``grad_accum_dtype``: the dtype gradients accumulate in across micro-steps (None: the
    training dtype). ``param_dtype``: must name the training dtype (fp16/bf16/fp32 blocks pick
    it). ``buffer_dtype``: the dtype floating buffers are cast to (None: each keeps its own, as
    DeepSpeed does by default)."""

    AUTO_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset({"keep_in_fp32_modules"})

    grad_accum_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None,
        description="The dtype gradients accumulate in across micro-steps (stages 2 and 3 "
        'when it differs from the training dtype; at stages 0 and 1 only "fp32" with bf16 '
        "params). Null: the training dtype.",
    )
    param_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None,
        description="The training dtype, if given: must agree with the fp16/bf16 blocks, "
        "which pick it. Null: as they pick it.",
    )

    buffer_dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        None,
        description="The dtype floating buffers are cast to when the engine is built (integer "
        "buffers keep theirs). Null: every buffer keeps the dtype it has, e.g. a Llama's fp32 "
        "rotary inv_freq beside bf16 params.",
    )

    keep_in_fp32_modules: str | list[str] = Field(
        "auto",
        description='Buffers kept in fp32 under fp16/bf16 training: "auto" (the model\'s '
        "Hugging Face _keep_in_fp32_modules_strict lists, and _keep_in_fp32_modules under "
        "fp16), a list of name patterns (* is any characters, matched anywhere in the buffer's "
        "full name) or [] (none). Parameters follow the training dtype.",
    )

    @field_validator("keep_in_fp32_modules", mode="before")
    @classmethod
    def _keep(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, list) and all(isinstance(n, str) for n in value)):
            return value
        raise ValueError(f'must be "auto" or a list of name patterns, got {json_repr(value)}')

    @field_validator("grad_accum_dtype", "param_dtype", "buffer_dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return _lower(value, tuple(DTYPES))


class CheckpointConfig(Section):
    """``tag_validation``: what a save does when ranks pass different tags. ``fail`` refuses
    (before anything is written); ``warn`` (DeepSpeed's default) warns and ``ignore`` does not,
    and both save under rank 0's tag, since one checkpoint is written by all ranks together."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"load_universal", "use_node_local_storage", "parallel_write", "writer"}
    )

    tag_validation: Literal["warn", "ignore", "fail"] = Field(
        "warn",
        description='When ranks pass different tags to save_checkpoint: "fail" refuses before '
        'anything is written; "warn" warns and "ignore" does not, both saving under rank '
        "0's tag. Matched case-insensitively.",
    )

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _mode(cls, value: Any) -> Any:
        return _lower(value, ("warn", "ignore", "fail"))


def allreduce_op(value: Any) -> Any:
    """``gradient_allreduce_op``: "mean" (DeepSpeed's default: gradients averaged over the
    ranks) or "sum"."""
    return _lower(value, ("mean", "sum"))
