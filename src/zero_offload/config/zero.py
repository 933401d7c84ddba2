"""``zero_optimization`` section: DeepSpeed's ZeRO stage 0/1/2/3 keys and defaults, optimizer
offload and (stage 3) parameter offload to the host CPU or to NVMe (ZeRO-Infinity: ``"device":
"nvme"`` with ``nvme_path``, a local directory; the top-level ``aio`` section, :mod:`.aio`, tunes
its reads and writes). Keys that would only tune what is not built are warnings.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from .errors import join_path, json_repr
from .fields import DEFAULT_ONLY, Bool, DsFloat, DsInt, Int, Section, Str, pydantic_int, rule_error
from .keys import describe_errors
from .leaf_module import LeafModuleConfig

# 5e8 elements: DeepSpeed's default for both bucket sizes.
DEFAULT_BUCKET_SIZE = 500_000_000

# The stage-3 keys this project reads, by their field (and canonical JSON) name, with every
# other spelling DeepSpeed accepts for the same setting: DeepSpeed's own field names are the
# unprefixed ones, with the ``stage3_`` spelling as alias, and it keeps the deprecated
# ``stage3_gather_fp16_weights_on_model_save``. Two spellings of one setting are an error.
STAGE3_SPELLINGS: dict[str, tuple[str, ...]] = {
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size",),
    "stage3_param_persistence_threshold": ("param_persistence_threshold",),
    "stage3_model_persistence_threshold": ("model_persistence_threshold",),
    "stage3_max_live_parameters": ("max_live_parameters",),
    "stage3_max_reuse_distance": ("max_reuse_distance",),
    "stage3_gather_16bit_weights_on_model_save": (
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    ),
    "sub_group_size": (),
}
_ALIAS_OF = {alias: name for name, aliases in STAGE3_SPELLINGS.items() for alias in aliases}

# Stage-3 (and ZeRO++ / MiCS / ZenFlow) keys not built: accepted so DeepSpeed configs load,
# then listed in the not-implemented warning, in both of DeepSpeed's spellings.
_STAGE3_EXTRAS = (
    "module_granularity_threshold",
    "use_all_reduce_for_fetch_params",
    "allgather_sequential",
    "partition_stream_chunk_size",
)
ZERO_NOT_IMPLEMENTED = frozenset(
    {*_STAGE3_EXTRAS, *(f"stage3_{k}" for k in _STAGE3_EXTRAS)}
    | {
        "zero_hpz_partition_size",
        "zero_quantized_weights",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_gradients",
        "zeropp_loco_param",
        "mics_shard_size",
        "mics_hierarchical_params_gather",
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "enable_sanity_checks",
        "save_muon_momentum_buffer_in_memory",
        "zenflow",
        "legacy_stage1",
        "cpu_offload_use_pin_memory",
    }
)


# DeepSpeed's OffloadDeviceEnum values.
OffloadDevice = Literal["none", "cpu", "nvme"]
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")


def _offload_device(value: Any) -> Any:
    if not isinstance(value, str) or value not in OFFLOAD_DEVICES:
        allowed = ", ".join(json_repr(d) for d in OFFLOAD_DEVICES)
        raise ValueError(f"allowed: {allowed}; got {json_repr(value)}")
    return value


def _nvme_path_rule(path: str | None, what: str) -> None:
    """With ``device: "nvme"``, ``nvme_path`` must be given (DeepSpeed fails later without it)."""
    if path is None or not path.strip():
        got = "" if path is None else f" (got {json_repr(path)})"
        raise rule_error(
            "nvme_path",
            f'required with device "nvme": must be a local directory (ideally on an NVMe '
            f"drive) to swap {what} to{got}",
        )


class OffloadOptimizerConfig(Section):
    """``offload_optimizer``: where the master shard and optimizer state live and the update
    runs. ``delayed_update``, ``delayed_update_after`` and ``threads`` are this project's keys:
    the one-step delayed parameter update of the ZeRO-Offload paper (start after that many
    steps) and the host update kernel's thread count (null: one per core)."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"super_offload", "cpuadam_cores_perc", "convert_grad_on_cpu"}
    )

    device: OffloadDevice = "none"
    nvme_path: Str | None = None
    buffer_count: DsInt = Field(4, ge=0)
    pin_memory: Bool = True
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: DsFloat = Field(1.0, ge=0.0, le=1.0)
    delayed_update: Bool = False
    delayed_update_after: Int = Field(0, ge=0)
    threads: Int | None = Field(None, ge=1, le=1024)  # the host kernel's pool holds 1024

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _offload_device(value)

    @model_validator(mode="after")
    def _nvme(self) -> OffloadOptimizerConfig:
        if self.device == "nvme":
            _nvme_path_rule(self.nvme_path, "the optimizer state")
            if self.buffer_count < 2:
                raise rule_error(
                    "buffer_count",
                    f'must be >= 2 with device "nvme" (got {self.buffer_count}): the streamed '
                    "update reads chunk k+1 while chunk k updates",
                )
        return self


