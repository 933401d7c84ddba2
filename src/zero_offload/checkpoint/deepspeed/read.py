"""DeepSpeed's checkpoint folder read into one plain description: per param group the params
(names, shapes) with their full fp32 master, exp_avg and exp_avg_sq, the Adam step and the
hyperparameters; the module state; counters; the LR scheduler state.

Where DeepSpeed keeps each piece (0.19):

- ``mp_rank_00_model_states.pt``: ``module`` (the state dict), ``param_shapes`` (per group, the
  trainable params in group order), ``frozen_param_shapes``, ``lr_scheduler``, counters, and with
  stage 0 in fp32 the plain optimizer's ``state_dict`` under ``optimizer`` (per-param state; the
  module's params are the master weights).
- stages 1 and 2 (and bf16 at stage 0): one ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per
  rank; ``optimizer_state_dict`` holds this rank's fp32 partition of each group
  (``single_partition_of_fp32_groups``), the inner optimizer's state over the same partition
  (``base_optimizer_state``: exp_avg, exp_avg_sq, step, param_groups), and
  ``param_slice_mappings``: where each param's piece sits in the partition. A param's full data
  is its pieces concatenated in rank order.
- stage 3: ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank with ``param_shapes``, and
  per rank ``fp32_flat_groups``: every param is split into ``ceil(numel / world)`` elements per
  rank, back to back in param order (DeepSpeed's zero_to_fp32 rule); the moments lie alike.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..format import CheckpointError
from .pickle_safe import load_deepspeed_file

MODEL_STATES = "mp_rank_00_model_states.pt"
_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_(optim|model)_states\.pt$")


@dataclass
class DSGroup:
    names: list[str]
    shapes: list[tuple[int, ...]]
    master: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor]
    exp_avg_sq: dict[str, torch.Tensor]
    step: int
    hyper: dict[str, Any]


@dataclass
class DSCheckpoint:
    path: Path
    stage: int
    world_size: int
    module: dict[str, torch.Tensor]
    frozen: list[str]
    groups: list[DSGroup]
    counters: dict[str, int]
    lr_scheduler: dict | None
    config: dict
    loss_scale: dict | None = None
    client_state: dict = field(default_factory=dict)


def tag_dir(src: Path, tag: str | None) -> Path:
    """``src`` itself when it holds the .pt files, else ``src/<tag or latest>``."""
    src = Path(src)
    if any(src.glob("*_model_states.pt")):
        return src
    if tag is None:
        latest = src / "latest"
        if not latest.is_file():
            raise CheckpointError(f"{src}: no 'latest' file and no *_model_states.pt; pass a tag")
        tag = latest.read_text().strip()
    path = src / tag
    if not any(path.glob("*_model_states.pt")):
        raise CheckpointError(f"{path}: no DeepSpeed *_model_states.pt files here")
    return path


def _rank_files(path: Path, kind: str) -> list[Path]:
    found = {}
    for f in path.iterdir():
        m = _RANK.search(f.name)
        if m and m.group(2) == kind:
            found[int(m.group(1))] = f
    if found and sorted(found) != list(range(len(found))):
        raise CheckpointError(
            f"{path}: {kind}_states files for ranks {sorted(found)}: some are missing"
        )
    return [found[r] for r in range(len(found))]


def _int(x: Any) -> int:
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _hyper(group: dict) -> dict[str, Any]:
    keep = ("lr", "betas", "eps", "weight_decay", "bias_correction")
    out = {k: group[k] for k in keep if k in group}
    if "betas" in out:
        out["betas"] = [float(b) for b in out["betas"]]
    return out


def _stage0_names(model_states: dict, where: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Stage 0 saves no param names: match each optimizer param (shape from its exp_avg) to the
    next module key of that shape, in registration order within each group (how param groups
    are normally built). Ambiguity or a miss is an error rather than a guess."""
    opt, module = model_states.get("optimizer"), model_states.get("module") or {}
    if not isinstance(opt, dict) or "param_groups" not in opt:
        raise CheckpointError(f"{where}: no 'param_shapes' and no optimizer state to name params")
    frozen = set(model_states.get("frozen_param_shapes") or {})
    keys = [
        k
        for k, v in module.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in frozen
    ]
    taken: set[str] = set()
    groups = []
    for gi, pg in enumerate(opt["param_groups"]):
        names, cursor = [], 0
        for pid in pg["params"]:
            state = opt["state"].get(pid) or {}
            if "exp_avg" not in state:
                raise CheckpointError(
                    f"{where}: group {gi} param {pid} has no Adam state to size it"
                )
            shape = tuple(state["exp_avg"].shape)
            while cursor < len(keys) and (
                keys[cursor] in taken or tuple(module[keys[cursor]].shape) != shape
            ):
                cursor += 1
            if cursor == len(keys):
                raise CheckpointError(
                    f"{where}: stage 0 keeps no param names and group {gi} param {pid} (shape "
                    f"{list(shape)}) matches no module key in registration order"
                )
            taken.add(keys[cursor])
            names.append((keys[cursor], shape))
        groups.append(names)
    return groups


