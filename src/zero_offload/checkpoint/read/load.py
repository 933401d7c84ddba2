"""Loading: plan and validate everything (load_plan.py), agree across ranks, then apply.
A collective. Only when every rank's plan succeeded does any rank apply it, so a bad
checkpoint never leaves a partial load behind.

Apply: module tensors from the model file, master/exp_avg/exp_avg_sq slices straight into the
live shards (host or device), padding zeroed, 16-bit params rebuilt from the master (own slices,
then all-gather), then counters, loss scaler, LR scheduler and this rank's RNG states.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...core import dist
from ...core.state.torn import TornStateError
from .. import rng
from ..collective import failed_ranks
from ..format import MODEL_FILE, RNG_CUDA, RNG_TORCH, CheckpointError, shard_tensor
from .load_plan import COUNTERS, LoadPlan, extra_reader, make_plan
from .reader import CheckpointReader

log = logging.getLogger("zero_offload")


# ---- apply --------------------------------------------------------------------------------------
@torch.no_grad()
def _apply(
    engine,
    ckpt: CheckpointReader,
    plan: LoadPlan,
    use_opt: bool,
    module_only: bool,
    load_lr_scheduler_states: bool,
) -> None:
    with engine.params_on_host(write_back=True):  # stage 3: into every rank's param shard
        live = engine.module.state_dict()
        for key, target in plan.module:
            live[key].copy_(ckpt.read_tensor(MODEL_FILE, target))
    if use_opt:
        saved = ckpt.groups
        for og, gp, old in zip(engine.opt_groups, plan.groups, saved):
            load = og.load()
            load.begin(old.client)
            for kind in old.kinds:  # kind by kind: an NVMe state's cached region is reused
                write = load.writer(kind)
                for f, src, dst, n in gp.reads:
                    write(dst, ckpt.read_slice(f, shard_tensor(og.index, kind), src, src + n))
                for lo, hi in gp.padding:
                    write(lo, torch.zeros(hi - lo, dtype=torch.float32))
            load.extra(extra_reader(ckpt, plan, og.index))
            _restore_hyper(og.flat.hyper, old.hyper)
            load.finish(old.step_count)  # the 16-bit params: the master's cast, as after a step
    else:
        for og in engine.opt_groups:  # master from the loaded 16-bit weights
            og.master_from_params()
    if not module_only:
        meta = ckpt.meta
        for k, v in meta["counters"].items():
            if k in COUNTERS:
                setattr(engine, k, int(v))
        if use_opt:
            _restore_loss_scaler(engine, meta)
        sched = meta.get("lr_scheduler")
        if load_lr_scheduler_states and engine.lr_scheduler is not None and sched is not None:
            engine.lr_scheduler.load_state_dict(sched)
        if plan.rng_json is not None:
            header = ckpt.header(plan.rng_file)
            tensors = {
                t: ckpt.read_tensor(plan.rng_file, t)
                for t in (RNG_TORCH, RNG_CUDA)
                if t in header.tensors
            }
            rng.restore(plan.rng_json, tensors, engine.device)
    engine.zero_grad()  # a new accumulation window starts at the loaded step


def _agree_on_extra(engine, ckpt: CheckpointReader, plan: LoadPlan) -> None:
    """The ranks' saved extra state (ZenFlow's micro-step and columns) is one state: compared
    across ranks before anything is loaded, refused on every rank where it differs."""
    digests = []
    for og in engine.opt_groups:
        fetch = extra_reader(ckpt, plan, og.index) if plan.rng_file is not None else None
        d = og.optimizer.extra_digest(fetch) if fetch is not None else None
        digests.append(torch.full((3,), -1, dtype=torch.int64) if d is None else d)
    if not digests:
        return
    mine = torch.cat(digests).to(engine.device)
    low, high = mine.clone(), mine.clone()
    dist.all_reduce(low, op="min")
    dist.all_reduce(high, op="max")
    differ = (low != high).view(-1, 3).any(dim=1)
    if bool(differ.any()):
        gi = int(differ.nonzero()[0])
        ckpt.close()
        raise CheckpointError(
            f"{ckpt.path}: param group {gi}: the ranks' files hold different ZenFlow state "
            "(micro-step or selected columns): the ranks would train apart; nothing was loaded"
        )


def _restore_hyper(hyper: dict, saved: dict) -> None:
    """The saved lr, betas, eps, ... as DeepSpeed's optimizer state restores them."""
    for k, v in saved.items():
        if k == "params" or k not in hyper:
            continue
        cur = hyper[k]
        if isinstance(cur, torch.Tensor):
            cur.fill_(v)
        elif isinstance(cur, tuple) and isinstance(v, list):
            hyper[k] = tuple(v)
        else:
            hyper[k] = v


