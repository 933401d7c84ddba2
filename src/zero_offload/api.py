"""``initialize`` and ``add_config_arguments``: DeepSpeed's entry points."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .config.precision.compact_states import refuse_client_optimizer
from .core import dist
from .runtime.engine.engine import ZeroOffloadEngine
from .runtime.update.muon.muon_groups import default_flags, muon_param_groups

log = logging.getLogger("zero_offload")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` flags to ``parser``."""
    group = parser.add_argument_group("zero_offload", "zero_offload / DeepSpeed configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable the engine (accepted for DeepSpeed compatibility)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed JSON config path"
    )
    return parser


def initialize(
    args=None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable | None = None,
    model_parameters: Iterable | None = None,
    training_data=None,
    lr_scheduler=None,
    distributed_port=None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    config_params=None,
):
    """Build the engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    return build_engine(
        EngineRequest(args, model, optimizer, model_parameters, training_data, lr_scheduler),
        mpu=mpu,
        collate_fn=collate_fn,
        config=config,
        config_params=config_params,
    )


@dataclass(frozen=True)
class EngineRequest:
    """What the caller hands ``initialize``; ``deepspeed_rules`` applies DeepSpeed's
    ``zero_force_ds_cpu_optimizer`` refusal and its Muon ``use_muon`` marking
    (``deepspeed.initialize`` sets it)."""

    args: Any = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | Callable | None = None
    model_parameters: Iterable | None = None
    training_data: Any = None
    lr_scheduler: Any = None
    deepspeed_rules: bool = False


def build_engine(
    request: EngineRequest, *, mpu=None, collate_fn=None, config=None, config_params=None
):
    """``initialize``'s work, for either API (see :class:`EngineRequest`)."""
    args, model, optimizer = request.args, request.model, request.optimizer
    model_parameters, training_data, lr_scheduler = (
        request.model_parameters,
        request.training_data,
        request.lr_scheduler,
    )
    if model is None:
        raise ValueError("initialize: 'model' is required (a torch.nn.Module)")
    if mpu is not None:
        raise ValueError("initialize: 'mpu' (model parallelism) is not supported; pass mpu=None")
    source = _config_source(args, config, config_params)
    dist.init_distributed()
    cfg = _load(source, args)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    optimizer = _client_optimizer(optimizer, model, model_parameters, cfg)
    if optimizer is not None:
        refuse_client_optimizer(cfg, optimizer)
    if request.deepspeed_rules and optimizer is not None:
        _refuse_like_deepspeed(optimizer, cfg)
    if request.deepspeed_rules and cfg.optimizer is not None and cfg.optimizer.muon:
        default_flags(model)  # DeepSpeed's set_optimizer_flags
    groups, adamw, client = _param_groups(model, model_parameters, optimizer, cfg)
    if client is not None:
        _check_client(client, cfg)
    loader = _dataloader(training_data, cfg, collate_fn) if training_data is not None else None
    engine = ZeroOffloadEngine(model, cfg, groups, adamw, training_dataloader=loader, client=client)
    if groups:  # no optimizer (inference, a frozen reference model): no LR scheduler either
        _attach_scheduler(engine, cfg, lr_scheduler)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _config_source(args, config, config_params):
    """The config as given: ``config``, ``config_params`` or the command line's flag."""
    from .config import ConfigError

    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
        if getattr(args, "deepscale_config", None) is not None:  # DeepSpeed's old flag name
            log.warning("--deepscale_config is deprecated, please use --deepspeed_config")
            if config is not None:
                raise ConfigError("given both --deepscale_config and --deepspeed_config")
            config = args.deepscale_config
    if config is None:
        raise ValueError(
            "initialize: no config; pass config= (dict or JSON path) or --deepspeed_config"
        )
    return config


def _load(config, args):
    from .config import ConfigError, load_config

    try:
        return load_config(config, world_size=dist.world_size())
    except ConfigError as e:
        # Megatron-style scripts (the seeds') give the micro batch as --batch-size, not in the JSON.
        micro = getattr(args, "batch_size", None)
        if not isinstance(micro, int) or "train_micro_batch_size_per_gpu" not in str(e):
            raise
        return load_config(config, world_size=dist.world_size(), micro_batch_size=micro)


def _client_optimizer(optimizer, model: torch.nn.Module, model_parameters, cfg):
    """The client optimizer (a callable is called on the params), or None."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise ValueError(
                f"initialize: 'optimizer' must be a torch optimizer or a callable, got {type(optimizer).__name__}"
            )
        optimizer = optimizer(
            list(model_parameters) if model_parameters is not None else model.parameters()
        )
    if optimizer is not None and cfg.optimizer is not None:
        log.warning(  # DeepSpeed's rule: the client optimizer wins
            "initialize: both a client optimizer (%s) and an 'optimizer' config block (%s) were "
            "given; using the client optimizer, the config block is ignored",
            type(optimizer).__name__,
            cfg.optimizer.type,
        )
    return optimizer


def _refuse_like_deepspeed(client: torch.optim.Optimizer, cfg) -> None:
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (default true): under ``offload_optimizer``
    a client optimizer must be ``DeepSpeedCPUAdam``, else ``ZeRORuntimeException``."""
    from .deepspeed_compat.runtime.zero.utils import ZeRORuntimeException
    from .ops.adam import DeepSpeedCPUAdam

    if not cfg.zero_optimization.offload or not cfg.zero_force_ds_cpu_optimizer:
        return
    if isinstance(client, DeepSpeedCPUAdam):
        return
    raise ZeRORuntimeException(
        f"initialize: ZeRO-Offload (zero_optimization.offload_optimizer) with the client "
        f"optimizer {type(client).__name__}: DeepSpeed requires deepspeed.ops.adam."
        "DeepSpeedCPUAdam or an 'optimizer' config block here; set "
        '"zero_force_ds_cpu_optimizer": false to run this optimizer on the host (torch '
        "Adam/AdamW then use the SIMD kernel)"
    )


