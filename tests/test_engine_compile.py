"""DeepSpeed's ``engine.compile(backend, compile_kwargs, schedule, compiled_autograd_enabled)``
and ``engine.is_compiled``: the wrapped module compiled in place, and a compiled run's losses
and params equal the uncompiled run's at stages 0, 1 and 2 (with optimizer offload too), as
real DeepSpeed's do on the same script (compared when DeepSpeed is installed). Stage 3, a
DeepCompile schedule and compiled autograd are refused by name. The backend is ``aot_eager``
(forward and backward traced through AOTAutograd, no code generation: cheap on a CPU)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from parity import batches, make_model

import zero_offload
from zero_offload.runtime.engine.deepspeed_api.compile import CompileNotSupportedError

BACKEND = "aot_eager"
# (stage, offload_optimizer, backend): "eager" traces the forward only; "aot_eager" traces the
# backward too, through AOTAutograd, where the gradient hooks must still see every gradient.
CASES = [(0, False, "eager"), (1, False, "eager"), (2, False, BACKEND), (2, True, BACKEND)]


def _engine(stage: int, offload: bool = False):
    torch._dynamo.reset()
    model = make_model(0, unused=False)
    zero: dict = {"stage": stage, "reduce_bucket_size": 200}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, optimizer=opt, config=config)
    return engine


def _train(engine, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    losses = []
    for x, y in batches(steps, 1, 1, 4):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in engine.module.parameters()]


@pytest.mark.parametrize(("stage", "offload", "backend"), CASES)
def test_compiled_run_equals_the_uncompiled_run(stage: int, offload: bool, backend: str) -> None:
    plain_losses, plain_params = _train(_engine(stage, offload))
    engine = _engine(stage, offload)
    assert engine.is_compiled is False
    engine.compile(backend=backend, compile_kwargs={"dynamic": False})
    assert engine.is_compiled is True
    losses, params = _train(engine)
    assert losses == plain_losses
    for got, ref in zip(params, plain_params):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    torch._dynamo.reset()


def test_a_second_compile_does_nothing_and_backend_wins_over_compile_kwargs(caplog) -> None:
    engine = _engine(2)
    with caplog.at_level(logging.WARNING, logger="zero_offload"):
        engine.compile(backend="eager", compile_kwargs={"backend": "inductor"})
    assert "compile_kwargs" in caplog.text  # DeepSpeed's warning: the argument wins
    compiled = engine.module._compiled_call_impl
    engine.compile(backend="eager")
    assert engine.module._compiled_call_impl is compiled and engine.is_compiled
    losses, _ = _train(engine, 1)
    assert len(losses) == 1
    torch._dynamo.reset()


def test_stage3_is_refused_by_name() -> None:
    engine = _engine(3)
    with pytest.raises(CompileNotSupportedError, match="ZeRO stage 3 cannot be compiled yet"):
        engine.compile(backend=BACKEND)
    assert engine.is_compiled is False
    assert engine.module._compiled_call_impl is None


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"schedule": [(0, [])]}, "schedule"),
        ({"compiled_autograd_enabled": True}, "compiled_autograd_enabled"),
        ({"backend": 3}, "backend"),
    ],
)
def test_what_is_not_built_is_refused_by_name(kwargs: dict, named: str) -> None:
    engine = _engine(1)
    with pytest.raises((CompileNotSupportedError, ValueError), match=named):
        engine.compile(**{"backend": BACKEND, **kwargs})
    assert engine.is_compiled is False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_DS_SCRIPT = r"""
import json, logging, os, sys, warnings
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
logging.disable(logging.CRITICAL)
warnings.simplefilter("ignore")
sys.path.insert(0, sys.argv[1])
import torch, deepspeed
from parity import batches, make_model
deepspeed.init_distributed(dist_backend="gloo", verbose=False)
out = {}
for compiled in (False, True):
    torch._dynamo.reset()
    model = make_model(0, unused=False)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "gradient_clipping": 0.0, "zero_force_ds_cpu_optimizer": False,
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if compiled:
        engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
    losses = []
    for x, y in batches(3, 1, 1, 4):
        loss = engine(x, y); engine.backward(loss); engine.step(); losses.append(loss.item())
    out[str(compiled)] = {"losses": losses, "is_compiled": engine.is_compiled}
print("RESULT" + json.dumps(out))
"""


def test_deepspeed_compiles_the_same_script_to_the_same_losses() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    here = str(Path(__file__).parent)
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-c", _DS_SCRIPT, here],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    assert line is not None, proc.stderr[-3000:]
    ds = json.loads(line[len("RESULT") :])
    assert ds["True"]["is_compiled"] and not ds["False"]["is_compiled"]
    assert ds["True"]["losses"] == ds["False"]["losses"]  # DeepSpeed: compiled equals plain
    engine = _engine(2, offload=True)
    engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
    losses, _ = _train(engine)
    torch.testing.assert_close(losses, ds["True"]["losses"], rtol=1e-5, atol=0)
    torch._dynamo.reset()


@pytest.mark.slow
def test_inductor_at_stage2_offload_tracks_the_uncompiled_run() -> None:
    """DeepSpeed's default backend, with code generation (slow to compile on a CPU): fused
    kernels may round differently, so the losses agree to 1e-5, not bit for bit."""
    plain_losses, _ = _train(_engine(2, offload=True))
    engine = _engine(2, offload=True)
    engine.compile()
    losses, _ = _train(engine)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=0)
    torch._dynamo.reset()