def _shapes(model_states: dict, where: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    shapes = model_states.get("param_shapes")
    if shapes is None and model_states.get("optimizer") is not None:
        return _stage0_names(model_states, where)
    if not isinstance(shapes, list):
        raise CheckpointError(f"{where}: no 'param_shapes' (not a DeepSpeed checkpoint of 0.4+?)")
    return [[(n, tuple(s)) for n, s in g.items()] for g in shapes]


def read_deepspeed(src: Path, tag: str | None = None) -> DSCheckpoint:
    path = tag_dir(src, tag)
    optim_files = _rank_files(path, "optim")
    model_files = _rank_files(path, "model")
    stage3 = bool(model_files)
    ms_path = model_files[0] if stage3 else path / MODEL_STATES
    if not ms_path.is_file():
        raise CheckpointError(f"{path}: {MODEL_STATES} is missing")
    ms = load_deepspeed_file(ms_path)
    shapes = _shapes(ms, ms_path)
    module = {k: v for k, v in (ms.get("module") or {}).items() if isinstance(v, torch.Tensor)}
    frozen_shapes = {n: tuple(s) for n, s in (ms.get("frozen_param_shapes") or {}).items()}
    frozen = list(frozen_shapes)
    if stage3:  # every rank's model states hold its fragment of each frozen param
        per_rank = [ms] + [load_deepspeed_file(f) for f in model_files[1:]]
        for name, shape in frozen_shapes.items():
            pieces = [r["frozen_param_fragments"][name].reshape(-1) for r in per_rank]
            module[name] = torch.cat(pieces)[: math.prod(shape)].reshape(shape)
    else:
        for name, t in (ms.get("frozen_param_fragments") or {}).items():
            module.setdefault(name, t)
    counters = {
        "global_steps": _int(ms.get("global_steps", 0)),
        "global_samples": _int(ms.get("global_samples", 0)),
        "skipped_steps": _int(ms.get("skipped_steps", 0)),
    }
    known = {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
    }
    client = {k: v for k, v in ms.items() if k not in known}
    config = ms.get("ds_config") or {}
    stage = (
        int((config.get("zero_optimization") or {}).get("stage", 0))
        if isinstance(config, dict)
        else 0
    )
    if optim_files:
        osds = [load_deepspeed_file(f).get("optimizer_state_dict") for f in optim_files]
        if any(not isinstance(o, dict) for o in osds):
            raise CheckpointError(f"{path}: an optim_states file has no 'optimizer_state_dict'")
        zstage = _int(osds[0].get("zero_stage", stage))
        if stage3 or zstage == 3:
            groups = _stage3_groups(osds, shapes, path)
            stage = 3
        else:
            groups = _partitioned_groups(osds, shapes, path)
        loss_scale = _loss_scale(osds[0])
    else:
        groups = _stage0_groups(ms, shapes, module, ms_path)
        loss_scale = None
    if stage3:  # the module state holds placeholders: the weights are the masters, cast
        dtype = _train_dtype(config)
        for g in groups:
            for name in g.names:
                module[name] = g.master[name].to(dtype)
    return DSCheckpoint(
        path=path,
        stage=stage,
        world_size=len(optim_files) or 1,
        module=module,
        frozen=frozen,
        groups=groups,
        counters=counters,
        lr_scheduler=ms.get("lr_scheduler"),
        config=config if isinstance(config, dict) else {},
        loss_scale=loss_scale,
        client_state=client,
    )


def _train_dtype(config: Any) -> torch.dtype:
    if isinstance(config, dict):
        if (config.get("fp16") or {}).get("enabled") is True:
            return torch.float16
        if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") is True:
            return torch.bfloat16
    return torch.float32


def _loss_scale(osd: dict) -> dict | None:
    scaler = osd.get("loss_scaler")
    if scaler is None or not hasattr(scaler, "get"):
        return None
    return {"cur_scale": scaler.get("cur_scale"), "dynamic": bool(osd.get("dynamic_loss_scale"))}


def _partitioned_groups(osds: list[dict], shapes, where: Path) -> list[DSGroup]:
    groups = []
    for gi, params in enumerate(shapes):
        kinds: dict[str, dict[str, list[torch.Tensor]]] = {
            "master": {},
            "exp_avg": {},
            "exp_avg_sq": {},
        }
        step, hyper = 0, {}
        for rank, osd in enumerate(osds):
            try:
                flat = {
                    "master": osd["single_partition_of_fp32_groups"][gi],
                    "exp_avg": osd["base_optimizer_state"]["state"][gi]["exp_avg"],
                    "exp_avg_sq": osd["base_optimizer_state"]["state"][gi]["exp_avg_sq"],
                }
                step = _int(osd["base_optimizer_state"]["state"][gi]["step"])
                hyper = _hyper(osd["base_optimizer_state"]["param_groups"][gi])
                mapping = osd["param_slice_mappings"][gi]
            except (KeyError, IndexError, TypeError) as exc:
                raise CheckpointError(f"{where}: rank {rank} group {gi}: missing {exc}") from None
            for name, addr in mapping.items():
                start, numel = int(addr.get("start")), int(addr.get("numel"))
                for kind, t in flat.items():
                    kinds[kind].setdefault(name, []).append(t[start : start + numel].float())
        groups.append(_assemble(params, kinds, step, hyper, where, gi))
    return groups


def _stage3_groups(osds: list[dict], shapes, where: Path) -> list[DSGroup]:
    world = len(osds)
    flats = {}
    try:
        flats["master"] = [
            torch.cat([t.float().reshape(-1) for t in o["fp32_flat_groups"]]) for o in osds
        ]
        inner = [o["optimizer_state_dict"] for o in osds]
        for kind in ("exp_avg", "exp_avg_sq"):
            flats[kind] = [
                torch.cat([s[kind].float().reshape(-1) for _, s in sorted(i["state"].items())])
                for i in inner
            ]
        first = next(iter(inner[0]["state"].values()))
        step = _int(first["step"])
        # One sub-group per param group (DeepSpeed's default sub_group_size holds a whole group).
        inner_groups = inner[0]["param_groups"]
        hypers = [_hyper(inner_groups[min(gi, len(inner_groups) - 1)]) for gi in range(len(shapes))]
    except (KeyError, IndexError, TypeError, StopIteration) as exc:
        raise CheckpointError(
            f"{where}: stage-3 optimizer state incomplete: missing {exc}"
        ) from None
    groups, offset = [], 0
    for gi, params in enumerate(shapes):
        kinds: dict[str, dict[str, list[torch.Tensor]]] = {
            "master": {},
            "exp_avg": {},
            "exp_avg_sq": {},
        }
        for name, shape in params:
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            for kind, per_rank in flats.items():
                kinds[kind][name] = [per_rank[r][offset : offset + part] for r in range(world)]
            offset += part
        groups.append(_assemble(params, kinds, step, hypers[gi], where, gi))
    return groups


def _stage0_groups(ms: dict, shapes, module: dict, where: Path) -> list[DSGroup]:
    opt = ms.get("optimizer")
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        raise CheckpointError(
            f"{where}: no ZeRO optim_states files and no plain optimizer state under 'optimizer'; "
            "this DeepSpeed optimizer (e.g. fp16 at stage 0) is not supported by the converter"
        )
    groups = []
    for gi, params in enumerate(shapes):
        pg = opt["param_groups"][gi]
        kinds: dict[str, dict[str, list[torch.Tensor]]] = {
            "master": {},
            "exp_avg": {},
            "exp_avg_sq": {},
        }
        # DeepSpeed's FusedAdam counts steps per group (param_groups[g]["step"]); torch's Adam
        # per param. The group's Adam step is the largest count found.
        step = _int(pg.get("step", 0))
        for (name, _), pid in zip(params, pg["params"]):
            state = opt["state"].get(pid, {})
            kinds["master"][name] = [module[name].float().reshape(-1)]
            for kind in ("exp_avg", "exp_avg_sq"):
                t = state.get(kind)
                kinds[kind][name] = [
                    torch.zeros_like(module[name], dtype=torch.float32).reshape(-1)
                    if t is None
                    else t.float().reshape(-1)
                ]
            if "step" in state:
                step = max(step, _int(state["step"]))
        groups.append(_assemble(params, kinds, step, _hyper(pg), where, gi))
    return groups


def _assemble(params, kinds, step: int, hyper: dict, where: Path, gi: int) -> DSGroup:
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in kinds}
    for name, shape in params:
        numel = math.prod(shape)
        for kind, pieces in kinds.items():
            got = torch.cat(pieces.get(name, [])) if pieces.get(name) else torch.empty(0)
            if got.numel() < numel:
                raise CheckpointError(
                    f"{where}: group {gi} param {name!r}: {kind} has {got.numel()} of {numel} elements"
                )
            out[kind][name] = got[:numel].reshape(shape).clone()
    return DSGroup(
        names=[n for n, _ in params],
        shapes=[s for _, s in params],
        master=out["master"],
        exp_avg=out["exp_avg"],
        exp_avg_sq=out["exp_avg_sq"],
        step=step,
        hyper=hyper,
    )
