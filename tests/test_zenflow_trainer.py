"""ZenFlow as the Hugging Face Trainer drives it. accelerate's DeepSpeed wrapper calls
``set_gradient_accumulation_boundary(sync_gradients)`` before every backward and the Trainer
passes ``scale_wrt_gas=False``; DeepSpeed's ``configure_zenflow`` setting the engine's
``gradient_accumulation_steps`` to ``update_interval`` reaches neither (accelerate read the
config's value before ``initialize``), so a logged step sees the Trainer's own micro-batches.
Here the configured schedule holds under that override: the run equals the engine loop that
``tests/test_zenflow.py`` checks against the plain-PyTorch ZenFlow reference (and
``tests/test_zenflow_deepspeed.py`` against DeepSpeed's own engine loop), bit for bit, with one
warning naming the keys DeepSpeed 0.19.8 lets the override bypass (docs/zenflow.md)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from zenflow_run import batches, config, make_model

import zero_offload
from zero_offload.runtime.engine.deepspeed_api import engine_api

# the schedule: host updates every 2nd step, selections every 2nd, the host overlapped
ZF = {
    "topk_ratio": 0.05,
    "select_strategy": "step",
    "select_interval": 2,
    "update_interval": 2,
    "full_warm_up_rounds": 0,
    "overlap_step": True,
}


def _train(accelerate_micro: int | None, steps: int = 6) -> list[torch.Tensor]:
    """The params after ``steps`` ZenFlow steps on zenflow_run's batches. ``None``: the engine
    loop (backward, step). Else accelerate's wrapper with the Trainer's gradient accumulation
    ``accelerate_micro``: each batch cut in that many micro-batches, the loss divided by it
    (the Trainer), the boundary set before each backward, ``step()`` after the last."""
    torch.manual_seed(0)
    model = make_model("nobias")
    cfg = config(dict(ZF))
    cfg["train_micro_batch_size_per_gpu"] = 4 // (accelerate_micro or 1)
    cfg["gradient_accumulation_steps"] = accelerate_micro or 1
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    for x, y in batches(steps):
        if accelerate_micro is None:
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            continue
        n = x.shape[0] // accelerate_micro
        for k in range(accelerate_micro):
            last = k == accelerate_micro - 1
            xs, ys = x[k * n : (k + 1) * n], y[k * n : (k + 1) * n]
            loss = torch.nn.functional.mse_loss(engine(xs), ys) / accelerate_micro
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(loss, scale_wrt_gas=False)
            if last:
                engine.step()
    engine.flush_delayed_update()
    out = [p.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return out


def test_accelerate_boundary_keeps_the_zenflow_schedule(caplog, monkeypatch):
    monkeypatch.setattr(engine_api, "_zenflow_boundary_noted", False)
    want = _train(None)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        got = _train(1)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    notes = [r for r in caplog.records if "zenflow.update_interval" in r.getMessage()]
    assert len(notes) == 1 and "DeepSpeed 0.19.8" in notes[0].getMessage()


def test_trainer_gradient_accumulation_is_one_zenflow_step():
    """The Trainer's gradient_accumulation_steps 2: two micro-batches (the loss halved by the
    Trainer), one ZenFlow step, the same gradient as the whole batch: equal to the engine loop
    to fp32 rounding (the batch mean is summed in two halves)."""
    want = _train(None)
    got = _train(2)
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) < 1e-6


def _engine_loop_replay(model_dir: str, rec: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The chosen reference for the Trainer route: zero_offload's own ZenFlow engine loop
    (``forward``, ``backward``, ``step``; checked against the plain-PyTorch ZenFlow reference in
    ``tests/test_zenflow.py``) on the same model as loaded from ``model_dir``, the optimizer the
    Trainer created (its class and param groups), the config as the Trainer filled it in, over
    exactly the micro-batches the Trainer fed. Returns each step's loss and the trained params,
    the pending delayed update applied (as the Trainer run's recorded params are)."""
    from hf_route_helpers import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = model.float()
    named = dict(model.named_parameters())
    groups = [
        {
            **{k: tuple(v) if isinstance(v, list) else v for k, v in g.items() if k != "names"},
            "params": [named[n] for n in g["names"]],
        }
        for g in rec["optimizer"]["groups"]
    ]
    assert sorted(n for g in rec["optimizer"]["groups"] for n in g["names"]) == sorted(named)
    optimizer = getattr(torch.optim, rec["optimizer"]["type"])(groups)
    # the two keys the Hugging Face libraries add, read as the deepspeed namespace reads them:
    # steps_per_print infinite (JSON's Infinity here) is no step log, and the Trainer's
    # zero_allow_untested_optimizer is moot (every client optimizer is allowed)
    cfg = dict(rec["ds"])
    assert cfg.pop("steps_per_print", math.inf) == math.inf
    cfg.pop("zero_allow_untested_optimizer", None)
    engine, *_ = zero_offload.initialize(model=model, optimizer=optimizer, config=cfg)
    losses = []
    for batch in rec["batches"]:
        loss = engine(**{k: torch.tensor(v) for k, v in batch.items()}).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.flush_delayed_update()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, params


