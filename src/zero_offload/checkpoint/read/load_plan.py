"""Planning a load: everything is checked, nothing is changed.

The plan matches the module's state-dict keys and shapes with the model file, every param
group's names and shapes with ``meta.json``, re-slices each of this rank's new shards from the
old shard files (any world size, stage or placement), checks that every tensor to read exists
with the expected dtype and shape, and verifies the SHA-256 of every block that will be read.
Any failure raises an error naming the file and the tensor or key.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from ..format import (
    MODEL_FILE,
    RANK_META_KEY,
    RNG_CUDA,
    RNG_TORCH,
    CheckpointError,
    rank_file,
    shard_tensor,
)
from ..module_state import alias_map, module_state
from .reader import CheckpointReader
from .reslice import gaps, shard_pieces

log = logging.getLogger("zero_offload")

COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


@dataclass
class GroupPlan:
    reads: list[tuple[str, int, int, int]]  # (file, old shard lo, new shard lo, numel)
    padding: list[tuple[int, int]]


@dataclass
class LoadPlan:
    module: list[tuple[str, str]]  # (live state-dict key, model-file tensor)
    groups: list[GroupPlan] | None
    rng_json: dict | None = None
    rng_file: str | None = None
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # bytes to verify


def _plan_module(
    engine, ckpt: CheckpointReader, plan: LoadPlan, with_trainable: bool, strict: bool
) -> None:
    """Match live state-dict keys with the model file; pick the entries to read. Keys saved
    out on request (``exclude_frozen_parameters``), and with ``strict`` False any key on only
    one side, keep the model's live values."""
    model_file = str(ckpt.path / MODEL_FILE)
    saved = ckpt.meta["model"]
    saved_keys, saved_alias = list(saved.get("keys", [])), dict(saved.get("aliases", {}))
    live = module_state(engine.module)
    saved_set = set(saved_keys)
    excluded = set(saved.get("excluded_frozen", []))
    missing = [k for k in live if k not in saved_set and k not in excluded]
    unexpected = [k for k in saved_keys if k not in live]
    if (missing or unexpected) and strict:
        parts = []
        if missing:
            parts.append(f"the model has {missing[:5]} but the checkpoint does not")
        if unexpected:
            parts.append(f"the checkpoint has {unexpected[:5]} but the model does not")
        raise CheckpointError(f"{model_file}: state dict keys differ: {'; '.join(parts)}")
    trainable = {n for og in engine.opt_groups for n in og.flat.names}
    live_alias = alias_map(live, prefer=trainable)
    for key, t in live.items():
        target = saved_alias.get(key, key)
        if target not in saved_set:
            continue  # excluded frozen, or (not strict) absent: the live value stays
        info = ckpt.require_tensor(MODEL_FILE, target, None, None)
        if info.shape != tuple(t.shape):
            raise CheckpointError(
                f"{model_file}: tensor {key!r} has shape {list(info.shape)}, the model's is {list(t.shape)}"
            )
        if key in live_alias:
            continue  # shares storage with its canonical key, which is loaded
        if key in trainable and not with_trainable:
            continue  # rebuilt from the fp32 master
        plan.module.append((key, target))
        plan.ranges.setdefault(MODEL_FILE, []).append(ckpt.tensor_range(MODEL_FILE, target))


def _plan_groups(engine, ckpt: CheckpointReader, plan: LoadPlan) -> None:
    where = f"{ckpt.path / 'meta.json'}"
    saved = ckpt.groups
    if len(saved) != len(engine.opt_groups):
        raise CheckpointError(
            f"{where}: {len(saved)} param groups saved, the engine has {len(engine.opt_groups)}"
        )
    plan.groups = []
    for og, old in zip(engine.opt_groups, saved):
        g, load = og.flat, og.load()
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in g.params]
        if list(g.names) != old.names:
            diff = next(
                (i for i, (a, b) in enumerate(zip(g.names, old.names)) if a != b),
                min(len(g.names), len(old.names)),
            )
            have = g.names[diff] if diff < len(g.names) else "<none>"
            want = old.names[diff] if diff < len(old.names) else "<none>"
            raise CheckpointError(
                f"{where}: param group {g.index} differs at position {diff}: the checkpoint has "
                f"{want!r}, the model has {have!r}"
            )
        for name, a, b in zip(g.names, shapes, old.shapes):
            if a != b:
                raise CheckpointError(
                    f"{where}: param {name!r} has shape {list(b)} in the checkpoint, {list(a)} in the model"
                )
        _check_client(where, g.index, load.client_class, old.client)
        wanted = shard_pieces(g.layout, load.segs, g.names)
        try:
            reads = old.index_by_name.reads(wanted)
        except ValueError as e:
            raise CheckpointError(f"{where}: param group {g.index}: {e}") from None
        for f in sorted({old.files[r.source] for r in reads}):
            for kind in old.kinds:
                ckpt.require_shard(old, f, kind)
        for r in reads:
            f = old.files[r.source]
            for kind in old.kinds:
                plan.ranges.setdefault(f, []).append(
                    ckpt.tensor_range(f, shard_tensor(g.index, kind), r.src, r.src + r.numel)
                )
        plan.groups.append(
            GroupPlan(
                [(old.files[r.source], r.src, r.dst, r.numel) for r in reads],
                gaps(load.numel, wanted),
            )
        )


