"""The whole config: :class:`ZeroOffloadConfig`, DeepSpeed's top-level keys and defaults.

Build it with :func:`zero_offload.config.load_config`, which also rejects unknown keys with a
suggestion, warns once about accepted-but-ignored DeepSpeed keys, and resolves the batch triple
for the run's world size. After that the batch fields are always ints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .activation_checkpointing import ActivationCheckpointingConfig
from .batch import resolve_batch_sizes
from .errors import ConfigError, json_repr
from .fields import DEFAULT_ONLY, Bool, Float, Int, Section, rule_error
from .loading.keys import describe_errors
from .optim.optimizer import OptimizerConfig
from .optim.scheduler import SCHEDULER_CONFIGS, AnySchedulerConfig, canonical_scheduler_type
from .optim.scheduler import normalize_scheduler as _normalize_scheduler
from .precision.compact_states import compact_state_rules
from .precision.fp16_bf16 import BF16Config, FP16Config
from .precision.torch_autocast import TorchAutocastConfig
from .runtime_keys import CheckpointConfig, DataTypesConfig, allreduce_op
from .zero.aio import AioConfig
from .zero.zero_optimization import ZeroConfig

# DeepSpeed's top-level keys (deepspeed/runtime/constants.py and the configs it reads) that
# this project accepts and ignores. Each present one is named in the not-implemented warning.
TOP_LEVEL_NOT_IMPLEMENTED = frozenset(
    {
        "allgather_size",  # read only with "zero_optimization": true (config/loading/load.py)
        "autotuning",
        "comet",
        "comms_logger",
        "communication_data_type",
        "compile",
        "csv_monitor",
        "data_efficiency",
        "dataloader_drop_last",
        "datastates",
        "disable_allgather",
        "dump_state",
        "expert_parallel",
        "flops_profiler",
        "hybrid_engine",
        "log_level",
        "memory_breakdown",
        "pipeline",
        "seq_parallel_communication_data_type",
        "sequence_parallel_size",
        "tensor_parallel",
        "tensorboard",
        "timers",
        "use_data_before_expert_parallelism",
        "vocabulary_size",
        "wandb",
        "weight_quantization",
        "zero_allow_untested_optimizer",
    }
)


def _gradient_scaling_rules(config: ZeroOffloadConfig) -> None:
    """DeepSpeed's refusals (its words): pre-scaling and pre-division at stage 3 with
    reduce-scatter (its ZeRO-3 optimizer asserts), and compute_grad_norm false with clipping."""
    zc = config.zero_optimization
    if zc.stage == 3 and zc.reduce_scatter:
        if config.prescale_gradients:
            raise rule_error(
                "prescale_gradients",
                "pre-scale gradients is not yet supported with ZeRO-3 with reduce scatter enabled",
            )
        if config.gradient_predivide_factor != 1.0:
            raise rule_error(
                "gradient_predivide_factor",
                "gradient_predivide_factor != 1.0 is not yet supported with ZeRO-3 with reduce "
                f"scatter enabled (got {json_repr(config.gradient_predivide_factor)})",
            )
    if not zc.compute_grad_norm and config.gradient_clipping > 0.0:
        raise rule_error(
            "zero_optimization.compute_grad_norm",
            "zero_optimization.compute_grad_norm=false requires gradient_clipping=0 (got "
            f"{json_repr(config.gradient_clipping)})",
        )


class ZeroOffloadConfig(Section):
    """A validated DeepSpeed-style config. Key names and defaults are DeepSpeed's; ``seed`` is
    this project's extension (seeds torch on every rank)."""

    NOT_IMPLEMENTED: ClassVar[frozenset[str]] = TOP_LEVEL_NOT_IMPLEMENTED
    KEY_HINTS: ClassVar[dict[str, str]] = {
        key: f'a key of the "bf16" block: "bf16": {{"enabled": true, "{key}": true}}'
        for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states")
    }

    # The batch triple: resolved by the validator below, ints once validated.
    train_batch_size: Int | None = Field(
        None,
        gt=0,
        description="Samples per optimizer step over all ranks: train_micro_batch_size_per_gpu "
        "* gradient_accumulation_steps * world size. Any two of the three imply the third; "
        'null or "auto": derived.',
    )
    train_micro_batch_size_per_gpu: Int | None = Field(
        None,
        gt=0,
        description='Samples per rank in one forward/backward pass. Null or "auto": derived '
        "from the other two (or from train_batch_size alone, with one accumulation step).",
    )
    gradient_accumulation_steps: Int | None = Field(
        None,
        gt=0,
        description="Micro-steps (forward/backward passes) whose gradients are summed into one "
        'optimizer step. Null or "auto": derived, 1 when only one batch key is given.',
    )
    optimizer: OptimizerConfig | None = Field(
        None,
        description="The built-in optimizer (Adam, AdamW, Adam8bit, AdamW8bit or Muon). Null: "
        "none, unless a client "
        "optimizer is passed to initialize() (which wins over this block, with a warning).",
    )
    scheduler: AnySchedulerConfig | None = Field(
        None,
        description="The learning-rate schedule, stepped at every optimizer step (WarmupLR, "
        "WarmupDecayLR or WarmupCosineLR). Null: none, or a client scheduler.",
    )
    fp16: FP16Config = Field(
        default_factory=FP16Config,
        description="fp16 mixed precision with loss scaling (16-bit params, fp32 master weights).",
    )
    bf16: BF16Config = Field(
        default_factory=BF16Config,
        description='bf16 mixed precision (no loss scaling). DeepSpeed\'s old key "bfloat16" '
        "is read as this one.",
    )
    zero_optimization: ZeroConfig = Field(
        default_factory=ZeroConfig,
        description="The ZeRO stage and its settings: buckets, offloads, stage-3 fetching.",
    )
    aio: AioConfig = Field(
        default_factory=AioConfig,
        description='Asynchronous I/O for NVMe offload; read only with a "nvme" offload device.',
    )
    gradient_clipping: Float = Field(
        1.0,
        ge=0.0,
        description="Clip the global gradient L2 norm (over every rank's gradients) to this "
        "value before the update; 0 disables. The default is DeepSpeed's since 0.16.",
    )
    steps_per_print: Int | None = Field(
        None,
        ge=1,
        description="Log the step count, learning rates, loss scale, gradient norm and time per "
        "step every this many optimizer steps (rank 0). Null, DeepSpeed's default: no step log.",
    )
    zero_force_ds_cpu_optimizer: Bool = Field(
        True,
        description="DeepSpeed's rule for deepspeed.initialize (the namespace): with "
        "offload_optimizer, a client optimizer other than DeepSpeedCPUAdam is refused with "
        "ZeRORuntimeException unless this is false. zero_offload.initialize runs any client "
        "optimizer on the host (torch Adam/AdamW with the SIMD kernel) and does not read it.",
    )
    wall_clock_breakdown: Bool = Field(
        False,
        description="Time forward, backward and step (synchronizing the device so the times "
        "are its own) and log their totals (ms) on rank 0 with the step log, or every step "
        "without one.",
    )
    seed: Int | None = Field(
        None,
        ge=0,
        le=2**63 - 1,
        description="This project's extension: torch.manual_seed(seed) on every rank at "
        "initialize(). Null: torch's generator is left as it is.",
    )
    max_consecutive_overflows: Int = Field(
        10,
        ge=0,
        description="This project's extension: stop with an error after this many consecutive "
        "optimizer steps skipped for non-finite gradients that loss scaling cannot fix "
        "(steps); 0 never stops.",
    )
    managed_gradient_accumulation: Bool = Field(
        True,
        description="True: the engine counts micro-steps and step() updates only at the "
        "accumulation boundary. False: backward() only accumulates and every step() is a "
        "boundary (the caller decides).",
    )
    gradient_allreduce_op: Literal["mean", "sum"] = Field(
        "mean",
        description='How gradients combine over the data-parallel ranks: "mean" averages, '
        '"sum" keeps the unscaled sum (not with stage 3). Matched case-insensitively.',
    )
    disable_python_gc: Bool = Field(
        False,
        description="Turn Python's automatic cyclic garbage collection off (after one "
        "collection) while the engine lives; engine.collect_python_gc() collects when the "
        "caller chooses. Restored when the last such engine is destroyed.",
    )
    torch_autocast: TorchAutocastConfig = Field(
        default_factory=TorchAutocastConfig,
        description="DeepSpeed's native-autocast mode: forwards under torch.autocast, params "
        "in their own dtype.",
    )
    data_types: DataTypesConfig = Field(
        default_factory=DataTypesConfig,
        description="The dtypes gradients accumulate in and params train in.",
    )
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig,
        description="What deepspeed.checkpointing.checkpoint (zero_offload.activation_"
        "checkpointing) does with the inputs it keeps: host memory, synchronization, timing. "
        "Applied at initialize() when it differs from the defaults, unless the script called "
        "configure() (which wins whenever it is called).",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Checkpoint saving options.",
    )
    prescale_gradients: Bool = Field(
        False,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: divide gradients by the world size before the all-reduce "
        "rather than after (the same mean; only the rounding differs). Refused at stage 3 with "
        "reduce_scatter, as DeepSpeed refuses it.",
    )
    gradient_predivide_factor: Float = Field(
        1.0,
        gt=0.0,
        json_schema_extra=DEFAULT_ONLY,
        description="DeepSpeed: divide gradients by this factor before the mean all-reduce and "
        "by world size / factor after (an fp16 range aid on many ranks). Refused at stage 3 "
        "with reduce_scatter, as DeepSpeed refuses it.",
    )

    _world_size: int = PrivateAttr(1)
    _ignored_keys: tuple[str, ...] = PrivateAttr(())
    _auto_keys: frozenset[str] = PrivateAttr(frozenset())
    _source: dict[str, Any] | None = PrivateAttr(None)

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: Any) -> Any:
        return allreduce_op(value)

    @field_validator("aio", mode="before")
    @classmethod
    def _aio(cls, value: Any) -> Any:
        return {} if value is None else value  # DeepSpeed reads "aio": null as its defaults

    @field_validator("scheduler", mode="before")
    @classmethod
    def _scheduler_type(cls, value: Any) -> Any:
        return _normalize_scheduler(value)

    @model_validator(mode="after")
    def _rules(self, info: ValidationInfo) -> ZeroOffloadConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise rule_error(
                "bf16.enabled", "fp16.enabled and bf16.enabled are both true; pick one"
            )
        compact_state_rules(self)
        stage = self.zero_optimization.stage
        if self.optimizer is not None and self.optimizer.muon:
            _muon_rules(self.zero_optimization)
        if self.gradient_allreduce_op == "sum" and stage == 3:
            raise rule_error("gradient_allreduce_op", '"sum" is not supported with ZeRO stage 3')
        _gradient_scaling_rules(self)
        training = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(self.dtype, "fp32")
        dt = self.data_types
        if dt.param_dtype is not None and dt.param_dtype != training:
            raise rule_error(
                "data_types.param_dtype",
                f"{json_repr(dt.param_dtype)} differs from the training dtype {training} "
                "(set by the fp16/bf16 blocks)",
            )
        wider = (training, dt.grad_accum_dtype) == ("bf16", "fp32")  # DeepSpeed's BF16_Optimizer
        if dt.grad_accum_dtype not in (None, training) and stage < 2 and not wider:
            raise rule_error(
                "data_types.grad_accum_dtype",
                f"{json_repr(dt.grad_accum_dtype)} with {training} params is built for ZeRO stages "
                f"2 and 3 (a separate accumulator); at stage {stage} the only other accumulator is "
                '"fp32" with bf16 params',
            )
        context = info.context or {}
        world_size = context.get("world_size", 1)
        try:
            sizes = resolve_batch_sizes(
                self.train_batch_size,
                self.train_micro_batch_size_per_gpu,
                self.gradient_accumulation_steps,
                world_size,
                micro_batch_size=context.get("micro_batch_size"),
            )
        except ConfigError as exc:
            # Batch messages already name every key they involve.
            raise PydanticCustomError(
                "config_rule", "{msg}", {"key": "", "msg": exc.problems[0]}
            ) from None
        self._settle(
            **sizes._asdict(),
            _world_size=world_size,
            # What load_config found on the way, kept for auto_keys, ignored_keys and reloading.
            _source=context.get("source"),
            _ignored_keys=tuple(context.get("ignored", ())),
            _auto_keys=frozenset(context.get("auto", ())),
        )
        return self

    @classmethod
    def nested_section(cls, key: str, raw: dict[str, Any]) -> type[Section] | None:
        if key == "scheduler":
            value = raw.get("scheduler")
            name = canonical_scheduler_type(value.get("type")) if isinstance(value, dict) else None
            return SCHEDULER_CONFIGS[name] if name else None
        return super().nested_section(key, raw)

    @property
    def dtype(self) -> torch.dtype:
        """The training (model param) dtype."""
        if self.fp16.enabled:
            return torch.float16
        if self.bf16.enabled:
            return torch.bfloat16
        return torch.float32

    @property
    def world_size(self) -> int:
        """The data-parallel world size the batch triple was resolved for."""
        return self._world_size

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """Full paths of the accepted-but-ignored DeepSpeed keys this config set."""
        return self._ignored_keys

    @property
    def auto_keys(self) -> frozenset[str]:
        """Full paths of the keys the source config set to ``"auto"`` (loaded as the default;
        :func:`zero_offload.config.loading.auto_sizes.resolve_auto_sizes` fills the size ones)."""
        return self._auto_keys

    def updated(self, changes: Mapping[str, Any]) -> ZeroOffloadConfig:
        """A new validated config: these settings with ``changes`` applied, for the same world
        size (a dict given for a section merges into it: ``{"zero_optimization":
        {"reduce_bucket_size": 4096}}``). Every rule is checked again, and a broken one raises
        ConfigError naming the key. This config is left as it is (configs are read-only)."""
        data = _merged(self.model_dump(), changes)
        context = {
            "world_size": self._world_size,
            "source": self._source,
            "ignored": self._ignored_keys,
            "auto": self._auto_keys,
        }
        try:
            return ZeroOffloadConfig.model_validate(data, context=context)
        except ValidationError as exc:
            raise ConfigError(describe_errors(ZeroOffloadConfig, exc, set())) from None

    # DeepSpeed's engine.config is a dict: transformers reads
    # ``engine.config.get("zero_optimization", {}).get("stage")`` on every save. The typed
    # config answers from its resolved settings (every key, defaults filled in).
    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def to_dict(self) -> dict[str, Any]:
        """Every setting, resolved, as plain JSON values (for logs and checkpoint metadata).
        ``load_config(cfg.to_dict(), cfg.world_size)`` gives an equal config."""
        return self.model_dump(mode="json")