def _check_client(client: torch.optim.Optimizer, cfg) -> None:
    """A client optimizer that is not Adam(W) runs over in-memory state, synchronously."""
    from .config import ConfigError

    if cfg.zero_optimization.offload_device == "nvme":
        raise ConfigError(
            'zero_optimization.offload_optimizer.device: "nvme" streams the built-in Adam(W) '
            f"update chunk by chunk; the client optimizer {type(client).__name__} keeps its own "
            "state in memory: use device \"cpu\", or an 'optimizer' config block / torch Adam(W)"
        )
    if not cfg.zero_optimization.offload:
        return
    if cfg.zero_optimization.offload_optimizer.delayed_update:
        raise ConfigError(
            "zero_optimization.offload_optimizer.delayed_update needs the built-in Adam(W) "
            f"(an 'optimizer' config block or a torch Adam/AdamW); the client optimizer "
            f"{type(client).__name__} runs synchronously: remove delayed_update"
        )
    log.warning(
        "initialize: the client optimizer %s runs on the host with offload_optimizer, in its "
        "own CPU implementation (Adam/AdamW use the faster SIMD kernel)",
        type(client).__name__,
    )


def _attach_scheduler(engine: ZeroOffloadEngine, cfg, lr_scheduler) -> None:
    """The config's scheduler block, else the caller's scheduler (or its factory)."""
    from .schedulers import build_lr_scheduler

    if cfg.scheduler is not None:
        engine.lr_scheduler = build_lr_scheduler(cfg.scheduler, engine.optimizer)
    elif lr_scheduler is not None:
        engine.lr_scheduler = (
            lr_scheduler(engine.optimizer)
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step")
            else lr_scheduler
        )


def _adam_mode(client_opt: torch.optim.Optimizer) -> bool | None:
    """Decoupled weight decay (AdamW) or not, for a client optimizer the built-in Adam runs
    exactly; None for any other optimizer (a subclass may change the update), which then runs
    as itself (client_update.py)."""
    from .ops.adam import DeepSpeedCPUAdam, FusedAdam

    groups = client_opt.param_groups
    if any(g.get("amsgrad") or g.get("maximize") for g in groups):
        return None
    if type(client_opt) in (DeepSpeedCPUAdam, FusedAdam):
        return bool(client_opt.adam_w_mode)
    if type(client_opt) is torch.optim.AdamW:
        return True
    if type(client_opt) is torch.optim.Adam:
        modes = {bool(g.get("decoupled_weight_decay", False)) for g in groups}
        return modes.pop() if len(modes) == 1 else None
    return None


def _param_groups(
    model, model_parameters, client_opt, cfg
) -> tuple[list[dict], bool, torch.optim.Optimizer | None]:
    """Param groups (dicts with every Adam hyperparameter), the decoupled-decay flag, and the
    client optimizer to run as itself (None: the built-in Adam(W)). No optimizer at all (none
    given, none configured) or no trainable param: no groups, an engine for forward only."""
    generic = None
    if client_opt is not None:
        mode = _adam_mode(client_opt)
        adamw = bool(mode)
        if mode is None:
            generic = client_opt
        raw = client_opt.param_groups
        defaults = {}
    else:
        if cfg.optimizer is None:
            log.info("initialize: no optimizer given or configured: an engine for forward only")
            return [], True, None
        src = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if cfg.optimizer.muon:
            hyper = cfg.optimizer.params
            raw = muon_param_groups(src, hyper.muon_group(), hyper.aux_group())
            # adam_w_mode: the aux group's decay (the Muon group's is decoupled either way)
            return _checked_groups(model, raw, {}, None, None, cfg.optimizer.adamw)
        p = cfg.optimizer.params
        adamw = cfg.optimizer.adamw
        defaults = {
            "lr": p.lr,
            "betas": tuple(p.betas),
            "eps": p.eps,
            "weight_decay": p.weight_decay,
            "bias_correction": p.bias_correction,
        }
        raw = src if src and isinstance(src[0], dict) else [{"params": src}]
    return _checked_groups(model, raw, defaults, client_opt, generic, adamw)


def _checked_groups(model, raw, defaults, client_opt, generic, adamw: bool = True):
    """Each group's trainable params, every one the model's and in one group only."""
    owned = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    groups = []
    for i, g in enumerate(raw):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"model_parameters[{i}]: expected a tensor or a dict with 'params'")
        params = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        kept = []
        for p in params:
            if id(p) not in owned:
                raise ValueError(f"model_parameters[{i}]: a parameter does not belong to the model")
            if id(p) in seen:
                raise ValueError(
                    f"model_parameters[{i}]: a parameter appears in more than one group"
                )
            seen.add(id(p))
            if p.requires_grad:
                kept.append(p)
        if kept:
            hyper = g if client_opt is not None else {**defaults, **g}
            if generic is None:
                hyper.setdefault("bias_correction", True)
            hyper["params"] = kept
            groups.append(hyper)
    if not groups:
        log.info("initialize: no trainable parameters: an engine for forward only")
    return groups, adamw, generic


def _dataloader(data, cfg, collate_fn):
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        data, num_replicas=dist.world_size(), rank=dist.rank(), shuffle=True, seed=cfg.seed or 0
    )
    return DataLoader(
        data, batch_size=cfg.train_micro_batch_size_per_gpu, sampler=sampler, collate_fn=collate_fn
    )