def _restore_loss_scaler(engine, meta: dict) -> None:
    saved = meta.get("loss_scaler") or {}
    same_kind = saved.get("kind") == type(engine.loss_scaler).__name__
    same_dtype = meta.get("dtype") == str(engine.dtype).removeprefix("torch.")
    if same_kind and same_dtype:
        engine.loss_scaler.load_state_dict(saved["state"])
    else:  # e.g. fp16 saved, bf16 resumed: a saved fp16 scale would be wrong here
        log.info(
            "checkpoint loss scaler (%s, %s) not restored into a %s %s engine",
            saved.get("kind"),
            meta.get("dtype"),
            type(engine.loss_scaler).__name__,
            engine.dtype,
        )


def _refuse_deepspeed_folder(load_dir, tag) -> None:
    from ..deepspeed import is_deepspeed_checkpoint

    if is_deepspeed_checkpoint(load_dir, tag):
        raise CheckpointError(
            f"{load_dir} is a DeepSpeed checkpoint, not this project's format; convert it once "
            f"with: zero-offload convert-deepspeed {load_dir} CONVERTED_DIR, then load "
            "CONVERTED_DIR (weights, fp32 master, Adam state and scheduler carry over)"
        )


def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    load_module_strict: bool = True,
):
    """Load ``<load_dir>/<tag>`` (``latest``'s tag when None) into ``engine``; returns
    ``(checkpoint directory, client_state)``, or ``(None, None)`` when ``tag`` is None and there
    is no ``latest`` file (DeepSpeed's behaviour). A collective: every rank calls it.
    ``load_module_strict`` False: module keys on one side only are skipped (the model keeps its
    own values) instead of refused."""
    try:
        engine.flush_delayed_update()  # a pending host update must not land on top of the load
    except TornStateError:
        pass  # a failed update: the load replaces what it left
    _refuse_deepspeed_folder(load_dir, tag)
    err: BaseException | None = None
    ckpt = plan = None
    use_opt = load_optimizer_states and not load_module_only
    try:
        ckpt = CheckpointReader.open(Path(load_dir), tag)
        if ckpt is not None:
            with engine.params_on_host():  # stage 3: the module's full shapes
                plan = make_plan(engine, ckpt, use_opt, load_module_only, load_module_strict)
    except Exception as e:
        err = e
    failed = failed_ranks(engine.device, err is None)
    if failed:
        if ckpt is not None:
            ckpt.close()
        if err is not None:
            raise err
        raise CheckpointError(
            f"checkpoint validation failed on rank(s) {failed}; nothing was loaded"
        )
    if ckpt is not None and plan is not None and use_opt and engine.world_size > 1:
        if len(ckpt.meta["ranks"]["files"]) == engine.world_size:  # else ZenFlow starts afresh
            _agree_on_extra(engine, ckpt, plan)
    if ckpt is None:
        log.warning(
            "no %s file in %s: nothing loaded (pass tag= to load a specific checkpoint)",
            "latest",
            load_dir,
        )
        return None, None
    with ckpt:
        _apply(engine, ckpt, plan, use_opt, load_module_only, load_lr_scheduler_states)
    return str(ckpt.path), ckpt.meta.get("client_state", {})
