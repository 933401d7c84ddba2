"""``zero_optimization`` section: DeepSpeed's ZeRO stage 0/1/2/3 keys and defaults, optimizer
offload and (stage 3) parameter offload to the host CPU or to NVMe (ZeRO-Infinity: ``"device":
"nvme"`` with ``nvme_path``, a local directory; the top-level ``aio`` section, :mod:`.aio`, tunes
its reads and writes). Keys that would only tune what is not built are warnings.
"""

from __future__ import annotations

import sys
from enum import Enum
from typing import Any, ClassVar, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from ..errors import join_path, json_repr
from ..fields import DEFAULT_ONLY, Bool, DsFloat, DsInt, Int, Section, Str, pydantic_int, rule_error
from ..loading.keys import describe_errors
from .leaf_module import LeafModuleConfig
from .zenflow import ZenFlowConfig, check_zenflow

# 5e8 elements: DeepSpeed's default for both bucket sizes.
DEFAULT_BUCKET_SIZE = 500_000_000
# DeepSpeed stage 1/2: the all-gather bucket is whole 4-byte words of 16-bit elements.
NCCL_START_ALIGNMENT_FACTOR = 2

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

# Stage-3 (and ZeRO++) keys not built: accepted so DeepSpeed configs load,
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
        "pipeline_loading_checkpoint",
        "override_module_apply",
        "log_trace_cache_warnings",
        "save_muon_momentum_buffer_in_memory",
        "legacy_stage1",
        "cpu_offload_use_pin_memory",
    }
)


# DeepSpeed's OffloadDeviceEnum values.
OffloadDevice = Literal["none", "cpu", "nvme"]
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu", "nvme")


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's ``OffloadDeviceEnum``: the offload devices, as the config spells them."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