def _muon_rules(zc) -> None:
    """Muon runs over the whole reduced gradient of each matrix at stages 0-3, its state on the
    device or, with ``offload_optimizer`` "cpu", in host memory (``runtime/update/
    muon_update.py``), with either ``reduce_scatter``: the step all-gathers each matrix's
    look-ahead from the ranks' reduced shards, which either reduction leaves alike. What it is
    not built for is refused by key."""
    if not zc.offload:
        return
    device = json_repr(zc.offload_device)
    if zc.offload_device != "cpu":
        raise rule_error(
            "zero_optimization.offload_optimizer.device",
            f'{device} with optimizer "Muon": its state is offloaded to host memory only; use '
            '"cpu" or "none"',
        )
    if zc.offload_optimizer.ratio < 1.0:
        raise rule_error(
            "zero_optimization.offload_optimizer.ratio",
            f'{json_repr(zc.offload_optimizer.ratio)} with optimizer "Muon": partial offload '
            "(a device and a host part of each shard) is built for Adam only; use ratio 1.0",
        )
    if zc.offload_optimizer.delayed_update:
        raise rule_error(
            "zero_optimization.offload_optimizer.delayed_update",
            'true with optimizer "Muon": its step all-gathers the look-ahead of every matrix, '
            "a collective that cannot run behind the next forward; set it false",
        )


def _merged(base: dict[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` laid over it, a dict into a dict key by key (neither is
    modified)."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out