class OffloadParamConfig(Section):
    """``offload_param`` (stage 3): with ``device: "cpu"`` each rank's 16-bit param shard lives in
    host memory (pinned when ``pin_memory`` and CUDA) and is fetched to the device to run; with
    ``device: "nvme"`` it lives in a swap file under ``nvme_path`` and is read into host buffers
    to be fetched. ``buffer_count``, ``buffer_size`` (elements) and ``max_in_cpu`` (elements)
    size those host buffers, as in DeepSpeed."""

    device: OffloadDevice = "none"
    nvme_path: Str | None = None
    buffer_count: DsInt = Field(5, ge=0)
    buffer_size: DsInt = Field(100_000_000, ge=0)
    max_in_cpu: DsInt = Field(1_000_000_000, ge=0)
    pin_memory: Bool = True

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _offload_device(value)

    @model_validator(mode="after")
    def _nvme(self) -> OffloadParamConfig:
        if self.device == "nvme":
            _nvme_path_rule(self.nvme_path, "the 16-bit parameter shard")
        return self


class ZeroConfig(Section):
    """ZeRO stage 0 (plain data parallel), 1 (optimizer state partitioned), 2 (gradients too) or
    3 (16-bit params too)."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = ZERO_NOT_IMPLEMENTED

    stage: DsInt = 0
    # Gradients always go through contiguous buckets and a contiguous grad shard.
    contiguous_gradients: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    reduce_scatter: Bool = True
    reduce_bucket_size: DsInt = Field(DEFAULT_BUCKET_SIZE, gt=0)
    use_multi_rank_bucket_allreduce: Bool = Field(True, json_schema_extra=DEFAULT_ONLY)
    allgather_partitions: Bool = True
    allgather_bucket_size: DsInt = Field(DEFAULT_BUCKET_SIZE, gt=0)
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
    # Deprecated in DeepSpeed: true means offload_param {"device": "cpu"}.
    cpu_offload_param: Bool | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    # Stage 3 (elements unless named otherwise); no effect below stage 3. Defaults: DeepSpeed's.
    stage3_prefetch_bucket_size: DsInt = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: DsInt = Field(100_000, ge=0)
    stage3_model_persistence_threshold: DsInt = Field(sys.maxsize, ge=0)
    stage3_max_live_parameters: DsInt = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: DsInt = Field(1_000_000_000, ge=0)
    stage3_gather_16bit_weights_on_model_save: Bool = False
    sub_group_size: DsInt = Field(1_000_000_000, gt=0)
    # Stage 3: nn.Linear's backward saves the weight param, not the gathered bucket
    # (runtime/memory_efficient_linear.py); DeepSpeed's key and default.
    memory_efficient_linear: Bool = True
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @classmethod
    def known_keys(cls) -> set[str]:
        return super().known_keys() | set(_ALIAS_OF)

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        """Each stage-3 setting under its ``stage3_`` name. A value given under another spelling
        is checked here, so that its error names the key the user wrote."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, aliases in STAGE3_SPELLINGS.items():
            given = [key for key in (name, *aliases) if key in data]
            if len(given) > 1:
                others = ", ".join(f'"{key}"' for key in given[1:])
                raise rule_error(
                    given[0], f"{others} is the same setting (DeepSpeed alias); give one, not both"
                )
            if given and given[0] != name:
                data[name] = _checked(cls, name, given[0], data.pop(given[0]))
        return data

    @field_validator("stage", mode="before")
    @classmethod
    def _stage(cls, value: Any) -> Any:
        if isinstance(value, str):  # DeepSpeed's ZeroStageEnum reads "2" as 2 (pydantic lax)
            try:
                value = pydantic_int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or value not in (0, 1, 2, 3):
            raise ValueError(f"allowed: 0, 1, 2, 3; got {json_repr(value)}")
        return value

    @model_validator(mode="after")
    def _rules(self) -> ZeroConfig:
        if self.cpu_offload is not None:
            if "offload_optimizer" in self.model_fields_set:
                raise rule_error(
                    "cpu_offload", "deprecated alias of offload_optimizer; give one, not both"
                )
            if self.cpu_offload:
                self._settle(offload_optimizer=OffloadOptimizerConfig(device="cpu"))
            # Applied: to_dict() then holds one spelling, so it loads again.
            self._settle(cpu_offload=None)
        param_key = "offload_param.device"
        if self.cpu_offload_param is not None:
            if "offload_param" in self.model_fields_set:
                raise rule_error(
                    "cpu_offload_param", "deprecated alias of offload_param; give one, not both"
                )
            param_key = "cpu_offload_param"
            if self.cpu_offload_param:
                self._settle(offload_param=OffloadParamConfig(device="cpu"))
            self._settle(cpu_offload_param=None)
        if self.overlap_comm is None:
            # DeepSpeed overlaps by default at stage 3 only.
            self._settle(overlap_comm=self.stage == 3)
        offload = self.offload_optimizer
        if offload is not None and offload.device != "none" and self.stage == 0:
            raise rule_error(
                "offload_optimizer.device",
                f"{json_repr(offload.device)} needs zero_optimization.stage 1, 2 or 3 (stage is "
                "0): the offloaded optimizer updates this rank's partition",
            )
        if offload is not None and offload.ratio < 1.0:
            raise rule_error(
                "offload_optimizer.ratio",
                "partial offload (ratio < 1.0) is not built; use 1.0",
            )
        if offload is not None and offload.delayed_update and offload.device != "cpu":
            why = '; "nvme" is not supported with it' if offload.device == "nvme" else ""
            raise rule_error(
                "offload_optimizer.delayed_update", f'needs offload_optimizer.device "cpu"{why}'
            )
        if self.offload_params and self.stage != 3:
            raise rule_error(
                param_key,
                f"{json_repr(self.offload_param_device)} parameter offload needs "
                f"zero_optimization.stage 3 (stage is {self.stage}): only stage 3 partitions the "
                "16-bit params",
            )
        return self

    def non_default_unimplemented(self, prefix: str = "") -> list[str]:
        """Also every stage-3 key set away from its default below stage 3, where it has no
        effect."""
        out = super().non_default_unimplemented(prefix)
        if self.stage < 3:
            for name in STAGE3_SPELLINGS:
                value = getattr(self, name)
                if value != type(self).model_fields[name].default:
                    out.append(f"{join_path(prefix, name)}={json_repr(value)} (stage 3 only)")
        return out

    @property
    def offload_device(self) -> OffloadDevice:
        """``offload_optimizer.device``: "none" (the update runs on the device), "cpu" (master
        shard and optimizer state in host memory) or "nvme" (in swap files under
        :attr:`optimizer_nvme_path`, streamed through host buffers)."""
        return self.offload_optimizer.device if self.offload_optimizer is not None else "none"

    @property
    def offload(self) -> bool:
        """Whether the optimizer update runs on the host: device "cpu" or "nvme"."""
        return self.offload_device != "none"

    @property
    def offload_param_device(self) -> OffloadDevice:
        """Where the 16-bit param shard lives between uses (stage 3): "none" (the device), "cpu"
        (host memory) or "nvme" (a swap file under :attr:`param_nvme_path`)."""
        return self.offload_param.device if self.offload_param is not None else "none"

    @property
    def offload_params(self) -> bool:
        """Whether the 16-bit param shard lives off the device (stage 3): device "cpu" or
        "nvme"."""
        return self.offload_param_device != "none"

    @property
    def optimizer_nvme_path(self) -> str | None:
        """``offload_optimizer.nvme_path`` when the optimizer offload device is "nvme", else
        None (a path given for another device is ignored, with a warning at load)."""
        oc = self.offload_optimizer
        return oc.nvme_path if oc is not None and oc.device == "nvme" else None

    @property
    def param_nvme_path(self) -> str | None:
        """``offload_param.nvme_path`` when the param offload device is "nvme", else None."""
        pc = self.offload_param
        return pc.nvme_path if pc is not None and pc.device == "nvme" else None

    @property
    def uses_nvme(self) -> bool:
        """Whether anything (optimizer state or params) is offloaded to NVMe."""
        return "nvme" in (self.offload_device, self.offload_param_device)


def _checked(model: type[Section], name: str, key: str, value: Any) -> Any:
    """``value`` validated as field ``name``; a failure is an error naming ``key``."""
    field = model.model_fields[name]
    try:
        return TypeAdapter(field.rebuild_annotation()).validate_python(value)
    except ValidationError as exc:
        raise rule_error(key, describe_errors(model, exc, set())[0]) from None