def _offload_device(value: Any) -> Any:
    if isinstance(value, OffloadDeviceEnum):  # DeepSpeed's enum, as its config models take it
        value = value.value
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

    device: OffloadDevice = Field(
        "none",
        description="Where the fp32 master shard and optimizer state live and the update runs: "
        '"none" (the device), "cpu" (host memory, the SIMD host Adam) or "nvme" (swap files '
        "under nvme_path, streamed through host buffers). Stage 1, 2 or 3.",
    )
    nvme_path: Str | None = Field(
        None,
        description="A local directory (ideally on an NVMe drive) for the optimizer swap "
        'files; required with device "nvme", ignored (with a warning) otherwise.',
    )
    buffer_count: DsInt = Field(
        4,
        ge=0,
        description="Host buffers the NVMe update streams the optimizer state through (reading "
        'ahead, writing behind); at least 2 with device "nvme".',
    )
    pin_memory: Bool = Field(
        True,
        description="Page-locked host buffers for the offloaded update's copies (with CUDA): "
        "asynchronous, full-bandwidth transfers. Counts against the memlock limit.",
    )
    pipeline_read: Bool = Field(
        False,
        description="DeepSpeed: overlap NVMe reads with the update. The NVMe update here "
        "always reads ahead, so this changes nothing.",
    )
    pipeline_write: Bool = Field(
        False,
        description="DeepSpeed: overlap NVMe writes with the update. The NVMe update here "
        "always writes behind, so this changes nothing.",
    )
    fast_init: Bool = Field(
        False,
        description="DeepSpeed: a faster optimizer-state initialization with NVMe offload. "
        "The swap files here are preallocated at start-up either way; this changes nothing.",
    )
    ratio: DsFloat = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="The share of each param group's optimizer state kept in host memory and "
        "updated by the host Adam (DeepSpeed's partial offload, ZeRO-Offload++); the rest stays "
        "on the device and is updated there in the same step. Below 1.0: stage 3 only, with "
        'device "cpu" and the built-in Adam(W), not with delayed_update.',
    )
    delayed_update: Bool = Field(
        False,
        description="This project's extension: the ZeRO-Offload paper's one-step delayed "
        "parameter update (the host update of step t overlaps step t+1's forward/backward); "
        'needs device "cpu" and the built-in Adam(W).',
    )
    delayed_update_after: Int = Field(
        0,
        ge=0,
        description="This project's extension: optimizer steps run undelayed before "
        "delayed_update starts (steps).",
    )
    threads: Int | None = Field(
        None,
        ge=1,
        le=1024,
        description="This project's extension: threads of the host update kernel (1-1024, its "
        "pool's size). Null: one per core.",
    )

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> Any:
        return _offload_device(value)

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived ``pipeline`` field: ``pipeline_read or pipeline_write``."""
        return self.pipeline_read or self.pipeline_write

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

    device: OffloadDevice = Field(
        "none",
        description='Where each rank\'s 16-bit param shard lives between uses (stage 3): "none" '
        '(the device), "cpu" (host memory) or "nvme" (a swap file under nvme_path).',
    )
    nvme_path: Str | None = Field(
        None,
        description="A local directory (ideally on an NVMe drive) for the param swap files; "
        'required with device "nvme", ignored (with a warning) otherwise.',
    )
    buffer_count: DsInt = Field(
        5,
        ge=0,
        description='Host buffers params are read into from NVMe (device "nvme"): the slices '
        "read ahead of the fetches and the most recently used ones, for the whole model.",
    )
    buffer_size: DsInt = Field(
        100_000_000,
        ge=0,
        description="Size of each NVMe read buffer (elements); must hold the largest param "
        'group\'s partition (device "nvme").',
    )
    max_in_cpu: DsInt = Field(
        1_000_000_000,
        ge=0,
        description="Param elements kept in host memory (the read buffers and those kept for "
        'reuse) for the whole model, with device "nvme" (elements); on CUDA a pinned buffer '
        "counts the elements its bytes as held by the caching host allocator (a power of two "
        "under 64 MiB) would fit.",
    )
    pin_memory: Bool = Field(
        True,
        description="Page-locked host memory for the param shard (with CUDA): fetches overlap "
        "compute at full bandwidth. Counts against the memlock limit.",
    )

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

    stage: DsInt = Field(
        0,
        description="0: plain data parallel; 1: optimizer state partitioned over the ranks; "
        "2: gradients too; 3: 16-bit params too (gathered per module as they run).",
    )
    contiguous_gradients: Bool = Field(
        True,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: copy gradients into one contiguous buffer as they are produced. "
        "Gradients here always go through contiguous buckets and a contiguous shard.",
    )
    reduce_scatter: Bool = Field(
        True,
        description="Stages 1-3: reduce gradients with reduce-scatter (each rank receives its "
        "own partition); false: all-reduce, then each rank keeps its partition.",
    )
    reduce_bucket_size: DsInt = Field(
        DEFAULT_BUCKET_SIZE,
        gt=0,
        description="Gradient elements reduced at once (elements): larger buckets mean fewer, "
        'bigger collectives and more memory. "auto": hidden_size * hidden_size of the model.',
    )
    use_multi_rank_bucket_allreduce: Bool = Field(
        True,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: all-reduce a bucket holding gradients of several ranks' "
        "partitions in one call.",
    )
    allgather_partitions: Bool = Field(
        True,
        description="Stages 1/2: after the update, gather the updated params with all-gather; "
        "false: one broadcast per rank.",
    )
    allgather_bucket_size: DsInt = Field(
        DEFAULT_BUCKET_SIZE,
        gt=0,
        description="Param elements gathered at once after the update (stages 1/2; a multiple "
        "of 2 there, as DeepSpeed asserts) (elements).",
    )
    overlap_comm: Bool | None = Field(
        None,
        description="Overlap gradient reduction with the backward pass (a side stream, more "
        "memory for buckets in flight). Null: true at stage 3, false below, DeepSpeed's rule.",
    )
    load_from_fp32_weights: Bool = Field(
        True,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: restore the fp32 master weights from the checkpoint's fp32 "
        "copy (not from the 16-bit params). Checkpoints here always load the fp32 masters.",
    )
    elastic_checkpoint: Bool = Field(
        False,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: the old elastic checkpoint format. Checkpoints here load at any "
        "world size without it.",
    )
    enable_sanity_checks: Bool = Field(
        False,
        description="Stage 3: a GatheredParameters block without modifier_rank must not change "
        "a gathered param in place (a new storage or a bumped version counter; a write through "
        "p.data is not seen, as in DeepSpeed): such an edit is refused on every rank, the edits "
        "discarded. Costs one all-reduce per such block. (Ranks gathering different params are "
        "refused whatever this says.)",
    )
    ignore_unused_parameters: Bool = Field(
        True,
        description="Allow trainable params that get no gradient in a backward (their gradient "
        "counts as zero); false: such a param is an error.",
    )
    round_robin_gradients: Bool = Field(
        False,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: stage 1/2 gradient copies to the host spread round-robin over "
        "ranks.",
    )
    compute_grad_norm: Bool = Field(
        True,
        description="Report the global gradient norm (get_global_grad_norm(), the step log); "
        "false (stages 1 and 2 only, with gradient_clipping 0 and no optimizer offload, as "
        "DeepSpeed requires) reports None. Training is the same either way.",
    )
    parameter_alignment: Bool = Field(
        False,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: pad each param's start within the flat buffer.",
    )
    cpu_offload: Bool | None = Field(
        None,
        description='Deprecated in DeepSpeed: true means offload_optimizer {"device": "cpu"}. '
        "Applied at load (then null); not with offload_optimizer.",
    )
    cpu_offload_param: Bool | None = Field(
        None,
        description='Deprecated in DeepSpeed: true means offload_param {"device": "cpu"}. '
        "Applied at load (then null); not with offload_param.",
    )
    offload_optimizer: OffloadOptimizerConfig | None = Field(
        None,
        description="ZeRO-Offload: the optimizer state and update on the host or NVMe "
        "(stages 1-3). Null: on the device.",
    )
    zenflow: ZenFlowConfig | None = Field(
        None,
        description="DeepSpeed's ZenFlow: the top gradient columns updated on the device every "
        "step, the rest on the host every update_interval steps (needs offload_optimizer "
        '"cpu"). Null: off.',
    )
    offload_param: OffloadParamConfig | None = Field(
        None,
        description="ZeRO-Offload / ZeRO-Infinity at stage 3: the 16-bit param shard in host "
        "memory or on NVMe between uses. Null: on the device.",
    )
    stage3_prefetch_bucket_size: DsInt = Field(
        50_000_000,
        ge=0,
        description="Stage 3: param elements fetched ahead of the module that needs them "
        '(elements); 0: no prefetch. "auto": int(0.9 * hidden_size * hidden_size).',
    )
    stage3_param_persistence_threshold: DsInt = Field(
        100_000,
        ge=0,
        description="Stage 3: params with fewer elements than this stay whole on every rank "
        '(not partitioned) (elements). "auto": 10 * hidden_size.',
    )
    stage3_model_persistence_threshold: DsInt = Field(
        sys.maxsize,
        ge=0,
        description="Stage 3: the most elements kept whole on every rank by "
        "stage3_param_persistence_threshold, over the whole model (elements).",
    )
    stage3_max_live_parameters: DsInt = Field(
        1_000_000_000,
        ge=0,
        description="Stage 3: the most gathered param elements resident per rank before "
        "finished ones are released (elements); smaller uses less memory, more communication.",
    )
    stage3_max_reuse_distance: DsInt = Field(
        1_000_000_000,
        ge=0,
        description="Stage 3: a param needed again within this many gathered elements is not "
        "released in between (elements).",
    )
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        False,
        description="Stage 3: save_16bit_model() gathers the partitioned 16-bit weights into "
        "one full state dict; false: at stage 3 it saves nothing (a warning), as DeepSpeed does.",
    )
    sub_group_size: DsInt = Field(
        1_000_000_000,
        gt=0,
        description="DeepSpeed's unit of the offloaded update (elements): the host and NVMe "
        "update run in chunks of this size (at most 4,194,304, 2,048-aligned).",
    )
    memory_efficient_linear: Bool = Field(
        True,
        description="Stage 3: nn.Linear's backward saves the weight param, not the gathered "
        "weight, so a forward does not end holding every gathered weight.",
    )
    leaf_module: LeafModuleConfig = Field(
        default_factory=LeafModuleConfig,
        description="Stage 3: modules fetched whole (as one unit), such as Mixture-of-Experts "
        "blocks whose experts run data-dependently.",
    )

    @classmethod
    def known_keys(cls) -> set[str]:
        return super().known_keys() | set(_ALIAS_OF)

    @model_validator(mode="after")
    def _allgather_alignment(self) -> ZeroConfig:
        """DeepSpeed's stage 1/2 optimizer asserts the all-gather bucket holds whole 4-byte
        words of 16-bit elements (its ``nccl_start_alignment_factor``, 2); the same config is
        refused here, with DeepSpeed's words, so it fails where it would fail there."""
        if self.stage in (1, 2) and self.allgather_bucket_size % NCCL_START_ALIGNMENT_FACTOR:
            raise rule_error(
                "allgather_bucket_size",
                "allgather_bucket_size must be a multiple of nccl_start_alignment_factor, "
                f"{NCCL_START_ALIGNMENT_FACTOR} (got {self.allgather_bucket_size}; stages 1 and 2)",
            )
        return self

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
        _grad_norm_rule(self)
        check_zenflow(self)
        offload = self.offload_optimizer
        if offload is not None and offload.device != "none" and self.stage == 0:
            raise rule_error(
                "offload_optimizer.device",
                f"{json_repr(offload.device)} needs zero_optimization.stage 1, 2 or 3 (stage is "
                "0): the offloaded optimizer updates this rank's partition",
            )
        if offload is not None and offload.ratio < 1.0:
            _partial_offload_rule(offload, self.stage)
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
        effect, and a partial-offload ratio with nothing offloaded (DeepSpeed ignores it)."""
        out = super().non_default_unimplemented(prefix)
        oc = self.offload_optimizer
        if oc is not None and oc.ratio < 1.0 and oc.device == "none":
            key = join_path(prefix, "offload_optimizer.ratio")
            out.append(f'{key}={json_repr(oc.ratio)} (no optimizer offload: device "none")')
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


def _grad_norm_rule(zc: ZeroConfig) -> None:
    """``compute_grad_norm`` false where DeepSpeed allows it (its words)."""
    if zc.compute_grad_norm:
        return
    if zc.stage not in (1, 2):
        raise rule_error(
            "compute_grad_norm",
            f"compute_grad_norm=false is supported only with ZeRO Stage 1 or 2 (stage is {zc.stage})",
        )
    if zc.offload:
        raise rule_error(
            "compute_grad_norm",
            "zero_optimization.compute_grad_norm=false does not support optimizer offload",
        )


def _partial_offload_rule(offload: OffloadOptimizerConfig, stage: int) -> None:
    """``offload_optimizer.ratio`` < 1 where the twin update is built: DeepSpeed's rule (stage
    3 only, asserted for any device) and this project's (the host kernel's "cpu" state, not the
    delayed update). Device "none" is DeepSpeed's no-op (a load warning)."""
    ratio = json_repr(offload.ratio)
    if stage != 3:
        raise rule_error(
            "offload_optimizer.ratio",
            f"partial offload (ratio {ratio} < 1.0) is only supported at ZeRO stage 3 (stage is "
            f"{stage}), as in DeepSpeed; use 1.0 or stage 3",
        )
    if offload.device == "nvme":
        raise rule_error(
            "offload_optimizer.ratio",
            f'partial offload (ratio {ratio} < 1.0) needs offload_optimizer.device "cpu" (not '
            '"nvme")',
        )
    if offload.delayed_update:
        raise rule_error(
            "offload_optimizer.ratio",
            f"partial offload (ratio {ratio} < 1.0) does not combine with "
            "offload_optimizer.delayed_update",
        )


def _checked(model: type[Section], name: str, key: str, value: Any) -> Any:
    """``value`` validated as field ``name``; a failure is an error naming ``key``."""
    field = model.model_fields[name]
    try:
        return TypeAdapter(field.rebuild_annotation()).validate_python(value)
    except ValidationError as exc:
        raise rule_error(key, describe_errors(model, exc, set())[0]) from None
