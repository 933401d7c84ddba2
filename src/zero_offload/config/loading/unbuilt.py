"""Which accepted-but-not-built DeepSpeed settings change training, and how.

A DeepSpeed config often carries keys for features this project does not build, most of them at
their off value (``"wandb": {"enabled": false}``, ``"zero_quantized_weights": false``) or tuning
only how fast DeepSpeed runs. The load warning names only the keys whose value would make
DeepSpeed train differently from this project, each with what differs. A key is *off* when its
value is DeepSpeed's default, empty, false, zero, ``"none"``, a block with ``"enabled": false``,
or a block whose every value is off.
"""

from __future__ import annotations

from typing import Any

from ..errors import json_repr

# Keys (the last part of the path) that never change what a training step computes: speed,
# memory layout, logging and permissions. Never warned.
NO_TRAINING_EFFECT = frozenset(
    {
        "allgather_size",
        "allgather_sequential",
        "autotuning",
        "comet",
        "comms_logger",
        "contiguous_gradients",
        "cpu_offload_use_pin_memory",
        "cpuadam_cores_perc",
        "csv_monitor",
        "dataloader_drop_last",
        "datastates",
        "disable_allgather",
        "dump_state",
        "elastic_checkpoint",
        "flops_profiler",
        "fused_mode",
        "legacy_fusion",
        "log_level",
        "log_trace_cache_warnings",
        "memory_breakdown",
        "module_granularity_threshold",
        "override_module_apply",
        "parameter_alignment",
        "partition_stream_chunk_size",
        "pipeline_loading_checkpoint",
        "round_robin_gradients",
        "set_grad_none",
        "tensorboard",
        "timers",
        "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce",
        "use_node_local_storage",
        "wandb",
        "zero_allow_untested_optimizer",
    }
)

# DeepSpeed's defaults where they are not an off value of their own.
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "zero_hpz_partition_size": 1,
    "sequence_parallel_size": 1,
    "seq_parallel_communication_data_type": "fp32",
    "check_grad_overflow": True,
    "convert_grad_on_cpu": True,
}

# What differs from DeepSpeed when the key is on (the generic text otherwise).
DIFFERS: dict[str, str] = {
    "communication_data_type": "gradients are reduced in the gradient dtype, not this one",
    "compile": "DeepCompile is not built; engine.compile() is plain torch.compile",
    "data_efficiency": "no data sampling or routing: the loader's batches are used as given",
    "fp16_master_weights_and_grads": "the master weights and gradients stay fp32",
    "immediate_grad_update": "gradients are reduced per bucket, not applied as they arrive",
    "check_grad_overflow": "bf16 steps are checked for non-finite gradients as fp32 ones are",
    "load_from_fp32_weights": "a resume always restores the fp32 master from the checkpoint",
    "gradient_predivide_factor": "gradients are averaged after the reduction (no pre-division)",
    "prescale_gradients": "gradients are averaged after the reduction, not before",
    "zero_quantized_weights": "params are gathered unquantized",
    "zero_quantized_nontrainable_weights": "frozen params are gathered unquantized",
    "zero_quantized_gradients": "gradients are reduced unquantized",
    "zero_hpz_partition_size": "no secondary (hpZ) param partition",
    "super_offload": "the optimizer offload runs as plain ZeRO-Offload",
}
GENERIC = "not built here: the run trains as DeepSpeed does with it off"


def is_off(name: str, value: Any) -> bool:
    """Whether ``value`` of the key ``name`` leaves DeepSpeed's feature off."""
    if name in DEEPSPEED_DEFAULTS and value == DEEPSPEED_DEFAULTS[name]:
        return True
    if value is None or value is False or value == 0 or value in ("", "none", "None"):
        return True
    if isinstance(value, dict):
        if value.get("enabled") is False:
            return True
        return all(is_off(key, item) for key, item in value.items())
    return isinstance(value, (list, tuple)) and not value


def notes(values: dict[str, Any]) -> list[str]:
    """``path=value (what differs)`` for each key of ``values`` (path -> value as given) whose
    value changes training."""
    out = []
    for path, value in values.items():
        name = path.rsplit(".", 1)[-1].removeprefix("stage3_")  # both DeepSpeed spellings
        if name in NO_TRAINING_EFFECT or is_off(name, value):
            continue
        shown = json_repr(value) if not isinstance(value, dict) else "{...}"
        out.append(f"{path}={shown} ({DIFFERS.get(name, GENERIC)})")
    return out


def default_only_notes(entries: list[str]) -> list[str]:
    """The ``path=value`` entries of fields acted on only at their default, less those that
    never change training, each with what differs (entries that already say so are kept)."""
    out = []
    for entry in entries:
        name = entry.split("=", 1)[0].rsplit(".", 1)[-1]
        if name in NO_TRAINING_EFFECT:
            continue
        out.append(entry if entry.endswith(")") else f"{entry} ({DIFFERS.get(name, GENERIC)})")
    return out
