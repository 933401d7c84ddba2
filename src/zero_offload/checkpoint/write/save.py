"""Saving: every rank writes its own shard file, rank 0 the model file and ``meta.json``, and the
directory is published atomically (see atomic.py). A collective: every rank calls it.

Everything that could refuse the save (the tag, non-JSON ``client_state`` or scheduler state) is
checked before the first byte is written, and ranks agree that all of them succeeded before rank 0
publishes, so a failure on any rank leaves ``save_dir`` as it was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import torch

from .. import atomic, rng
from ..collective import agree, agree_on_tag
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
    read_json,
    sealed_meta_bytes,
    shard_tensor,
    writing,
)
from ..module_state import alias_map, frozen_param_names, module_state, param_names
from ..scripts.script_source import SCRIPTS_DIR, recovery_script_source
from ..tensor_file import Entry, write_file
from .finite_state import check_tensor, checked

log = logging.getLogger("zero_offload")


def _agree(engine, err: BaseException | None, what: str, cleanup=None) -> None:
    """Raise on every rank if any rank failed ``what`` (the failing rank re-raises its own error)."""
    agree(engine.device, err, f"checkpoint {what}", cleanup)


def _hyper_json(hyper: dict) -> dict:
    """A param group's hyperparameters that JSON can carry (a tensor lr becomes a float)."""
    out = {}
    for k, v in hyper.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        try:
            out[k] = json_value(v, k)
        except CheckpointError:
            continue  # not a hyperparameter the update reads; a custom group annotation
    return out


def _client_spec(client) -> dict | None:
    """A client optimizer's state as the checkpoint records it (see client_update.py)."""
    if client is None:
        return None
    try:
        return json_value(client.checkpoint_spec(), "client optimizer state")
    except ValueError as e:
        raise CheckpointError(
            f"save_checkpoint: the client optimizer {type(client.optimizer).__name__}: {e}; "
            "only elementwise state (one value per parameter element) and scalars can be saved "
            "per rank and resliced"
        ) from None


def _common_meta(engine, tag: str, client_state) -> dict:
    """Rank-independent metadata; raises before anything is written when it cannot be JSON."""
    import safetensors

    from ... import __version__

    sched = engine.lr_scheduler
    groups = []
    for saved in (og.save() for og in engine.opt_groups):
        g, layout = saved.flat, saved.flat.layout
        groups.append(
            {
                "names": list(g.names),
                "shapes": [list(getattr(p, "ds_shape", p.shape)) for p in g.params],
                "numels": list(layout.numels),
                "bucket_params": [list(b.params) for b in layout.buckets],
                "align": layout.align,
                "layout_world_size": layout.world_size,
                "sharded": saved.sharded,
                "step_count": saved.step_count,
                "hyper": _hyper_json(g.hyper),
                "client": _client_spec(saved.client),
            }
        )
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": {
            "zero_offload": __version__,
            "torch": torch.__version__,
            "safetensors": getattr(safetensors, "__version__", "unknown"),
        },
        "tag": tag,
        "world_size": engine.world_size,
        "stage": engine.stage,
        "offload": bool(engine.placement.host_update),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "counters": {
            k: int(getattr(engine, k))
            for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")
        },
        "loss_scaler": {
            "kind": type(engine.loss_scaler).__name__,
            "state": json_value(engine.loss_scaler.state_dict(), "loss_scaler.state_dict()"),
        },
        "lr_scheduler": None
        if sched is None
        else json_value(sched.state_dict(), "lr_scheduler.state_dict()"),
        "client_state": json_value({} if client_state is None else client_state, "client_state"),
        "config": json_value(engine.config.to_dict(), "config"),
        "groups": groups,
    }


def _write_rank_file(engine, stage: Path, groups: list) -> dict:
    """This rank's master shard and optimizer state (stage 0: rank 0 alone, every rank holds the
    same) and its RNG states."""
    entries = []
    if engine.stage >= 1 or engine.global_rank == 0:
        for gi, saved in enumerate(og.save() for og in engine.opt_groups):
            # an update's own state beside its shard (ZenFlow's mid-interval state)
            entries += [Entry.of(shard_tensor(gi, k), t) for k, t in saved.extra.items()]
            if saved.client is None:
                entries += [_state_entry(shard_tensor(gi, k), saved, k, gi) for k in SHARD_KINDS]
                continue
            entries.append(_state_entry(shard_tensor(gi, "master"), saved, "master", gi))
            entries += [
                Entry.of(shard_tensor(gi, f"client.{k}"), saved.client_shard(k))
                for k in groups[gi]["client"]["shard"]
            ]
    rng_json, rng_tensors = rng.capture(engine.device)
    entries += [Entry.of(k, v) for k, v in rng_tensors.items()]
    info = {
        "rank": engine.global_rank,
        "world_size": engine.world_size,
        "rng": rng_json,
        LAYOUT_KEY: layout_digests(groups),  # the layout meta.json must describe
    }
    path = stage / rank_file(engine.global_rank)
    with writing(path):
        return write_file(path, entries, {RANK_META_KEY: json.dumps(info)})


