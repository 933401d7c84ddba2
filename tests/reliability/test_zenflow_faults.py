"""ZenFlow keeps the step protocol's promise (docs/reliability.md, "ZenFlow"): a step fails
whole or not at all over every group; what cannot be rolled back (a commit, an overlapped host
update that failed part way) is refused until a load, never trained on or saved; each
micro-step's gradient carries its own loss scale; a failed swap-file write is named as this
run's own; saved ZenFlow state is checked before anything loads; the overlapped worker is
joined by ``destroy``; the fragment API reads the device part once."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from zenflow_run import TOPK, batches, config, make_model

import zero_offload
from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.format import sealed_meta_bytes
from zero_offload.checkpoint.tensor_file import Entry, write_file
from zero_offload.nvme.errors import NvmeSwapError
from zero_offload.runtime.update.group_step import StepRolledBackError
from zero_offload.runtime.update.shard_optimizer import TornStateError
from zero_offload.runtime.update.zenflow import overlap as overlap_mod
from zero_offload.runtime.update.zenflow import update as update_mod

# select at micro-steps 0 and 4, host updates after 1, 3, 5, 7: micro-step 2 is the device
# part alone (written in ``stage``), 4 a selection
ZF = {**TOPK, "select_interval": 4}


pytestmark = pytest.mark.usefixtures("one_rank")


def _engine(zf: dict, **kw):
    """Two param groups (weights; biases without weight decay), so a failure in the second
    group comes after the first one staged."""
    model = make_model()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    cfg = config(zf, **kw)
    engine, *_ = zero_offload.initialize(model=model, model_parameters=groups, config=cfg)
    assert len(engine.opt_groups) == 2
    return engine


def _step(engine, batch) -> None:
    x, y = batch
    dtype = next(engine.module.parameters()).dtype
    engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
    engine.step()


def _snapshot(engine) -> list[torch.Tensor]:
    """Everything a ZenFlow step writes: master, moments, accumulator, counters, columns and
    their moments, the "auto" rule's sums, the params."""
    out = []
    for og in engine.opt_groups:
        zf = og.optimizer
        n = zf.state.numel
        out += [zf.state.read(k, 0, n).clone() for k in ("master", "exp_avg", "exp_avg_sq")]
        run = zf.runner
        out += [run.accum.clone(), torch.tensor([run.micro, zf.step_count])]
        for c in run.columns:
            out += [t.clone() for t in (c.columns, c.exp_avg, c.exp_avg_sq) if t is not None]
            out.append(torch.tensor([c.step]))
    with engine.params_on_host():
        out += [p.detach().clone() for p in engine.module.parameters()]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _fail_on_call(n: int, real):
    """``real``, except its ``n``-th call (0-based) raises."""
    calls = [0]

    def f(*a, **k):
        calls[0] += 1
        if calls[0] - 1 == n:
            raise RuntimeError("injected failure")
        return real(*a, **k)

    return f


def _params_in_group(engine, gi: int) -> int:
    return len(engine.opt_groups[gi].flat.params)


