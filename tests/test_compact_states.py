"""Compact optimizer states through the engine (``core/state/compact_state.py``): DeepSpeed's
``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` (8 bytes/param of host state at
stage 2 + offload "cpu") and ``AdamW8bit`` (6 bytes/param with a bf16 master), stages 1-3.

Checked: the run matches a written reference of the same arithmetic (a plain bf16 PyTorch model
stepped by ``reference_adam_step_states`` per param); the memory report counts the format's
bytes and agrees with ``expected_memory``; save/resume is bitwise (8-bit codes and scales saved
beside the fp32 values); a checkpoint of another format converts with a warning naming both;
the fragment API gives fp32. (Without optimizer offload and with partial offload:
test_compact_states_device.py; on NVMe: test_nvme_compact_states.py.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from parity import LR, WD, batches, engine_config, global_step, make_model, with_states

from zero_offload.kernels.adam_states import reference_adam_step_states

STEPS, MICRO = 6, 4


def _config(stage: int, states: str, offload_param: bool = False) -> dict:
    cfg = engine_config(stage, True, 1, MICRO, 0.0, False, "bf16", offload_param=offload_param,
                        zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
    return with_states(cfg, states)


def _engine(cfg: dict):
    import zero_offload

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    return engine, model


def _train(engine, steps=STEPS, seed: int = 1) -> list[float]:
    return [global_step(engine, x, y) for x, y in batches(steps, 1, 1, MICRO, seed)]


def _params(engine, model) -> dict[str, torch.Tensor]:
    from zero_offload.utils import safe_get_full_fp32_param

    return {
        n: safe_get_full_fp32_param(p).clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def _reference_bf16_states(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, bf16 params, each trainable param updated by the written reference with
    bf16 master (the param itself) and bf16 moments."""
    model = make_model().to(torch.bfloat16)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    state = {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}
    losses = []
    for step, (x, y) in enumerate(batches(steps, 1, 1, MICRO), 1):
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        for n, p in params.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m, v = state[n]
            reference_adam_step_states(
                p.data.view(-1), m.view(-1), v.view(-1), g.reshape(-1), None, step=step, lr=LR,
                beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=WD, adamw=True,
            )  # fmt: skip
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().float() for n, p in params.items()}


@pytest.mark.parametrize("stage,offload_param", [(1, False), (2, False), (3, False), (3, True)])
def test_bf16_states_match_the_written_reference(one_rank, stage, offload_param):
    engine, model = _engine(_config(stage, "bf16", offload_param))
    so = engine.opt_groups[0].optimizer
    assert so.state.master.dtype == torch.bfloat16 and so.state.exp_avg.dtype == torch.bfloat16
    if stage == 3:
        assert all(p.numel() == 0 for p in model.parameters() if p.requires_grad)  # partitioned
    losses = _train(engine)
    ref_losses, ref = _reference_bf16_states()
    got = _params(engine, model)
    for n, r in ref.items():  # bf16 rounding of the same arithmetic: a bf16 ulp or two
        assert torch.allclose(got[n], r, rtol=2e-2, atol=2e-3), n
    assert losses == pytest.approx(ref_losses, rel=2e-2)


@pytest.mark.parametrize("states,per_param", [("fp32", 16.0), ("bf16", 8.0), ("8bit", 6.03)])
def test_host_bytes_per_param_stage2(one_rank, states, per_param):
    """The host keeps grad + master + moments (+ staging in fp32): the issue's table."""
    engine, _ = _engine(_config(2, states))
    report = engine.memory_report()
    host = sum(v for k, v in report.items() if k.startswith("host.") and "allocator" not in k)
    numel = sum(og.optimizer.state.numel for og in engine.opt_groups)
    assert host / numel == pytest.approx(per_param, abs=0.02)
    expected = engine.expected_memory()
    for key in ("host.master_shard", "host.optimizer_state"):
        assert report[key] == pytest.approx(expected[key], rel=0.02), key


