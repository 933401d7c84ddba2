"""``zero_optimization`` section: DeepSpeed's ZeRO stage 0/1/2 keys and defaults, plus
optimizer offload to the host CPU. Stage 3, NVMe and parameter offload are not built; their
keys are errors (when they would change what runs) or warnings (when they would only tune it).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from .errors import json_repr
from .fields import DEFAULT_ONLY, Bool, Float, Int, Section, Str, rule_error

# 5e8 elements: DeepSpeed's default for both bucket sizes.
DEFAULT_BUCKET_SIZE = 500_000_000

# Stage-3 (and ZeRO++ / MiCS / ZenFlow) keys: accepted so DeepSpeed configs load, then listed
# in the not-implemented warning. DeepSpeed spells the stage-3 ones with and without prefix.
_STAGE3_KEYS = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "max_reuse_distance",
    "gather_16bit_weights_on_model_save",
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "partition_stream_chunk_size",
)
ZERO_NOT_IMPLEMENTED = frozenset(
    {*_STAGE3_KEYS, *(f"stage3_{k}" for k in _STAGE3_KEYS)}
    | {
        "stage3_gather_fp16_weights_on_model_save",
        "sub_group_size",
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "zeropp_loco_param",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "memory_efficient_linear",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "leaf_module",
        "zenflow",
        "legacy_stage1",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
    }
)


class OffloadOptimizerConfig(Section):
    """``offload_optimizer``: where the master shard and optimizer state live and the update
    runs. ``delayed_update``, ``delayed_update_after`` and ``threads`` are this project's keys:
    the one-step delayed parameter update of the ZeRO-Offload paper (start after that many
    steps) and the host update kernel's thread count (null: one per core)."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"super_offload", "cpuadam_cores_perc", "convert_grad_on_cpu"}
    )

    device: Literal["none", "cpu"] = "none"
    nvme_path: Str | None = None
    buffer_count: Int = Field(4, ge=0)
    pin_memory: Bool = True
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: Float = Field(1.0, ge=0.0, le=1.0)
    delayed_update: Bool = False
    delayed_update_after: Int = Field(0, ge=0)
    threads: Int | None = Field(None, ge=1, le=1024)  # the host kernel's pool holds 1024

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        if value == "nvme":
            raise ValueError('"nvme" offload is not built; use "cpu" or "none"')
        if value not in ("none", "cpu"):
            raise ValueError(f'allowed: "none", "cpu"; got {json_repr(value)}')
        return value


class OffloadParamConfig(Section):
    """``offload_param``: DeepSpeed's parameter offload, which needs stage 3. Only
    ``device: "none"`` is accepted; the rest of its keys are read for compatibility."""

    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: Str | None = None
    buffer_count: Int = Field(5, ge=0)
    buffer_size: Int = Field(100_000_000, ge=0)
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    pin_memory: Bool = True


class ZeroConfig(Section):
    """ZeRO stage 0 (plain data parallel), 1 (optimizer state partitioned) or 2 (gradients too)."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = ZERO_NOT_IMPLEMENTED

    stage: Int = 0
    # Gradients always go through contiguous buckets and a contiguous grad shard.
    contiguous_gradients: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    reduce_scatter: Bool = True
    reduce_bucket_size: Int = Field(DEFAULT_BUCKET_SIZE, gt=0)
    use_multi_rank_bucket_allreduce: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    allgather_partitions: Bool = True
    allgather_bucket_size: Int = Field(DEFAULT_BUCKET_SIZE, gt=0)
    # None until validated: DeepSpeed turns it on by default for stage 3 only.
    overlap_comm: Bool | None = None
    load_from_fp32_weights: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    elastic_checkpoint: Bool = Field(False, json_schema_extra=DEFAULT_ONLY)
    ignore_unused_parameters: Bool = True
    round_robin_gradients: Bool = Field(False, json_schema_extra=DEFAULT_ONLY)
    compute_grad_norm: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    parameter_alignment: Bool = Field(False, json_schema_extra=DEFAULT_ONLY)
    # Deprecated in DeepSpeed: true means offload_optimizer {"device": "cpu"}.
    cpu_offload: Bool | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None

    @field_validator("stage", mode="before")
    @classmethod
    def _stage(cls, value: Any) -> Any:
        if value == 3 and not isinstance(value, bool):
            raise ValueError("stage 3 is not built; use 0, 1 or 2")
        if isinstance(value, bool) or value not in (0, 1, 2):
            raise ValueError(f"allowed: 0, 1, 2; got {json_repr(value)}")
        return value

    @model_validator(mode="after")
    def _rules(self) -> ZeroConfig:
        if self.cpu_offload is not None:
            if "offload_optimizer" in self.model_fields_set:
                raise rule_error(
                    "cpu_offload", "deprecated alias of offload_optimizer; give one, not both"
                )
            if self.cpu_offload:
                self.offload_optimizer = OffloadOptimizerConfig(device="cpu")
        if self.overlap_comm is None:
            self.overlap_comm = False  # stage 3 is the only stage DeepSpeed overlaps by default
        offload = self.offload_optimizer
        if offload is not None and offload.device == "cpu" and self.stage == 0:
            raise rule_error(
                "offload_optimizer.device",
                '"cpu" needs zero_optimization.stage 1 or 2 (stage is 0): the offloaded '
                "optimizer updates this rank's partition",
            )
        if offload is not None and offload.ratio < 1.0:
            raise rule_error(
                "offload_optimizer.ratio",
                "partial offload (ratio < 1.0) needs ZeRO stage 3, which is not built; use 1.0",
            )
        if offload is not None and offload.delayed_update and offload.device != "cpu":
            raise rule_error(
                "offload_optimizer.delayed_update", 'needs offload_optimizer.device "cpu"'
            )
        if self.offload_param is not None and self.offload_param.device != "none":
            raise rule_error(
                "offload_param.device",
                f'"{self.offload_param.device}": parameter offload needs ZeRO stage 3, '
                'which is not built; use "none" or remove offload_param',
            )
        return self

    @property
    def offload_device(self) -> str:
        """The offload device: "cpu" when the optimizer runs on the host, else "none"."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload(self) -> bool:
        return self.offload_device == "cpu"
