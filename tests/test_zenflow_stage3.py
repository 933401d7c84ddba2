"""ZenFlow at stage 3 (``zero_optimization.zenflow`` with every param partitioned): it trains as
DeepSpeed 0.19.8's stage-3 algorithm says (``test_zenflow.reference``: on several ranks the
columns are candidates by DeepSpeed's per-param partition and ranked together), on one and two
ranks, with the param shard on the device, in host memory or on NVMe; the ranks agree; a
checkpoint saved mid-interval resumes bitwise; the estimate counts its buffers. DeepSpeed's own
stage-3 run: ``test_zenflow_deepspeed.py``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as tdist
from distributed import every_rank
from test_zenflow import AUTO, max_diff, reference
from zenflow_run import TOPK, batches, config, make_model

import zero_offload
from zero_offload.runtime.update.zenflow.update import ZenFlowRunner

OVERLAP = {**TOPK, "overlap_step": True, "select_interval": 3, "full_warm_up_rounds": 1}
CPU = {"offload_param": {"device": "cpu"}}


def _config(zf: dict | None, zero: dict | None = None, clip: float = 0.0) -> dict:
    cfg = config(zf, clip, stage=3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every param partitioned
    cfg["zero_optimization"].update(zero or {})
    return cfg


def _engine(zf: dict | None, zero: dict | None = None, clip: float = 0.0, shape: str = "mlp"):
    model = make_model(shape)
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=_config(zf, zero, clip)
    )
    return engine


def _params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    assert all(p.numel() == 0 for p in params)  # partitioned between steps
    with zero_offload.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _train(engine, data) -> list[list[torch.Tensor]]:
    """The params after every step."""
    out = []
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        out.append(_params(engine))
    return out


def _run(zf: dict, zero: dict | None = None, clip: float = 0.0, steps: int = 7, shape="mlp"):
    """On each rank (its own batches): the params after every step, and whether ZenFlow ran."""
    engine = _engine(zf, zero, clip, shape)
    built = isinstance(engine.opt_groups[0].optimizer.runner, ZenFlowRunner)
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    return built, _train(engine, batches(steps, rank))


@pytest.fixture
def one_rank(monkeypatch):
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))


@pytest.mark.parametrize(
    "zf, zero, clip",
    [(TOPK, None, 0.0), (TOPK, CPU, 0.05), (OVERLAP, CPU, 0.0), (OVERLAP, None, 0.05)],
    ids=["device", "host_clip", "host_overlap", "device_overlap_clip"],
)
def test_one_rank_equals_reference(one_rank, zf, zero, clip):
    built, got = _run(zf, zero, clip)
    assert built
    ref = reference(zf, 7, clip)
    assert max_diff(got, ref) < 2e-5, max_diff(got, ref)


def _losses_and_params(engine, dtype: torch.dtype, stage3: bool) -> list[list[torch.Tensor]]:
    out = []
    for x, y in batches(7):
        engine.backward(torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y))
        engine.step()
        out.append(_params(engine) if stage3 else [p.detach().clone() for p in
                                                    engine.module.parameters()])  # fmt: skip
    return out


@pytest.mark.parametrize(
    "zf, dtype, zero",
    [
        (TOPK, "fp32", CPU),
        (AUTO, "fp32", None),
        (AUTO, "fp32", CPU),
        (TOPK, "bf16", None),
        (TOPK, "bf16", CPU),
        (TOPK, "fp16", CPU),
    ],  # fmt: skip
    ids=["fp32_host", "auto_device", "auto_host", "bf16_device", "bf16_host", "fp16_host"],
)
def test_one_rank_equals_stage2_bitwise(one_rank, zf, dtype, zero):
    """On one rank stage 3 selects as stages 1-2 do: the same training, bit for bit, in every
    precision and with "auto"."""
    runs = []
    for stage in (3, 2):
        cfg = _config(zf, zero if stage == 3 else None)
        cfg["zero_optimization"]["stage"] = stage
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        model = make_model()
        engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(),
                                             config=cfg)  # fmt: skip
        assert isinstance(engine.opt_groups[0].optimizer.runner, ZenFlowRunner)
        runs.append(_losses_and_params(engine, engine.module[0].weight.dtype, stage == 3))
    assert max_diff(*runs) == 0.0


# The "odd" model's (6, 9) weight has 8 candidate columns on two ranks (column 4 straddles the
# cut): 0.34 of 8 keeps 2 columns where 0.34 of its 9 would keep 3.
CUT = {**TOPK, "topk_ratio": 0.34}
CUT_OVERLAP = {**OVERLAP, "topk_ratio": 0.34}


def _two_rank_runs(path: str) -> dict:
    out = {}
    for name, zf, zero, clip in (("device", CUT, None, 0.0), ("host", CUT, CPU, 0.0),
                                 ("overlap", CUT_OVERLAP, CPU, 0.05)):  # fmt: skip
        out[name] = _run(zf, zero, clip, shape="odd")
    return out


def test_two_ranks_equal_reference_and_agree(tmp_path):
    """Each rank on its own batches: the params equal the reference's stage 3 on two ranks
    (top-k over the candidates of DeepSpeed's per-param partition, ranked together), the ranks
    agree bitwise, and a host param shard trains as a device one."""
    ranks = every_rank(2, _two_rank_runs, str(tmp_path))
    for name in ("device", "host", "overlap"):
        (b0, a), (b1, b) = ranks[0][name], ranks[1][name]
        assert b0 and b1 and max_diff(a, b) == 0.0, name
    got = ranks[0]["device"][1]
    assert max_diff(got, ranks[0]["host"][1]) == 0.0
    ref = reference(CUT, 7, world=2, shape="odd")
    assert max_diff(got, ref) < 2e-5, max_diff(got, ref)
    whole = reference(CUT, 7, world=2, shape="odd", partitioned=False)
    assert max_diff(got, whole) > 1e-3  # the partition's candidates change the training
    ref = reference(CUT_OVERLAP, 7, 0.05, world=2, shape="odd")
    assert max_diff(ranks[0]["overlap"][1], ref) < 2e-5, max_diff(ranks[0]["overlap"][1], ref)


def _checkpoint_run(path: str, zf: dict, zero: dict) -> dict:
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    data = batches(7, rank)
    straight = _train(_engine(zf, zero), data)[-1]
    first = _engine(zf, zero)
    saved = _train(first, data[:3])[-1]
    first.save_checkpoint(path, tag="mid")
    resumed = _engine(zf, zero)
    resumed.load_checkpoint(path, tag="mid")
    loaded = _params(resumed)
    after = _train(resumed, data[3:])[-1]
    plain = _engine(None, zero)  # a run without ZenFlow loads the master
    plain.load_checkpoint(path, tag="mid")
    return dict(straight=straight, saved=saved, loaded=loaded, after=after, plain=_params(plain))


@pytest.mark.parametrize(
    "world, zero, overlap",
    [(1, None, False), (1, CPU, True), (2, CPU, False)],
    ids=["one_rank", "one_rank_overlap", "two_ranks"],
)
def test_checkpoint_mid_interval_resumes_bitwise(tmp_path, monkeypatch, world, zero, overlap):
    zf = {**TOPK, "select_interval": 4, "overlap_step": overlap}
    if world == 1:
        for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0",
                     "WORLD_SIZE": "1"}.items():  # fmt: skip
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))
        ranks = [_checkpoint_run(str(tmp_path), zf, zero)]
    else:
        ranks = every_rank(2, _checkpoint_run, str(tmp_path), zf, zero)
    for got in ranks:
        assert max_diff([got["loaded"]], [got["saved"]]) == 0.0
        assert max_diff([got["after"]], [got["straight"]]) == 0.0
        if overlap:  # the master already holds the update the params get one interval later
            assert max_diff([got["plain"]], [got["saved"]]) > 1e-4
        else:
            assert max_diff([got["plain"]], [got["saved"]]) == 0.0


def test_nvme_param_shard_trains_as_host(one_rank, tmp_path):
    """``offload_param`` "nvme": the device part reads and writes the swap file's pieces."""
    nvme = {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    _, got = _run(TOPK, nvme, steps=5)
    _, want = _run(TOPK, CPU, steps=5)
    assert max_diff(got, want) == 0.0


def test_one_row_param_is_updated_whole(one_rank):
    """A 2-D param of one row is updated whole by the device part, as DeepSpeed's stage 3
    treats it (its ``num_row == 1``): every element moves at a device-only step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 1, bias=False), torch.nn.Tanh())
    cfg = _config({**TOPK, "select_interval": 4, "update_interval": 4})
    engine, *_ = zero_offload.initialize(model=model, model_parameters=model.parameters(),
                                         config=cfg)  # fmt: skip
    before = _params(engine)[0]
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()  # micro-step 0: a selection, not a host update (interval 4)
    after = _params(engine)[0]
    assert bool((after != before).all())


def test_estimate_equals_memory_report_one_rank(one_rank):
    engine = _engine(TOPK, CPU)
    _train(engine, batches(3))
    have, want = engine.memory_report(), engine.expected_memory()
    for k in ("device.zenflow_columns", "host.zenflow_accum", "host.zenflow_index"):
        assert have[k] > 0 and have[k] == want[k], (k, have[k], want[k])