def test_eight_bit_moments_train_as_fp32_states(one_rank):
    fp32 = _train(_engine(_config(2, "fp32"))[0], steps=12)
    eight = _train(_engine(_config(2, "8bit"))[0], steps=12)
    assert eight[-1] == pytest.approx(fp32[-1], rel=0.05)
    assert eight[-1] < 0.9 * eight[0]


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_resume_is_bitwise(one_rank, tmp_path, states):
    cfg = _config(2, states)
    engine, model = _engine(cfg)
    _train(engine, steps=3)
    engine.save_checkpoint(str(tmp_path), tag="t")
    after = _train(engine, steps=3, seed=7)
    want = _params(engine, model)
    engine2, model2 = _engine(cfg)
    engine2.load_checkpoint(str(tmp_path), tag="t")
    assert _train(engine2, steps=3, seed=7) == after
    got = _params(engine2, model2)
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_another_format_converts_with_a_warning(one_rank, tmp_path):
    engine, _ = _engine(_config(2, "fp32"))
    _train(engine, steps=2)
    engine.save_checkpoint(str(tmp_path), tag="t")
    eight, _ = _engine(_config(2, "8bit"))
    with pytest.warns(UserWarning, match=r"fp32, this run keeps 8bit\+bf16"):
        eight.load_checkpoint(str(tmp_path), tag="t")
    m = eight.opt_groups[0].optimizer.state.read("exp_avg", 0, 64)
    ref = engine.opt_groups[0].optimizer.state.read("exp_avg", 0, 64)
    assert torch.allclose(m, ref, rtol=0.1, atol=1e-3 * float(ref.abs().max()))


def test_fragment_api_gives_fp32(one_rank):
    from zero_offload.utils import safe_get_full_optimizer_state

    engine, model = _engine(_config(2, "8bit"))
    _train(engine, steps=2)
    p = model.l1.weight
    m = safe_get_full_optimizer_state(p, "exp_avg")
    v = safe_get_full_optimizer_state(p, "exp_avg_sq")
    assert m.dtype == torch.float32 and m.shape == p.shape and m.abs().sum() > 0
    assert v.dtype == torch.float32 and bool((v >= 0).all())


@pytest.mark.parametrize("stage,offload_param", [(2, False), (3, True)])
def test_zero_to_fp32_gives_the_fp32_weights(one_rank, tmp_path, stage, offload_param):
    """A compact checkpoint (8-bit moments, a bf16 master: at stage 3 with both offloads the
    param shard itself) gives fp32 weights through the library and the copied standalone
    scripts (zero_to_fp32.py, zero_to_torch.py --dtype fp32) alike: the master's values,
    upcast exactly."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from zero_offload.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    engine, model = _engine(_config(stage, "8bit", offload_param))
    _train(engine, steps=2)
    want = _params(engine, model)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    got = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert all(got[n].dtype == torch.float32 and torch.equal(got[n], want[n]) for n in want)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name, extra in (("zero_to_fp32.py", []), ("zero_to_torch.py", ["--dtype", "fp32"])):
        script = tmp_path / "ckpt" / name
        out_dir = tmp_path / name.removesuffix(".py")
        argv = [str(script), str(tmp_path / "ckpt"), str(out_dir), "--safe_serialization", *extra]
        code = (
            "import sys; sys.modules['zero_offload'] = None; import runpy; "
            f"sys.argv = {argv!r}; runpy.run_path({str(script)!r}, run_name='__main__')"
        )
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, (name, proc.stderr)
        out = load_file(out_dir / "model.safetensors")
        assert all(torch.equal(out[n], want[n]) for n in want), name


def test_fresh_8bit_moments_touch_no_memory():
    """Zero moments are zero bytes (codes and scales) in fresh host mappings: building the state
    faults in none of its pages (the set-up's peak does not carry the moments; the first step
    writes them), and they read back as zeros."""
    from zero_offload.core.state.compact_moments import CompactMoments
    from zero_offload.core.state.format import StateFormat

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon:"))

    n = 64 << 20
    before = anon()
    moments = CompactMoments(n, torch.device("cpu"), StateFormat(moments="8bit"), "host")
    assert anon() - before < (8 << 20), "the fresh moments' pages were touched"
    for kind in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(moments.read(kind, n - 1000, n), torch.zeros(1000))
