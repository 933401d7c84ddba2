"""ZenFlow (``zero_optimization.zenflow``) trains as DeepSpeed 0.19.8's algorithm says, checked
against a plain-PyTorch reference of that algorithm (``reference`` below), with and without
``overlap_step``, deterministically, and against plain offload (it is not plain Adam); its
checkpoints resume bitwise mid-interval. Built: stages 1 and 2, a fixed update_interval or
"auto"; what DeepSpeed cannot run is refused at initialize; the rest warns and trains plain
offload. Two ranks: ``test_zenflow_ranks.py``; DeepSpeed itself:
``test_zenflow_deepspeed.py``."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from zenflow_run import TOPK, batches, config, make_model, train

import zero_offload
from zero_offload.config.zero.zenflow import ZenFlowConfig, resolve_schedule

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))


def _adamw(p, g, m, v, step, clear=False):
    """torch's single-tensor AdamW (DeepSpeed's selective AdamW and, to fp32 rounding, its host
    CPU Adam in AdamW mode)."""
    p.mul_(1 - LR * WD)
    m.lerp_(g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / (1 - BETAS[1] ** step) ** 0.5).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def stage3_columns(sums: torch.Tensor, rows: int, world: int, ratio: float) -> torch.Tensor:
    """DeepSpeed's stage-3 selection, read from its ``update_selected_channels``: the param is
    stored transposed and cut into ``world`` slices of ceil(numel / world); a column wholly
    inside a slice is a candidate; the top max(1, int(n * ratio)) of all n candidates."""
    numel = rows * sums.numel()
    size = -(-numel // world)
    cand = []
    for r in range(world):
        start, end = r * size, min((r + 1) * size, numel)
        cand += list(range(-(-start // rows), end // rows))
    cand = torch.tensor(cand, dtype=torch.int64)
    top = torch.topk(sums[cand], max(1, int(cand.numel() * ratio)))[1]
    return cand[top].sort()[0]


def reference(
    zf: dict,
    steps: int,
    clip: float = 0.0,
    world: int = 1,
    shape: str = "mlp",
    partitioned: bool = True,
) -> list[list[torch.Tensor]]:
    """DeepSpeed's ZenFlow for one rank, fixed update_interval, in plain PyTorch; ``world`` > 1:
    its stage 3 on that many ranks (each rank's batches, the gradients averaged; columns
    selected as ``stage3_columns``, or over the whole param where not ``partitioned``)."""
    sched = resolve_schedule(ZenFlowConfig(**zf), None)
    u, model = sched.update_interval, make_model(shape)
    params = list(model.parameters())
    master = [p.detach().clone() for p in params]
    # host moments: two sets with overlap_step (set (k // U) & 1; in the warm-up k & 1)
    hm = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    hv = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    stale, after_warmup = [p.detach().clone() for p in params], 0
    acc = [torch.zeros_like(p) for p in params]
    cols: list = [None] * len(params)
    dm, dv, dstep = [None] * len(params), [None] * len(params), [0] * len(params)
    out = []

    def device_part(grads):
        for i, (p, g) in enumerate(zip(params, grads)):
            c = cols[i]
            sel = p.detach()[:, c].clone() if c is not None else p.detach().clone()
            g = g[:, c] if c is not None else g
            if dm[i] is None:
                dm[i], dv[i] = torch.zeros_like(sel), torch.zeros_like(sel)
            dstep[i] += 1
            _adamw(sel, g, dm[i], dv[i], dstep[i])
            if c is not None:
                p.data[:, c] = sel
            else:
                p.data.copy_(sel)

    data = list(zip(*[batches(steps, r) for r in range(world)]))
    for k, per_rank in enumerate(data):
        grads = [torch.zeros_like(p) for p in params]
        for x, y in per_rank:
            loss = torch.nn.functional.mse_loss(model(x), y) / (u * world)
            for a, g in zip(grads, torch.autograd.grad(loss, params)):
                a.add_(g)
        if sched.is_select(k):
            if k:
                master = [p.detach().clone() for p in params]
            for i, (p, g) in enumerate(zip(params, grads)):
                if p.dim() == 2:
                    s = g.t().contiguous().abs().sum(dim=1)
                    n = max(1, int(g.shape[1] * sched.topk_ratio))
                    cols[i] = torch.topk(s, n)[1].sort()[0]
                    if world > 1 and partitioned:
                        cols[i] = stage3_columns(s, g.shape[0], world, sched.topk_ratio)
                if dm[i] is not None:
                    dm[i].zero_(), dv[i].zero_()
        for a, g in zip(acc, grads):
            a.add_(g)
        if not sched.is_update(k):
            device_part(grads)
        else:
            kept = [
                p.detach()[:, c].clone() if c is not None else p.detach().clone()
                for p, c in zip(params, cols)
            ]
            norm = torch.sqrt(sum(a.double().square().sum() for a in acc)).item()
            f = 1.0
            if clip > 0 and (norm + 1e-6) / clip > 1:
                f = clip / (norm + 1e-6)
            warm = k < sched.full_warm_up_rounds
            which = 0 if not sched.overlap_step else (k & 1 if warm else (k // u) & 1)
            if sched.overlap_step and not warm:  # the last update's copy lands first
                after_warmup += 1
                if after_warmup >= 2 and not (sched.full_warm_up_rounds == 0 and after_warmup == 2):
                    for p, st in zip(params, stale):
                        p.data.copy_(st)
            for i, p in enumerate(params):
                _adamw(master[i], acc[i] * f, hm[which][i], hv[which][i], k + 1)
                stale[i] = master[i].clone()
                if not sched.overlap_step or warm:
                    p.data.copy_(master[i])
                acc[i].zero_()
            if k >= sched.full_warm_up_rounds:
                for p, c, v in zip(params, cols, kept):
                    if c is not None:
                        p.data[:, c] = v
                    else:
                        p.data.copy_(v)
                device_part(grads)
        out.append([p.detach().clone() for p in params])
    return out


def ours(zf: dict | None, steps: int, clip: float = 0.0, stage: int = 2):
    cfg = config(zf, clip)
    cfg["zero_optimization"]["stage"] = stage
    return train(zero_offload.initialize, cfg, steps)[1:]  # after each step


def max_diff(a, b) -> float:
    return max(float((p - q).abs().max()) for x, y in zip(a, b) for p, q in zip(x, y))


OVERLAP = {**TOPK, "overlap_step": True}
CASES = [
    TOPK,
    OVERLAP,
    {**OVERLAP, "select_interval": 3, "full_warm_up_rounds": 1},
    {**TOPK, "select_interval": 3},  # host updates at every 2nd and every 3rd step
    {**TOPK, "full_warm_up_rounds": 2, "topk_ratio": 0.1},
    {**TOPK, "select_strategy": "epoch", "select_interval": 1},  # no dataloader: select once
]


@pytest.mark.parametrize(
    "zf", CASES, ids=["step", "overlap", "overlap_warmup", "select3", "warmup", "epoch_once"]
)
def test_zenflow_equals_reference(zf):
    got, ref = ours(zf, 7), reference(zf, 7)
    assert max_diff(got, ref) < 2e-5, max_diff(got, ref)


def test_zenflow_clipping_and_stage1():
    zf = {**TOPK, "select_interval": 4}
    got, ref = ours(zf, 6, clip=0.05, stage=1), reference(zf, 6, clip=0.05)
    assert max_diff(got, ref) < 2e-5
    assert max_diff(got, reference(zf, 6)) > 1e-4  # the clip acted


def test_zenflow_deterministic_and_not_plain():
    a, b = ours(TOPK, 5), ours(TOPK, 5)
    assert max_diff(a, b) == 0.0
    assert max_diff(a, ours(None, 5)) > 1e-3


@pytest.mark.parametrize(
    "optimizer, stage, words",
    [
        (None, 2, "the Muon optimizer"),
    ],
)
def test_unbuilt_zenflow_warns_and_trains_plain(caplog, optimizer, stage, words):
    muon = {"type": "Muon", "params": {"lr": LR}}

    def run(zf):
        cfg = config(zf)
        cfg["zero_optimization"]["stage"] = stage
        cfg["optimizer"] = optimizer or muon
        cfg["zero_optimization"]["reduce_scatter"] = optimizer is not None  # Muon's rule
        return train(zero_offload.initialize, cfg, 3)[1:]

    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        got = run(TOPK)
    assert f"zero_optimization.zenflow: not built for {words}" in caplog.text
    assert max_diff(got, run(None)) == 0.0


AUTO = {**TOPK, "select_interval": 5, "update_interval": "auto", "auto_ratio": 0.6}


def test_auto_update_interval_trains_its_own_schedule():
    """ "auto": host updates where DeepSpeed's rule puts them (equal to DeepSpeed's own run in
    test_zenflow_deepspeed.py): neither a fixed interval nor the selections alone."""
    a, b = ours(AUTO, 7), ours(AUTO, 7)
    assert max_diff(a, b) == 0.0 and all(torch.isfinite(p).all() for p in a[-1])
    engine = _engine(AUTO)
    _steps(engine, batches(7))
    rule = engine.opt_groups[0].optimizer.runner.auto
    assert rule is engine.opt_groups[-1].optimizer.runner.auto  # one rule for the engine
    for fixed in (2, 5):
        assert max_diff(a, ours({**AUTO, "update_interval": fixed}, 7)) > 1e-4


@pytest.mark.parametrize("overlap", [False, True])
def test_auto_checkpoint_mid_interval_resumes_bitwise(tmp_path, overlap):
    zf = {**AUTO, "overlap_step": overlap}
    data = batches(8)
    straight = _steps(_engine(zf), data)
    first = _engine(zf)
    _steps(first, data[:3])
    first.save_checkpoint(tmp_path, tag="mid")
    resumed = _engine(zf)
    resumed.load_checkpoint(tmp_path, tag="mid")
    assert max_diff([_steps(resumed, data[3:])], [straight]) == 0.0


def test_refused_at_initialize_naming_the_key():
    conv = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.Flatten())
    with pytest.raises(ValueError, match=r"zenflow: params of at most 2 dimensions .*0\.weight"):
        zero_offload.initialize(model=conv, model_parameters=conv.parameters(), config=config(TOPK))
    model = make_model()
    cfg = config(TOPK)
    del cfg["optimizer"]
    client = torch.optim.SGD(model.parameters(), lr=0.1)  # a torch Adam(W) is taken as built-in
    with pytest.raises(ValueError, match=r"zenflow: needs the config's optimizer.*\(SGD\)"):
        zero_offload.initialize(model=model, optimizer=client, config=cfg)


def test_zenflow_memory_report_counts_its_buffers():
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=config(TOPK)
    )
    x, y = batches(1)[0]
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    rep = engine.memory_report()
    numel = sum(p.numel() for p in model.parameters())
    assert rep["host.zenflow_accum"] >= numel * 4
    assert rep["device.zenflow_columns"] > 0
    json.dumps(rep)


def _engine(zf):
    """An engine of ``make_model`` with ZenFlow ``zf``."""
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=config(zf)
    )
    return engine


def _steps(engine, data):
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize("overlap", [False, True])
def test_checkpoint_mid_interval_resumes_bitwise(tmp_path, overlap):
    zf = {
        **TOPK,
        "select_interval": 4,
        "overlap_step": overlap,
    }  # host updates after steps 2, 4, 6; selections at 1, 5
    data = batches(7)
    straight = _steps(_engine(zf), data)
    first = _engine(zf)
    saved = _steps(first, data[:3])  # three steps: the accumulator holds step 3's gradient
    first.save_checkpoint(tmp_path, tag="mid")
    resumed = _engine(zf)
    resumed.load_checkpoint(tmp_path, tag="mid")
    assert max_diff([saved], [[p.detach() for p in resumed.module.parameters()]]) == 0.0
    assert max_diff([_steps(resumed, data[3:])], [straight]) == 0.0
    plain = _engine(None)  # a run without ZenFlow loads the master
    plain.load_checkpoint(tmp_path, tag="mid")
    loaded = [[p.detach() for p in plain.module.parameters()]]
    if overlap:  # the master already holds the update the params get one interval later
        assert max_diff([saved], loaded) > 1e-4
    else:
        assert max_diff([saved], loaded) == 0.0
    _steps(plain, data[3:4])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zenflow_16bit_tracks_fp32(dtype):
    """The device part runs in the params' 16-bit dtype (as DeepSpeed's), the host part from
    the fp32 accumulator; the run tracks fp32 and is deterministic."""
    cfg = config(TOPK)
    cfg[dtype] = {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}
    a = train(zero_offload.initialize, cfg, 5)[1:]
    b = train(zero_offload.initialize, cfg, 5)[1:]
    assert max_diff(a, b) == 0.0
    assert max_diff(a, ours(TOPK, 5)) < 0.02


def test_zenflow_fp16_overflow_skips_the_step_whole():
    """fp16 (DeepSpeed runs no fp16 on a CPU, so no comparison with it): a step whose scaled
    gradient overflows changes nothing of ZenFlow's (params, micro-step, accumulator) and
    lowers the scale; the run then trains on and tracks fp32."""
    cfg = config(TOPK)
    cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "hysteresis": 1}
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    zf = engine.opt_groups[0].optimizer
    before = [p.detach().clone() for p in engine.module.parameters()]
    data = batches(12)
    x, y = data[0]
    scale = engine.loss_scaler.loss_scale
    engine.backward(torch.nn.functional.mse_loss(engine(x.half()).float(), y))
    engine.step()
    assert engine.skipped_steps == 1 and engine.loss_scaler.loss_scale == scale / 2
    assert zf.runner.micro == 0 and float(zf.runner.accum.abs().sum()) == 0.0
    assert max_diff([before], [[p.detach() for p in engine.module.parameters()]]) == 0.0
    kept = []  # the batches of the steps not skipped
    for x, y in data[1:]:
        skipped = engine.skipped_steps
        engine.backward(torch.nn.functional.mse_loss(engine(x.half()).float(), y))
        engine.step()
        if engine.skipped_steps == skipped:
            kept.append((x, y))
    assert len(kept) >= 3 and zf.runner.micro == len(kept)
    got = [[p.detach().float() for p in engine.module.parameters()]]
    # fp32 fed the same batches (fp16 rounding can change a selected column: 0.02 apart here)
    assert max_diff(got, [_steps(_engine(TOPK), kept)]) < 0.05


def test_overlap_step_runs_the_host_update_during_the_next_steps():
    engine = _engine(OVERLAP)
    x, y = batches(1)[0]
    zf = engine.opt_groups[0].optimizer
    for _ in range(2):  # the second step ends the first interval: its host update starts
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    assert zf.runner._running is not None  # on the worker while the next forward/backward run
    assert zf.runner.worker._threads and "host-update" in next(iter(zf.runner.worker._threads)).name
    engine.flush_delayed_update()  # eval and saving wait for it
    assert zf.runner._running is None