@pytest.mark.parametrize("seam", ["device part", "device read", "selection", "auto"])
def test_a_failed_stage_in_the_second_group_rolls_back_every_group(seam, monkeypatch):
    """The first group staged (micro-step 2: its device part written), the second fails: both
    keep the last committed step bitwise, and the step run again equals a run that never
    failed."""
    zf = {**ZF, "update_interval": "auto"} if seam == "auto" else ZF
    data = batches(7)
    clean = _engine(zf)
    for b in data:
        _step(clean, b)
    want = _snapshot(clean)
    clean.destroy()

    engine = _engine(zf)
    at = 4 if seam == "selection" else 2
    for b in data[:at]:
        _step(engine, b)
    before = _snapshot(engine)
    second = engine.opt_groups[1].optimizer
    if seam == "device part":  # the first call of the second group's device-part AdamW
        first = _params_in_group(engine, 0)
        monkeypatch.setattr(update_mod, "adamw_step", _fail_on_call(first, update_mod.adamw_step))
    elif seam == "device read":
        monkeypatch.setattr(
            second.runner.values, "read_all", _fail_on_call(0, second.runner.values.read_all)
        )
    elif seam == "selection":
        monkeypatch.setattr(update_mod, "select_from_sums", _fail_on_call(
            _params_in_group(engine, 0) // 2, update_mod.select_from_sums))  # fmt: skip
    else:  # "auto": the rule observed the first group, then the second group fails
        monkeypatch.setattr(second.runner, "_parts", _fail_on_call(0, second.runner._parts))
    with pytest.raises(StepRolledBackError, match="kept the last committed step"):
        _step(engine, data[at])
    monkeypatch.undo()
    assert _same(_snapshot(engine), before)
    for b in data[at:]:  # the failed step's batch again, then the rest
        _step(engine, b)
    assert _same(_snapshot(engine), want)
    engine.destroy()


def test_a_failed_commit_is_refused_until_a_load(tmp_path, monkeypatch):
    """The host part of the second group fails after the first group committed: the state is
    torn, so the next step and every save are refused naming why; a load mends it."""
    data = batches(4)
    engine = _engine(ZF)
    _step(engine, data[0])
    engine.save_checkpoint(str(tmp_path), tag="good")
    second = engine.opt_groups[1].optimizer
    monkeypatch.setattr(second, "host_pass", _fail_on_call(0, second.host_pass))
    with pytest.raises(TornStateError, match="param group 1 after 1 of 2"):
        _step(engine, data[1])  # micro-step 1: a host update
    monkeypatch.undo()
    with pytest.raises(TornStateError, match="partly updated"):
        _step(engine, data[1])
    with pytest.raises(TornStateError):
        engine.save_checkpoint(str(tmp_path), tag="torn")
    assert not (tmp_path / "torn").exists()
    engine.load_checkpoint(str(tmp_path), tag="good")
    _step(engine, data[1])  # trains again from the loaded step
    engine.destroy()


def test_a_failed_overlapped_update_is_refused_until_a_load(tmp_path, monkeypatch):
    data = batches(5)
    engine = _engine({**ZF, "overlap_step": True})
    _step(engine, data[0])
    engine.save_checkpoint(str(tmp_path), tag="good")
    monkeypatch.setattr(overlap_mod, "host_adam_step", _fail_on_call(0, overlap_mod.host_adam_step))
    _step(engine, data[1])  # its host update starts on the worker and fails there
    monkeypatch.undo()
    with pytest.raises(TornStateError, match="overlapped host update of param group 0 failed"):
        for b in data[2:4]:  # the next host update joins it
            _step(engine, b)
    with pytest.raises(TornStateError):
        engine.save_checkpoint(str(tmp_path), tag="torn")
    engine.load_checkpoint(str(tmp_path), tag="good")
    _step(engine, data[1])
    engine.destroy()


def _fp16(zf: dict, scale: dict) -> dict:
    cfg = config(zf, dtype="fp16")
    cfg["fp16"] = {"enabled": True, **scale}
    return cfg


def test_fp16_loss_scale_changes_inside_an_interval_keep_each_gradients_weight():
    """An overflow skip halves the loss scale in the middle of an interval: the interval's
    gradients are still one average, equal (fp16's power-of-two scaling is exact) to a run at
    a fixed loss scale that never saw the skipped batch."""
    zf = {**TOPK, "select_interval": 0, "update_interval": 4}
    data = batches(6)
    bad = (torch.full((4, 8), float("inf")), data[0][1])

    def run(cfg, stream):
        model = make_model()
        engine, *_ = zero_offload.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        for b in stream:
            _step(engine, b)
        out = [p.detach().clone() for p in engine.module.parameters()]
        zf_update = engine.opt_groups[0].optimizer
        engine.destroy()
        return out, zf_update

    dynamic = _fp16(zf, {"initial_scale_power": 12, "hysteresis": 1, "loss_scale_window": 1000})
    got, upd = run(dynamic, [data[0], data[1], bad, *data[2:5]])
    assert upd.runner.micro == 5  # the skip is no micro-step
    want, _ = run(_fp16(zf, {"loss_scale": 2048}), data[:5])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_failed_param_write_keeps_the_block_sums_and_names_itself(tmp_path):
    """A write of the NVMe param home that fails puts the block sums back: the file still
    holding the last good bytes reads fine; bytes the failed write may have left are named as
    this run's failed write, not another process's."""
    from test_nvme_offload import _engine as nvme_engine
    from test_nvme_offload import _Failing, _train

    engine = nvme_engine(tmp_path / "swap", "cpu", "nvme")
    _train(engine, range(1))
    shard = engine.param_store.swapped[0]
    shard.flush()
    shard.drop_cached()
    good = shard.read(0, shard.numel, cache=False).clone()
    real = engine.aio.write
    engine.aio.write = lambda *a: _Failing(errno.EIO)
    shard.write(0, good + 1)
    with pytest.raises(NvmeSwapError, match="write of param-shard elements"):
        shard.flush()
    engine.aio.write = real
    assert torch.equal(shard.read(0, shard.numel, cache=False), good)  # not "changed underneath"
    # the failed write left other bytes behind
    fd = os.open(shard.file.path, os.O_WRONLY)
    os.pwrite(fd, b"\x11" * 64, 0)
    os.close(fd)
    engine.aio.write = lambda *a: _Failing(errno.EIO)
    shard.write(0, good + 1)
    with pytest.raises(NvmeSwapError):
        shard.flush()
    engine.aio.write = real
    with pytest.raises(NvmeSwapError, match="this run's write of elements 0..") as err:
        shard.read(0, shard.numel, cache=False)
    assert "another process" not in str(err.value)
    shard.write(0, good)  # a write that lands makes the block known again
    shard.flush()
    assert torch.equal(shard.read(0, shard.numel, cache=False), good)
    engine.destroy()


def test_an_nvme_read_failure_inside_the_device_part_rolls_back(tmp_path):
    """Stage 3, params on NVMe: a read of the param home fails inside the device part's
    read-modify-write; the step is rolled back whole (accumulator included) and the retried
    step equals a run that never failed."""
    zf = ZF
    cfg = config(zf, stage=3)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    data = batches(5)

    def build():
        model = make_model()
        engine, *_ = zero_offload.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        return engine

    clean = build()
    for b in data:
        _step(clean, b)
    want = _snapshot(clean)
    clean.destroy()
    engine = build()
    for b in data[:2]:
        _step(engine, b)
    before = _snapshot(engine)
    from test_nvme_offload import _Failing

    real = engine.aio.read
    x, y = data[2]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    for shard in engine.param_store.swapped.values():
        shard.drop_cached()  # the device part's reads go to the file
    engine.aio.read = lambda *a, **k: _Failing(errno.EIO)
    with pytest.raises(NvmeSwapError, match="read of param-shard elements"):
        engine.step()
    engine.aio.read = real
    assert _same(_snapshot(engine), before)
    for b in data[2:]:
        _step(engine, b)
    assert _same(_snapshot(engine), want)
    engine.destroy()


def _host_update_threads() -> int:
    return sum("host-update" in t.name for t in threading.enumerate())


def test_destroy_joins_the_overlapped_worker():
    before = _host_update_threads()
    engine = _engine({**ZF, "overlap_step": True})
    for b in batches(3):
        _step(engine, b)
    assert _host_update_threads() == before + 1  # one worker for both groups
    engine.destroy()
    assert _host_update_threads() == before


def test_the_fragment_api_reads_the_device_part_once(tmp_path, monkeypatch):
    from zero_offload.utils.tensor_fragment import safe_get_full_fp32_param

    cfg = config(ZF, stage=3)
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    for b in batches(3):
        _step(engine, b)
    values = engine.opt_groups[0].optimizer.runner.values
    reads = [0]
    real = values.read

    def counted(*a, **k):
        reads[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(values, "read", counted)
    params = list(engine.module.parameters())
    first = [safe_get_full_fp32_param(p) for p in params]
    once = reads[0]
    assert 0 < once <= len(params)
    again = [safe_get_full_fp32_param(p) for p in params]
    assert reads[0] == once and all(torch.equal(a, b) for a, b in zip(first, again))
    engine.destroy()


# ---- saved ZenFlow state, edited and re-sealed (digests recomputed) ---------------------------
def _reseal(root: Path, tag: str, rank: int, edit) -> None:
    """Rank ``rank``'s file rewritten with ``edit(tensors)`` applied, its digest recorded anew
    in meta.json (so only the project's own checks can see the edit)."""
    name = f"rank_{rank:05d}.safetensors"
    path = root / tag / name
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        metadata = f.metadata()
    edit(tensors)
    tmp = path.with_suffix(".new")  # a new file: the old one may still be mapped
    digest = write_file(tmp, [Entry.of(k, v) for k, v in tensors.items()], metadata)
    os.replace(tmp, path)
    meta_path = root / tag / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"][name] = digest
    meta_path.write_bytes(sealed_meta_bytes(meta))


def _find(tensors: dict, suffix: str) -> str:
    hits = sorted(k for k in tensors if k.endswith(suffix))
    assert hits, (suffix, sorted(tensors))
    return hits[0]


def _set(suffix: str, fn):
    def edit(tensors):
        k = _find(tensors, suffix)
        out = fn(tensors[k])
        if out is None:
            del tensors[k]
        else:
            tensors[k] = out

    return edit


_EDITS = {
    "micro ahead of the step count": ("zenflow.micro", lambda t: t + 1, "zenflow.micro"),
    "column -1": (
        "zenflow.0.columns",
        lambda t: torch.cat([t[:-1], t.new_tensor([-1])]),
        "columns",
    ),
    "column repeated": ("zenflow.1.columns", lambda t: torch.cat([t[:1], t[:-1]]), "each once"),
    "column out of range": ("zenflow.1.columns", lambda t: t + 10**6, "columns"),
    "moments one row short": ("zenflow.1.exp_avg", lambda t: t[:-1], "exp_avg has shape"),
    "accumulator NaN": ("zenflow.accum", lambda t: torch.full_like(t, float("nan")), "not finite"),
    "stale dropped": ("zenflow.stale", lambda t: None, "zenflow.stale is missing"),
    "params dropped": ("zenflow.params", lambda t: None, "zenflow.params is missing"),
    "micro negative": ("zenflow.micro", lambda t: t - 100, "non-negative"),
}


@pytest.mark.parametrize("edit", sorted(_EDITS))
def test_edited_zenflow_state_is_refused_by_name(tmp_path, edit):
    suffix, fn, message = _EDITS[edit]
    zf = {**ZF, "overlap_step": True}
    engine = _engine(zf)
    for b in batches(3):
        _step(engine, b)
    engine.save_checkpoint(str(tmp_path), tag="t")
    before = _snapshot(engine)
    _reseal(tmp_path, "t", 0, _set(suffix, fn))
    with pytest.raises(CheckpointError, match=message) as err:
        engine.load_checkpoint(str(tmp_path), tag="t")
    assert "rank_00000.safetensors" in str(err.value)
    assert _same(_snapshot(engine), before)  # nothing was loaded
    engine.destroy()


def _other_columns(t: torch.Tensor) -> torch.Tensor:
    """Increasing columns of the same count, not ``t``."""
    first = torch.arange(t.numel(), dtype=t.dtype)
    return first if not torch.equal(first, t) else first + 1


def _two_ranks_edited(root: str, how: str) -> str | None:
    """Two ranks train ZenFlow and save; rank 0 then edits the files (``how``) and re-seals
    them; both ranks load: the error each raised (None: loaded)."""
    import torch.distributed as tdist

    from zero_offload.core import dist

    rank = dist.rank()
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=config(ZF)
    )
    for b in batches(3, rank):
        _step(engine, b)
    engine.save_checkpoint(root, tag="t")
    if rank == 0:
        tag = Path(root) / "t"
        if how == "files swapped":
            a, b = tag / "rank_00000.safetensors", tag / "rank_00001.safetensors"
            os.replace(a, tag / "x")
            os.replace(b, a)
            os.replace(tag / "x", b)
            meta = json.loads((tag / "meta.json").read_text())
            files = meta["files"]
            files["rank_00000.safetensors"], files["rank_00001.safetensors"] = (
                files["rank_00001.safetensors"],
                files["rank_00000.safetensors"],
            )
            (tag / "meta.json").write_bytes(sealed_meta_bytes(meta))
        else:  # one rank's columns changed: still valid columns, other ones
            _reseal(Path(root), "t", 1, _set("zenflow.1.columns", _other_columns))
    tdist.barrier()
    try:
        engine.load_checkpoint(root, tag="t")
        return None
    except CheckpointError as e:
        return str(e)
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "how, message",
    [
        ("files swapped", "written by rank 1, read by rank 0"),
        ("columns rotated", "different ZenFlow"),
    ],
)
def test_rank_files_that_disagree_are_refused_on_every_rank(tmp_path, how, message):
    from distributed import every_rank

    got = every_rank(2, _two_ranks_edited, str(tmp_path), how, timeout=600)
    assert all(g is not None for g in got), got
    assert message in got[0] or message in got[1], got