def _check_client(where: str, index: int, mine: str | None, saved: dict | None) -> None:
    """The optimizer state saved is the kind the engine runs: the built-in Adam(W)'s, or the
    same client optimizer class's (``mine``: its class name; None: the built-in)."""
    theirs = saved["class"] if saved is not None else None
    if mine == theirs:
        return
    what = lambda name: f"the client optimizer {name}'s" if name else "the built-in Adam(W)'s"  # noqa: E731
    raise CheckpointError(
        f"{where}: param group {index} holds {what(theirs)} state, the engine runs "
        f"{what(mine)[:-2]}: load it into an engine with the same optimizer, or pass "
        "load_optimizer_states=False to load the weights alone"
    )


def _plan_rng(engine, ckpt: CheckpointReader, plan: LoadPlan) -> None:
    rank, files = engine.global_rank, ckpt.meta["ranks"]["files"]
    if rank >= len(files):
        log.info("checkpoint saved by %d ranks: rank %d keeps its own RNG states", len(files), rank)
        return
    name = rank_file(rank)
    header = ckpt.header(name)
    try:
        info = json.loads(header.metadata[RANK_META_KEY])
        state = dict(info["rng"])
        if "python" in state:
            version, internal, _ = state["python"]
            if len(internal) != 625:
                raise ValueError("python state must hold 625 integers")
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{ckpt.path / name}: RNG metadata is malformed ({e})") from None
    if info.get("rank") != rank:
        raise CheckpointError(
            f"{ckpt.path / name}: written by rank {info.get('rank')}, read by rank {rank}: the "
            "rank files were swapped or renamed (each holds its own rank's state)"
        )
    for t in (RNG_TORCH, RNG_CUDA):
        if t in header.tensors:
            ckpt.require_tensor(name, t, "U8", None)
            plan.ranges.setdefault(name, []).append(ckpt.tensor_range(name, t))
    plan.rng_json, plan.rng_file = state, name


def _plan_extra(engine, ckpt: CheckpointReader, plan: LoadPlan) -> None:
    """Each group's own saved state (ZenFlow's) checked against the update it loads into."""
    same_world = len(ckpt.meta["ranks"]["files"]) == engine.world_size
    path = ckpt.path / plan.rng_file
    for og, old in zip(engine.opt_groups, ckpt.groups):
        try:
            og.optimizer.check_extra_state(
                extra_reader(ckpt, plan, og.index), old.step_count, same_world
            )
        except ValueError as e:
            raise CheckpointError(f"{path}: param group {og.index}: {e}") from None


def extra_reader(ckpt: CheckpointReader, plan: LoadPlan, gi: int):
    """Group ``gi``'s extra state tensors from this rank's own file; absent names read None."""
    f = plan.rng_file  # this rank's own file, when the checkpoint has one for it
    names = ckpt.header(f).tensors if f is not None else {}

    def read(kind: str):
        name = shard_tensor(gi, kind)
        return ckpt.read_tensor(f, name) if name in names else None

    return read


def make_plan(
    engine, ckpt: CheckpointReader, use_opt: bool, module_only: bool, strict: bool = True
) -> LoadPlan:
    plan = LoadPlan(module=[], groups=None)
    _plan_module(engine, ckpt, plan, with_trainable=not use_opt, strict=strict)
    if use_opt:
        _plan_groups(engine, ckpt, plan)
    if not module_only:
        _plan_rng(engine, ckpt, plan)
    if use_opt and plan.rng_file is not None:
        _plan_extra(engine, ckpt, plan)
    if not module_only:
        for key in COUNTERS:
            if not isinstance(ckpt.meta["counters"].get(key), int):
                raise CheckpointError(
                    f"{ckpt.path / 'meta.json'}: counters.{key} is missing or not an integer"
                )
    for name, ranges in plan.ranges.items():
        ckpt.verify(name, ranges)
    for name in plan.ranges:  # each rank file read: written under meta.json's layout?
        if name != MODEL_FILE:
            ckpt.check_layout(name)
    return plan
