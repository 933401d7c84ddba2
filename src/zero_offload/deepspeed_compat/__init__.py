"""zero_offload's DeepSpeed-compatible namespace: what ``import deepspeed`` gives with the opt-in
(``ZERO_OFFLOAD_AS_DEEPSPEED=1`` or ``zero_offload.as_deepspeed()``; see
``zero_offload._as_deepspeed``).

A thin layer: every name is zero_offload's own component under DeepSpeed's name (re-exports) or a
small adapter of DeepSpeed's calling conventions onto it. One file per DeepSpeed submodule:
``comm``, ``zero`` (= ``runtime.zero``, with ``partition_parameters``), ``runtime`` (``engine``,
``lr_schedules``, ``config``), ``ops.adam``, ``utils`` (``groups``, ``zero_to_fp32``),
``checkpoint.utils``, ``accelerator``, ``checkpointing`` (= ``runtime.activation_checkpointing.
checkpointing``). A DeepSpeed name zero_offload does not implement raises
``DeepSpeedNotProvidedError`` (an ``AttributeError``, so feature checks with ``hasattr`` see it
absent) naming it; a DeepSpeed module it does not implement raises
``DeepSpeedModuleNotProvidedError`` (a ``ModuleNotFoundError``).
"""

from __future__ import annotations

from .. import api as _api
from .._as_deepspeed import DEEPSPEED_API_VERSION, compat_version
from ..api import add_config_arguments  # noqa: F401
from . import accelerator, checkpoint, comm, launcher, ops, runtime, utils  # noqa: F401
from ._common import (  # noqa: F401
    DeepSpeedModuleNotProvidedError,
    DeepSpeedNotProvidedError,
    as_zero_offload_config,
    not_provided_getattr,
)
from .accelerator import get_accelerator  # noqa: F401
from .comm import init_distributed
from .runtime import zero  # noqa: F401 (DeepSpeed: deepspeed.zero is deepspeed.runtime.zero)
from .runtime.activation_checkpointing import checkpointing  # noqa: F401 (DeepSpeed's alias)
from .runtime.config import DeepSpeedConfigError  # noqa: F401
from .runtime.engine import DeepSpeedEngine  # noqa: F401
from .utils import log_dist, logger  # noqa: F401

__version__ = compat_version()
__version_major__, __version_minor__, __version_patch__ = (
    int(x) for x in DEEPSPEED_API_VERSION.split(".")
)
__git_hash__ = None
__git_branch__ = None

__getattr__ = not_provided_getattr(
    __name__,
    {
        "tp_model_init": " (no tensor parallelism: leave tensor_parallel.autotp_size at 1)",
        "init_inference": " (no inference engine)",
        "PipelineModule": " (no pipeline parallelism)",
    },
)

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    mesh_param=None,
    config_params=None,
):
    """``deepspeed.initialize``: zero_offload's ``initialize`` after DeepSpeed's process-group
    set-up (``init_distributed``: a group of one without a launcher). Returns ``(engine,
    optimizer, training_dataloader, lr_scheduler)``.

    Two settings the Hugging Face libraries write into every config are read as DeepSpeed reads
    them (``as_zero_offload_config``), and ``zero_force_ds_cpu_optimizer`` (default true) refuses
    a client optimizer other than ``DeepSpeedCPUAdam`` under ``offload_optimizer`` with
    ``ZeRORuntimeException``, as DeepSpeed does."""
    if mesh_param is not None:
        raise DeepSpeedNotProvidedError("deepspeed.initialize(mesh_param=...)")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    request = _api.EngineRequest(
        args, model, optimizer, model_parameters, training_data, lr_scheduler, deepspeed_rules=True
    )
    return _api.build_engine(
        request,
        mpu=mpu,
        collate_fn=collate_fn,
        config=as_zero_offload_config(config if config is not None else config_params),
    )