def test_trainer_route_with_zenflow(tmp_path):
    """The Trainer itself (stage 2, offload_optimizer cpu, the schedule above, 4 steps, a tiny
    Llama, every step logged) against zero_offload's ZenFlow engine loop replaying the same
    micro-batches from the same model, optimizer and filled-in config: every logged loss and
    the trained params equal, bit for bit (the configured schedule holds under accelerate's
    boundary override). Its first logged loss is the plain Trainer's (the model as given;
    DeepSpeed 0.19.8's stage-2 ZenFlow scrambles every 2-D param at initialize, the first
    place its Trainer run parts from the plain one), and every later one is ZenFlow's, not
    AdamW's."""
    from hf_route_helpers import ds_config, run_script, tiny_llama_dir, train_args

    model_dir = str(tiny_llama_dir(tmp_path / "llama"))
    args = dict(gradient_accumulation_steps=1, lr_scheduler_type="constant", logging_steps=1)
    plain = {"model_dir": model_dir, "args": train_args(tmp_path / "plain", **args)}
    ds = ds_config(2, offload=True)
    ds["zero_optimization"]["zenflow"] = dict(ZF)
    saved = tmp_path / "zf_params.pt"
    run = {
        "model_dir": model_dir,
        "ds": ds,
        "args": train_args(tmp_path / "zf", **args),
        "record": str(saved),
    }
    # one process (one import of transformers): the plain Trainer first, with no DeepSpeed
    # config the opt-in leaves it plain
    ref, got = run_script("run_trainer.py", {"opt_in": "call", "runs": [plain, run]}, tmp_path)
    assert ref["engine"].endswith("LlamaForCausalLM")
    assert got["engine"].endswith("ZeroOffloadEngine")
    rec = got["recorded"]
    assert got["steps"] == [1, 2, 3, 4] and len(rec["batches"]) == 4
    # logging_steps 1, one micro-batch a step: each logged loss is that step's own loss
    assert got["losses"] == rec["losses"]
    assert all(map(torch.isfinite, torch.tensor(got["losses"])))

    want_losses, want_params = _engine_loop_replay(model_dir, rec)
    for step, (a, b) in enumerate(zip(got["losses"], want_losses), 1):
        assert a == b, f"step {step}: Trainer loss {a!r}, engine loop {b!r}\n{got['losses']}"
    trained = torch.load(saved)
    assert trained.keys() == want_params.keys()
    for name, p in want_params.items():
        same = torch.equal(trained[name], p)
        assert same, f"param {name}: max |diff| {float((trained[name] - p).abs().max())}"

    assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-6)
    assert got["losses"][1:] != pytest.approx(ref["losses"][1:], rel=1e-6)