def _state_entry(name: str, saved, kind: str, gi: int) -> Entry:
    """One kind of a group's optimizer state (``OptimizerGroup.save``): the tensor, or streamed
    chunk by chunk from an NVMe state or an aliased master of several slices (host memory: one
    chunk at a time); either is refused when not finite."""
    t = saved.tensor(kind)
    if t is not None:
        check_tensor(saved.flat, saved.segs, kind, gi, t)
        return Entry.of(name, t)
    return Entry(
        name,
        torch.float32,
        (saved.numel,),
        lambda: checked(saved.flat, saved.segs, kind, gi, saved.pieces(kind)),
    )


def _write_model_file(engine, stage: Path, exclude_frozen: bool) -> tuple[dict, dict]:
    sd = module_state(engine.module, exclude_frozen=exclude_frozen)
    aliases = alias_map(sd, prefer={n for og in engine.opt_groups for n in og.flat.names})
    entries = [Entry.of(k, t) for k, t in sd.items() if k not in aliases]
    with writing(stage / MODEL_FILE):
        digest = write_file(stage / MODEL_FILE, entries, {"format": "pt"})
    names = set(param_names(engine.module))
    model = {
        "file": MODEL_FILE,
        "keys": list(sd),
        "aliases": aliases,
        "params": [k for k in sd if k in names],
        "frozen": sorted(frozen_param_names(engine.module) & set(sd)),
        # left out on request: a load keeps the live values of these keys
        "excluded_frozen": sorted(frozen_param_names(engine.module) - set(sd)),
    }
    return digest, model


def _save_pickled(engine, path: Path, sd: dict) -> None:
    """``torch.save`` of the consolidated state dict by rank 0, written aside and renamed into
    place; every rank raises if it failed."""
    err: BaseException | None = None
    if engine.global_rank == 0:
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            with writing(path):
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(sd, tmp)
                atomic.fsync_file(tmp)
                os.replace(tmp, path)
                atomic.fsync_dir(path.parent)
        except Exception as e:
            tmp.unlink(missing_ok=True)
            err = e
    del sd
    _agree(engine, err, "16-bit model save")


def _digest_file(stage: Path, rank: int) -> Path:
    return stage / f".digests.{rank:05d}.json"


# DeepSpeed puts its consolidation scripts beside ``latest``; so does every save here (standalone
# scripts: torch and safetensors only; zero_to_torch.py reads through its sibling zero_to_fp32.py).
RECOVERY_SCRIPT = "zero_to_fp32.py"
RECOVERY_SCRIPTS = {
    RECOVERY_SCRIPT: "zero_to_fp32_script.py",
    "zero_to_torch.py": "zero_to_torch_script.py",
}


