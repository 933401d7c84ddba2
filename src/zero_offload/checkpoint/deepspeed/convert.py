"""A DeepSpeed checkpoint written out in this project's format (docs/checkpoints.md).

The output is a world-size-1, unsharded checkpoint: per param group the fp32 master, exp_avg and
exp_avg_sq in this project's flat order, Adam's step and hyperparameters; the module state; the
counters and the LR scheduler state. Elastic resume re-slices it into any world size, stage and
placement. The loading engine's param groups must hold the same params as DeepSpeed's did (the
same param-group code), since this format matches groups by position and names.

Not carried over: RNG states (DeepSpeed does not save them) and the fp16 loss scale (the dynamic
scale restarts at its initial value).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from ...core.layout import build_layout
from .. import atomic
from ..format import (
    FORMAT,
    FORMAT_VERSION,
    LAYOUT_KEY,
    META_FILE,
    MODEL_FILE,
    RANK_META_KEY,
    SHARD_KINDS,
    CheckpointError,
    check_tag,
    json_value,
    layout_digests,
    rank_file,
    sealed_meta_bytes,
    shard_tensor,
)
from ..module_state import alias_map
from ..tensor_file import Entry, write_file
from .read import DSCheckpoint, read_deepspeed, tag_dir

_BUCKET = 500_000_000  # one layout per group; the loader re-slices into its own anyway
_ALIGN = 16


def is_deepspeed_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> bool:
    """Whether ``path`` (a save_dir or a tag folder) holds a DeepSpeed checkpoint."""
    try:
        tag_dir(Path(path), tag)
    except (CheckpointError, OSError, UnicodeDecodeError, ValueError):
        return False  # not DeepSpeed's (or unreadable): this project's loader reports it
    return True


def _json_or_none(value, where: str):
    try:
        return json_value(value, where)
    except CheckpointError:
        return None


def _group_tensors(ds: DSCheckpoint, order: dict[str, int]):
    metas, entries = [], []
    for gi, g in enumerate(ds.groups):
        by_name = dict(zip(g.names, g.shapes))
        # This project's flat order: reverse registration order (the module state's key order).
        names = sorted(g.names, key=lambda n: order.get(n, len(order)), reverse=True)
        shapes = [by_name[n] for n in names]
        numels = [math.prod(s) for s in shapes]
        layout = build_layout(numels, 1, _BUCKET, _ALIGN)
        for kind in SHARD_KINDS:
            flat = torch.zeros(layout.total, dtype=torch.float32)
            source = getattr(g, kind)
            for name, off, n in zip(names, layout.offsets, numels):
                flat[off : off + n] = source[name].reshape(-1)
            entries.append(Entry.of(shard_tensor(gi, kind), flat))
        metas.append(
            {
                "names": names,
                "shapes": [list(s) for s in shapes],
                "numels": numels,
                "bucket_params": [list(b.params) for b in layout.buckets],
                "align": _ALIGN,
                "layout_world_size": 1,
                "sharded": False,
                "step_count": int(g.step),
                "hyper": g.hyper,
            }
        )
    return metas, entries


def _dtype(ds: DSCheckpoint) -> str:
    trainable = {n for g in ds.groups for n in g.names}
    for name, t in ds.module.items():
        if name in trainable and t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def _check_trainable(ds: DSCheckpoint, trainable: set[str]) -> None:
    """Every trainable param of param_shapes must be in the module state."""
    missing = sorted(trainable - set(ds.module))
    if missing:
        raise CheckpointError(
            f"{ds.model_file}: module: expected the model's state dict with every trainable "
            f"param of param_shapes; missing: {missing}"
        )


def _meta(
    ds: DSCheckpoint,
    out_tag: str,
    groups: list[dict],
    sd: dict[str, torch.Tensor],
    aliases: dict,
    trainable: set[str],
    files: dict,
) -> dict:
    """The converted checkpoint's meta: a world-size-1, stage-0 checkpoint of ``ds``'s state,
    naming where it came from."""
    from ... import __version__

    gas = ds.grad_accum
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {"zero_offload": __version__, "torch": torch.__version__},
        "converted_from": {
            "deepspeed": str(ds.path),
            "stage": ds.stage,
            "world_size": ds.world_size,
        },
        "tag": out_tag,
        "world_size": 1,
        "stage": 0,
        "offload": False,
        "dtype": _dtype(ds),
        "counters": {
            **ds.counters,
            "micro_steps": ds.counters["global_steps"] * gas,
        },
        "loss_scaler": {
            "kind": "DeepSpeed",
            "state": _json_or_none(ds.loss_scale, "loss_scale"),
        },
        "lr_scheduler": _json_or_none(ds.lr_scheduler, "lr_scheduler"),
        "client_state": _json_or_none(ds.client_state, "client_state") or {},
        "config": _json_or_none(ds.config, "config") or {},
        "groups": groups,
        "model": {
            "file": MODEL_FILE,
            "keys": list(sd),
            "aliases": aliases,
            "params": [k for k in sd if k in trainable or k in set(ds.frozen) or k in aliases],
            "frozen": sorted(set(ds.frozen) & set(sd)),
        },
        "ranks": {"files": [rank_file(0)]},
        "files": files,
    }


def _write_staged(
    ds: DSCheckpoint,
    stage_dir: Path,
    out_tag: str,
    groups: list[dict],
    shard_entries: list,
    trainable: set[str],
) -> None:
    """Write the rank file, the model file and the sealed meta into ``stage_dir``."""
    rank_info = {"rank": 0, "world_size": 1, "rng": {}, LAYOUT_KEY: layout_digests(groups)}
    files = {
        rank_file(0): write_file(
            stage_dir / rank_file(0), shard_entries, {RANK_META_KEY: json.dumps(rank_info)}
        )
    }
    sd = {k: v.detach().contiguous() for k, v in ds.module.items()}
    aliases = alias_map(sd, prefer=trainable)
    files[MODEL_FILE] = write_file(
        stage_dir / MODEL_FILE,
        [Entry.of(k, t) for k, t in sd.items() if k not in aliases],
        {"format": "pt"},
    )
    meta = _meta(ds, out_tag, groups, sd, aliases, trainable, files)
    atomic.write_bytes_atomic(stage_dir / META_FILE, sealed_meta_bytes(meta))


def convert_deepspeed_checkpoint(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], tag: str | None = None
) -> Path:
    """Convert DeepSpeed's ``src`` (a save_dir with ``latest``, or a ``global_stepN`` folder)
    into ``dst/<tag>`` in this project's format and point ``dst/latest`` at it. Returns the
    written tag folder."""
    ds = read_deepspeed(Path(src), tag)
    out_tag = check_tag(ds.path.name)
    root = Path(dst)
    root.mkdir(parents=True, exist_ok=True)
    order = {k: i for i, k in enumerate(ds.module)}
    groups, shard_entries = _group_tensors(ds, order)
    trainable = {n for g in ds.groups for n in g.names}
    _check_trainable(ds, trainable)
    stage_dir = atomic.prepare_staging(root, out_tag)
    try:
        _write_staged(ds, stage_dir, out_tag, groups, shard_entries, trainable)
        atomic.publish(root, out_tag)
        atomic.write_latest(root, out_tag)
    except BaseException:
        import shutil

        shutil.rmtree(stage_dir, ignore_errors=True)
        raise
    return root / out_tag
