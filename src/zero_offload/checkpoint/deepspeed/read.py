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

import contextlib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..format import CheckpointError, check_tag, read_text
from .pickle_safe import load_deepspeed_file

MODEL_STATES = "mp_rank_00_model_states.pt"
_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_(optim|model)_states\.pt$")
_STATE_DICT = "the model's state dict (a dict of name -> tensor)"

# The model states keys DeepSpeed writes itself; any other key is the client's state.
_KNOWN_KEYS = frozenset(
    {
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
)


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
    model_file: Path  # the model states file: module, param_shapes, counters, ds_config
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
    grad_accum: int = 1  # ds_config's gradient_accumulation_steps


# What indexing into a file of the wrong structure raises (a list where a dict belongs, a key
# missing, a string where a tensor belongs): each becomes an error naming the file.
_MALFORMED = (
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    ValueError,
    RuntimeError,
    OverflowError,
    StopIteration,
)


def _brief(value: Any) -> str:
    """``value`` for a one-line message: its type and a short repr."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    text = " ".join(repr(value).split())
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


@contextlib.contextmanager
def _expect(where: Path, what: str):
    """Reading ``what`` from ``where``: a piece that is not what DeepSpeed writes becomes one
    error naming the file and what was expected, not a bare KeyError or TypeError."""
    try:
        yield
    except CheckpointError:
        raise
    except _MALFORMED as exc:
        if isinstance(exc, KeyError) and exc.args:
            got = f"key {exc.args[0]!r} is missing"
        else:
            lines = str(exc).strip().splitlines()
            got = f"{type(exc).__name__}: {lines[0] if lines else 'no detail'}"
        raise CheckpointError(
            f"{where}: not the structure DeepSpeed writes: expected {what} ({got})"
        ) from None


def _shape(value: Any, where: Path, what: str) -> tuple[int, ...]:
    if isinstance(value, list | tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        return tuple(value)
    raise CheckpointError(
        f"{where}: {what}: expected a shape (a list of non-negative integers), got {_brief(value)}"
    )


def _dict(value: Any, where: Path, key: str, what: str) -> dict:
    """``value`` (the file's ``key``) when it is a dict with string keys (None reads as empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise CheckpointError(f"{where}: {key}: expected {what}, got {_brief(value)}")
    return value


def tag_dir(src: Path, tag: str | None) -> Path:
    """``src`` itself when it holds the .pt files, else ``src/<tag or latest>``."""
    src = Path(src)
    if any(src.glob("*_model_states.pt")):
        return src
    if tag is None:
        latest = src / "latest"
        if not latest.is_file():
            raise CheckpointError(f"{src}: no 'latest' file and no *_model_states.pt; pass a tag")
        tag = read_text(latest).strip()
        try:  # ``latest`` may only name a folder of its own save_dir (no "..", "/", absolute)
            check_tag(tag)
        except CheckpointError as e:
            raise CheckpointError(
                f"{latest}: {e}; DeepSpeed's 'latest' must name a tag folder inside {src}"
            ) from None
    else:
        check_tag(str(tag))
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


def _number(x: Any, key: str) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise TypeError(f"param group {key!r} is {_brief(x)}, not a number")
    return float(x)


def _hyper(group: dict) -> dict[str, Any]:
    """The Adam hyperparameters of an optimizer param group, as numbers (raises TypeError or
    ValueError for a group that is not a dict of them; callers name the file)."""
    if not isinstance(group, dict):
        raise TypeError(f"a param group is {_brief(group)}, not a dict")
    out: dict[str, Any] = {
        k: _number(group[k], k) for k in ("lr", "eps", "weight_decay") if k in group
    }
    if "betas" in group:
        betas = [_number(b, "betas") for b in group["betas"]]
        if len(betas) != 2:
            raise ValueError(f"param group 'betas' has {len(betas)} values, not 2")
        out["betas"] = betas
    if "bias_correction" in group:
        out["bias_correction"] = bool(group["bias_correction"])
    return out


def _stage0_names(model_states: dict, where: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Stage 0 saves no param names: match each optimizer param (shape from its exp_avg) to the
    next module key of that shape, in registration order within each group (how param groups
    are normally built). Ambiguity or a miss is an error rather than a guess."""
    opt, module = model_states.get("optimizer"), model_states.get("module") or {}
    if not isinstance(opt, dict) or "param_groups" not in opt:
        raise CheckpointError(f"{where}: no 'param_shapes' and no optimizer state to name params")
    with _expect(
        where, "stage 0's plain optimizer state under 'optimizer' ('state', 'param_groups')"
    ):
        return _stage0_match(opt, module, model_states, where)


def _stage0_match(opt: dict, module: dict, model_states: dict, where: Path):
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
    if shapes is None:
        raise CheckpointError(f"{where}: no 'param_shapes' (not a DeepSpeed checkpoint of 0.4+?)")
    if not isinstance(shapes, list):
        raise CheckpointError(
            f"{where}: param_shapes: expected a list with one dict (param name -> shape) per "
            f"param group, got {_brief(shapes)}"
        )
    if not shapes:  # the optimizer state would be dropped without a word
        raise CheckpointError(
            f"{where}: param_shapes: expected one dict (param name -> shape) per param group, "
            "got an empty list"
        )
    out = []
    for gi, g in enumerate(shapes):
        g = _dict(g, where, f"param_shapes[{gi}]", "a dict of param name -> shape")
        out.append([(n, _shape(s, where, f"param_shapes[{gi}][{n!r}]")) for n, s in g.items()])
    return out


def _frozen_shapes(ms: dict, ms_path: Path) -> dict[str, tuple[int, ...]]:
    """The frozen params' shapes (``frozen_param_shapes``), name -> shape, checked."""
    return {
        n: _shape(s, ms_path, f"frozen_param_shapes[{n!r}]")
        for n, s in _dict(
            ms.get("frozen_param_shapes"), ms_path, "frozen_param_shapes", "a dict of name -> shape"
        ).items()
    }


def _stage3_frozen(
    module: dict[str, torch.Tensor],
    ms: dict,
    ms_path: Path,
    model_files: list[Path],
    frozen_shapes: dict[str, tuple[int, ...]],
) -> None:
    """Stage 3: each frozen param into ``module``, joined from every rank's padded fragment
    (``frozen_param_fragments`` of each rank's model states)."""
    fragments = ms.get("frozen_param_fragments")
    if not frozen_shapes and isinstance(fragments, dict) and fragments:
        raise CheckpointError(  # the frozen weights would be dropped without a word
            f"{ms_path}: frozen_param_shapes: expected a dict of name -> shape for the params "
            f"in 'frozen_param_fragments', got {_brief(ms.get('frozen_param_shapes'))}"
        )
    per_rank = [(ms_path, ms)] + [(f, load_deepspeed_file(f)) for f in model_files[1:]]
    for name, shape in frozen_shapes.items():
        part = math.ceil(math.prod(shape) / len(per_rank))  # each rank's padded fragment
        pieces = []
        for f, r in per_rank:
            what = f"frozen_param_fragments[{name!r}]: a tensor of {part} elements"
            frags = _dict(
                r.get("frozen_param_fragments"),
                f,
                "frozen_param_fragments",
                "a dict of name -> tensor",
            )
            with _expect(f, what):
                piece = frags[name].reshape(-1)
                if piece.numel() != part:
                    raise ValueError(f"it has {piece.numel()} elements")
            pieces.append(piece)
        module[name] = torch.cat(pieces)[: math.prod(shape)].reshape(shape)


def _whole_frozen(module: dict[str, torch.Tensor], ms: dict, ms_path: Path) -> None:
    """Stages 0 to 2: the frozen params kept whole in ``frozen_param_fragments`` added to
    ``module`` where it lacks them."""
    fragments = _dict(
        ms.get("frozen_param_fragments"), ms_path, "frozen_param_fragments", _STATE_DICT
    )
    for name, t in fragments.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(
                f"{ms_path}: 'frozen_param_fragments'[{name!r}]: expected a tensor, got {_brief(t)}"
            )
        module.setdefault(name, t)


def _counters(ms: dict, ms_path: Path) -> dict[str, int]:
    """The step and sample counters, non-negative integers (0 where absent)."""
    with _expect(
        ms_path, "non-negative integer counters 'global_steps', 'global_samples', 'skipped_steps'"
    ):
        counters = {
            "global_steps": _int(ms.get("global_steps", 0)),
            "global_samples": _int(ms.get("global_samples", 0)),
            "skipped_steps": _int(ms.get("skipped_steps", 0)),
        }
        for key, value in counters.items():  # a count below 0 would resume a run before it began
            if value < 0:
                raise ValueError(f"{key} is {value}")
    return counters


def _config(ms: dict, ms_path: Path) -> tuple[Any, int, int]:
    """``ds_config`` as saved, with the ZeRO stage and gradient accumulation steps it names
    (0 and 1 without one); ``ds_config`` and ``lr_scheduler`` must be dicts or None."""
    config = ms.get("ds_config")
    for key in ("ds_config", "lr_scheduler"):  # carried into the converted checkpoint as is
        if not isinstance(ms.get(key), (dict, type(None))):
            raise CheckpointError(
                f"{ms_path}: {key}: expected a dict (or None), got {_brief(ms.get(key))}"
            )
    stage, grad_accum = 0, 1
    if isinstance(config, dict):
        with _expect(
            ms_path,
            "'ds_config' to be DeepSpeed's config: an integer zero_optimization.stage and "
            "gradient_accumulation_steps",
        ):
            stage = int((config.get("zero_optimization") or {}).get("stage", 0))
            grad_accum = int(config.get("gradient_accumulation_steps", 1) or 1)
            if grad_accum < 1:
                raise ValueError(f"gradient_accumulation_steps is {grad_accum}, not >= 1")
    return config, stage, grad_accum


def _optimizer_states(optim_files: list[Path]) -> list[dict]:
    """Each rank's ``optimizer_state_dict`` (DeepSpeed's ZeRO optimizer state), in rank order."""
    osds = []
    for f in optim_files:
        osd = load_deepspeed_file(f).get("optimizer_state_dict")
        if not isinstance(osd, dict):
            raise CheckpointError(
                f"{f}: optimizer_state_dict: expected a dict (DeepSpeed's ZeRO optimizer "
                f"state), got {_brief(osd)}"
            )
        osds.append(osd)
    return osds


def _zero_groups(
    path: Path,
    optim_files: list[Path],
    ms_path: Path,
    shapes: list[list[tuple[str, tuple[int, ...]]]],
    stage: int,
    stage3: bool,
) -> tuple[list[DSGroup], dict | None, int]:
    """The param groups read from the ZeRO ``optim_states`` files, the loss scale and the
    stage (3 where the files are stage 3's, else ``stage``)."""
    osds = _optimizer_states(optim_files)
    with _expect(optim_files[0], "an integer 'zero_stage' in 'optimizer_state_dict'"):
        zstage = _int(osds[0].get("zero_stage", stage))
    if stage3 or zstage == 3:
        groups = _stage3_groups(osds, shapes, path, optim_files, ms_path)
        stage = 3
    else:
        groups = _partitioned_groups(osds, shapes, path, optim_files)
    with _expect(optim_files[0], "a boolean 'dynamic_loss_scale' in 'optimizer_state_dict'"):
        loss_scale = _loss_scale(osds[0])
    return groups, loss_scale, stage


def _module_from_masters(
    module: dict[str, torch.Tensor], groups: list[DSGroup], config: Any
) -> None:
    """Stage 3's module state holds placeholders: each trainable param becomes its master,
    cast to the training dtype."""
    dtype = _train_dtype(config)
    for g in groups:
        for name in g.names:
            module[name] = g.master[name].to(dtype)


def read_deepspeed(src: Path, tag: str | None = None) -> DSCheckpoint:
    """Read DeepSpeed's checkpoint in ``src`` (a save_dir, with ``tag`` or ``latest``, or a tag
    folder) into one plain description; anything not as DeepSpeed writes it is an error naming
    the file."""
    path = tag_dir(src, tag)
    optim_files = _rank_files(path, "optim")
    model_files = _rank_files(path, "model")
    stage3 = bool(model_files)
    ms_path = model_files[0] if stage3 else path / MODEL_STATES
    if not ms_path.is_file():
        raise CheckpointError(f"{path}: {MODEL_STATES} is missing")
    ms = load_deepspeed_file(ms_path)
    module = {
        k: v
        for k, v in _dict(ms.get("module"), ms_path, "module", _STATE_DICT).items()
        if isinstance(v, torch.Tensor)
    }
    shapes = _shapes(ms, ms_path)
    frozen_shapes = _frozen_shapes(ms, ms_path)
    if stage3:  # every rank's model states hold its fragment of each frozen param
        _stage3_frozen(module, ms, ms_path, model_files, frozen_shapes)
    else:
        _whole_frozen(module, ms, ms_path)
    counters = _counters(ms, ms_path)
    client = {k: v for k, v in ms.items() if k not in _KNOWN_KEYS}
    config, stage, grad_accum = _config(ms, ms_path)
    if optim_files:
        groups, loss_scale, stage = _zero_groups(path, optim_files, ms_path, shapes, stage, stage3)
    else:
        groups = _stage0_groups(ms, shapes, module, ms_path)
        loss_scale = None
    if stage3:  # the module state holds placeholders: the weights are the masters, cast
        _module_from_masters(module, groups, config)
    return DSCheckpoint(
        path=path,
        model_file=ms_path,
        stage=stage,
        world_size=len(optim_files) or 1,
        module=module,
        frozen=list(frozen_shapes),
        groups=groups,
        counters=counters,
        lr_scheduler=ms.get("lr_scheduler"),
        config=config if isinstance(config, dict) else {},
        loss_scale=loss_scale,
        client_state=client,
        grad_accum=grad_accum,
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
    dynamic = osd.get("dynamic_loss_scale")
    if not isinstance(dynamic, (bool, type(None))):
        raise TypeError(f"dynamic_loss_scale is {_brief(dynamic)}")
    return {"cur_scale": scaler.get("cur_scale"), "dynamic": bool(dynamic)}


def _partitioned_groups(osds: list[dict], shapes, where: Path, files: list[Path]) -> list[DSGroup]:
    groups = []
    for gi, params in enumerate(shapes):
        kinds: dict[str, dict[str, list[torch.Tensor]]] = {
            "master": {},
            "exp_avg": {},
            "exp_avg_sq": {},
        }
        step, hyper = 0, {}
        for rank, osd in enumerate(osds):
            with _expect(
                files[rank],
                f"param group {gi}'s flat fp32 partition ('single_partition_of_fp32_groups'), "
                "its Adam state ('base_optimizer_state') and 'param_slice_mappings'",
            ):
                flat = {
                    "master": osd["single_partition_of_fp32_groups"][gi],
                    "exp_avg": osd["base_optimizer_state"]["state"][gi]["exp_avg"],
                    "exp_avg_sq": osd["base_optimizer_state"]["state"][gi]["exp_avg_sq"],
                }
                step = _int(osd["base_optimizer_state"]["state"][gi]["step"])
                hyper = _hyper(osd["base_optimizer_state"]["param_groups"][gi])
                mapping = osd["param_slice_mappings"][gi]
                for kind, t in flat.items():
                    if not isinstance(t, torch.Tensor) or t.dim() != 1:
                        raise TypeError(f"{kind} of group {gi} is {_brief(t)}, not a 1-D tensor")
                for name, addr in mapping.items():
                    start, numel = int(addr.get("start")), int(addr.get("numel"))
                    if start < 0 or numel < 0 or start + numel > flat["master"].numel():
                        raise ValueError(
                            f"{name!r} at [{start}, {start + numel}) lies outside the "
                            f"{flat['master'].numel()} elements of the partition"
                        )
                    for kind, t in flat.items():
                        kinds[kind].setdefault(name, []).append(t[start : start + numel].float())
        groups.append(_assemble(params, kinds, step, hyper, where, gi))
    return groups


def _stage3_groups(
    osds: list[dict], shapes, where: Path, files: list[Path], shapes_file: Path
) -> list[DSGroup]:
    world = len(osds)
    flats: dict[str, list[torch.Tensor]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    for rank, o in enumerate(osds):
        with _expect(
            files[rank],
            "stage 3's flat fp32 partitions ('fp32_flat_groups') and the inner optimizer's "
            "state ('optimizer_state_dict': 'state' with exp_avg, exp_avg_sq, step; "
            "'param_groups')",
        ):
            flats["master"].append(
                torch.cat([t.float().reshape(-1) for t in o["fp32_flat_groups"]])
            )
            inner = o["optimizer_state_dict"]
            for kind in ("exp_avg", "exp_avg_sq"):
                flats[kind].append(
                    torch.cat(
                        [s[kind].float().reshape(-1) for _, s in sorted(inner["state"].items())]
                    )
                )
            if rank == 0:
                first = next(iter(inner["state"].values()))
                step = _int(first["step"])
                # One sub-group per param group (DeepSpeed's default sub_group_size holds a
                # whole group).
                inner_groups = inner["param_groups"]
                hypers = [
                    _hyper(inner_groups[min(gi, len(inner_groups) - 1)])
                    for gi in range(len(shapes))
                ]
    need = sum(math.ceil(math.prod(shape) / world) for params in shapes for _, shape in params)
    held = flats["master"][0].numel()
    if need != held:  # DeepSpeed's own reader refuses this too: params would go missing
        raise CheckpointError(
            f"{shapes_file}: param_shapes name {need} elements per rank, but the flat fp32 "
            f"partitions ('fp32_flat_groups') of {files[0]} hold {held}: one of the two does "
            "not describe this checkpoint"
        )
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
    with _expect(
        where,
        "the plain optimizer's 'state' and 'param_groups' under 'optimizer', one per "
        "'param_shapes' group, and each param under 'module'",
    ):
        return _stage0_state(opt, shapes, module, where)


def _stage0_state(opt: dict, shapes, module: dict, where: Path) -> list[DSGroup]:
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
            with _expect(where, f"group {gi} param {name!r}'s {kind} pieces to be 1-D tensors"):
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