def _write_recovery_script(root: Path, name: str = RECOVERY_SCRIPT) -> None:
    """``<save_dir>/<name>`` (a script of RECOVERY_SCRIPTS), replaced atomically (before the new
    tag is published, so a failure here publishes nothing) and executable. ``zero_to_fp32.py``
    carries the library's own ``meta.json`` checks inlined (``script_source.py``)."""
    if name == RECOVERY_SCRIPT:
        source = recovery_script_source()
    else:
        source = (SCRIPTS_DIR / RECOVERY_SCRIPTS[name]).read_bytes()
    path = root / name
    atomic.write_bytes_atomic(path, source)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def save_checkpoint(
    engine,
    save_dir,
    tag=None,
    client_state=None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Save a complete, resumable checkpoint as ``<save_dir>/<tag>`` (default
    ``global_step<N>``) and, with ``save_latest``, point ``<save_dir>/latest`` at it.
    ``exclude_frozen_parameters``: the model file leaves out params that do not require grad
    (a load keeps the model's own values for them).

    Three phases, each ended by every rank agreeing that it succeeded everywhere (else every rank
    raises and the staging folder is discarded): prepare (all that could refuse the save),
    write (shards, model file, digests), publish (rank 0: meta.json, the folder, ``latest``)."""
    engine.flush_delayed_update()  # the saved master must be the one the live params came from
    tag = check_tag(str(tag) if tag is not None else f"global_step{engine.global_steps}")
    tag = agree_on_tag(engine.device, tag, engine.config.checkpoint.tag_validation)
    root, rank = Path(save_dir), engine.global_rank
    stage = atomic.staging_dir(root, tag)

    def discard() -> None:
        if rank == 0 and stage.exists():
            shutil.rmtree(stage, ignore_errors=True)

    err: BaseException | None = None
    common = model = None
    try:
        common = _prepare(engine, root, stage, tag, client_state)
    except Exception as e:
        err = e
    _agree(engine, err, "preparation", discard)
    try:
        model = _write_shards(engine, stage, common, exclude_frozen_parameters)
    except Exception as e:
        err = e
    _agree(engine, err, "writing", discard)
    if rank == 0:
        try:
            _publish(engine, root, stage, tag, dict(common, model=model), save_latest)
        except Exception as e:
            err = e
    _agree(engine, err, "publishing", discard)
    return True


def _prepare(engine, root: Path, stage: Path, tag: str, client_state) -> dict:
    """The rank-independent metadata (refuses non-JSON state before a byte is written); rank 0
    makes the staging folder."""
    common = _common_meta(engine, tag, client_state)
    if engine.global_rank == 0:
        with writing(stage):
            atomic.prepare_staging(root, tag)
    return common


def _write_shards(engine, stage: Path, common: dict, exclude_frozen: bool) -> dict | None:
    """This rank's file (rank 0: also the model file) and their digests; the model entry of
    meta.json on rank 0, else None."""
    rank = engine.global_rank
    # stage 3: full params in host memory, gathered one module at a time (a collective,
    # entered first so that every rank reaches it)
    with engine.params_on_host():
        digests = {rank_file(rank): _write_rank_file(engine, stage, common["groups"])}
        model = None
        if rank == 0:
            digests[MODEL_FILE], model = _write_model_file(engine, stage, exclude_frozen)
    with writing(_digest_file(stage, rank)):
        atomic.write_bytes_atomic(_digest_file(stage, rank), json.dumps(digests).encode("utf-8"))
    atomic.pause("after_shards")
    return model


def _publish(engine, root: Path, stage: Path, tag: str, common: dict, save_latest: bool) -> None:
    """Rank 0: meta.json sealed over every rank's digests, the recovery script, the folder
    published under ``tag`` and, with ``save_latest``, ``latest`` pointed at it."""
    world = engine.world_size
    files: dict = {}
    for r in range(world):
        files.update(read_json(_digest_file(stage, r)))
    meta = dict(common, ranks={"files": [rank_file(r) for r in range(world)]}, files=files)
    with writing(stage / META_FILE):
        atomic.write_bytes_atomic(stage / META_FILE, sealed_meta_bytes(meta))
    for r in range(world):
        os.remove(_digest_file(stage, r))
    for name in RECOVERY_SCRIPTS:
        with writing(root / name):
            _write_recovery_script(root, name)
    atomic.pause("before_publish")
    with writing(root / tag):
        atomic.publish(root, tag)
    atomic.pause("before_latest")
    if save_latest:
        with writing(root / "latest"):
            atomic.write_latest(root, tag)


def save_16bit_model(
    engine,
    save_dir,
    save_filename: str = "model.safetensors",
    exclude_frozen_parameters: bool = False,
    max_shard_size: int | str | None = None,
) -> str | bool:
    """Write the module's 16-bit weights (its state dict as trained, tied names each present) to
    ``<save_dir>/<save_filename>`` from rank 0; safetensors unless the name ends in .bin/.pt/.pth
    (then ``torch.save`` of a plain tensor dict). A collective: every rank calls it.

    Streamed: rank 0 writes one tensor at a time; at stage 3 one module's params are gathered at
    a time (every rank takes part), so no rank holds the whole model (a .bin/.pt file is one
    ``torch.save``: rank 0 holds its tensors, the other ranks one module's). With
    ``max_shard_size`` (Hugging Face's syntax: ``"5GB"``, ``"500MB"``, bytes) a model larger
    than that is written in Hugging Face's sharded layout (``<stem>-0000k-of-0000n.safetensors``
    and ``<save_filename>.index.json``, whose path is returned). Returns the path written, or
    False when stage 3 is not allowed to gather (below)."""
    from ..export.sharded import (
        consolidated_state_dict,
        export_items,
        index_name,
        parse_size,
        plan_shards,
        state_dict_items,
    )

    engine.flush_delayed_update()  # all ranks: the pending update is gathered into every param
    path = Path(save_dir) / save_filename
    zc = engine.config.zero_optimization
    if engine.stage == 3 and not getattr(zc, "stage3_gather_16bit_weights_on_model_save", False):
        log.warning(
            "save_16bit_model: did NOT save %s: at ZeRO stage 3 the weights are partitioned and "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save is false. Set it to true "
            "to gather and save them, or save a checkpoint (save_checkpoint) and convert it with "
            "`zero-offload export` or get_fp32_state_dict_from_zero_checkpoint",
            path,
        )
        return False
    if path.suffix in (".bin", ".pt", ".pth"):
        _save_pickled(engine, path, consolidated_state_dict(engine, exclude_frozen_parameters))
        return str(path)
    items = state_dict_items(engine.module, exclude_frozen_parameters, tied="all")
    sharded = (
        max_shard_size is not None
        and len(plan_shards([it.spec for it in items], parse_size(max_shard_size))) > 1
    )
    export_items(engine, items, path.parent, max_shard_size, weights_name=path.name)
    return str(path.parent / index_name(path.name)) if sharded else str(path)
