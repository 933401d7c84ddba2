"""The delayed parameter update equals a reference that applies each update one step late:
after ``delayed_update_after`` normal steps, forward/backward of step t runs on the params from
before update t-1 was applied, while the master weights follow Adam exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import (
    BETAS,
    EPS,
    LR,
    WD,
    batches,
    displacement_err,
    engine_config,
    make_model,
    run_engine,
)

STEPS, MICRO, GAS, AFTER = 6, 2, 1, 2


def delayed_reference(world: int):
    master = make_model()
    init = {n: p.detach().clone() for n, p in master.named_parameters()}
    device = copy.deepcopy(master)
    opt = torch.optim.AdamW(
        [p for p in master.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
    )
    losses = []
    for k, (x, y) in enumerate(batches(STEPS, world, GAS, MICRO)):
        device.zero_grad()
        loss = device(x, y)
        loss.backward()
        for pm, pd in zip(master.parameters(), device.parameters()):
            if pm.requires_grad:
                pm.grad = torch.zeros_like(pm) if pd.grad is None else pd.grad.clone()
        old = [p.detach().clone() for p in master.parameters()]
        opt.step()
        new = [p.detach() for p in master.parameters()]
        with torch.no_grad():  # the device sees update k now, or (delayed) only after step k+1
            for pd, src in zip(device.parameters(), new if k < AFTER else old):
                pd.copy_(src)
        losses.append(float(loss.detach()))
    return init, {n: p.detach().clone() for n, p in master.named_parameters()}, losses


def run_delayed(delayed: bool, stage: int = 2, offload_param: bool = False):
    cfg = engine_config(
        stage=stage,
        offload=True,
        offload_param=offload_param,
        gas=GAS,
        micro=MICRO,
        clip=0.0,
        overlap=True,
        delayed_update=delayed,
        delayed_update_after=AFTER,
    )
    params, _, _, losses, mem, _ = run_engine(cfg, STEPS, MICRO, GAS)
    return params, losses, mem


def check(world: int, stage: int = 2, offload_param: bool = False) -> dict:
    init, ref_params, ref_losses = delayed_reference(world)
    params, losses, mem = run_delayed(True, stage, offload_param)
    plain_params, plain_losses, _ = run_delayed(False, stage, offload_param)
    return {
        "err": displacement_err(params, ref_params, init),
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "vs_plain": displacement_err(plain_params, ref_params, init),
        "plain_loss_diff": max(abs(a - b) for a, b in zip(plain_losses, ref_losses)),
        "host_grad_bytes": mem["host.grad_shard"],
        "master_bytes": mem["host.master_shard"],
    }


def _assert(r: dict) -> None:
    assert r["err"] < 1e-3, r
    assert r["loss_diff"] < 1e-4, r
    # The delay is visible: the undelayed run is far from the delayed reference.
    assert r["vs_plain"] > 1e-2 and r["plain_loss_diff"] > 1e-4, r
    # Two host grad shards (fp32 here: same bytes as the master) so copies never race the update.
    assert r["host_grad_bytes"] == 2 * r["master_bytes"], r


def test_delayed_update_world1():
    _assert(check(1))


def test_delayed_update_stage3_params_on_host():
    # The worker writes a staging buffer, not the host param shard the next forward gathers from.
    _assert(check(1, stage=3, offload_param=True))


@pytest.mark.slow
def test_delayed_update_world2():
    _assert(run_ranks(2, check, 2))
