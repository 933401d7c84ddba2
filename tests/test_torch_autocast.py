"""The ``torch_autocast`` section (DeepSpeed's native-autocast mode): the engine's forward runs
under ``torch.autocast`` with the params kept in fp32, equal to plain PyTorch running the same
forward under ``torch.autocast`` (loss, gradients and the AdamW step), at stages 0, 1 and 3 on
two ranks; the lower-precision-safe modules' params carry the dtype as ``comm_dtype``; fp16
autocast scales the loss; bad settings are errors naming the key."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import every_rank

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.utils import safe_get_full_fp32_param, safe_get_full_grad

LR = 1e-2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return torch.nn.functional.mse_loss(out.float(), y)


def _config(stage: int, autocast: dict) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
        "torch_autocast": autocast,
    }


def _run(stage: int) -> dict:
    """Every rank trains on the same batch, so the averaged gradient is that batch's."""
    torch.manual_seed(0)
    ref = _Net()
    engine, *_ = zero_offload.initialize(
        model=copy.deepcopy(ref), config=_config(stage, {"enabled": True, "dtype": "bf16"})
    )
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    loss = engine(x, y)
    if stage == 3:
        assert all(p.numel() == 0 < p.ds_numel for p in engine.module.parameters())
    engine.backward(loss)
    names = [n for n, _ in ref.named_parameters()]
    params = dict(engine.module.named_parameters())
    grads = {n: safe_get_full_grad(params[n]).clone() for n in names}
    engine.step()
    stepped = {n: safe_get_full_fp32_param(params[n]).clone() for n in names}
    marked = {n: getattr(params[n], "comm_dtype", None) for n in names}
    engine.destroy()

    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = ref(x, y)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    opt.step()
    return {
        "loss": (loss.item(), ref_loss.item(), ref(x, y).item()),
        "grads": [(grads[n], ref_grads[n]) for n in names],
        "params": [(stepped[n], p.detach()) for n, p in ref.named_parameters()],
        "marked": marked,
    }


def _all_stages() -> list[dict]:
    return [_run(stage) for stage in (0, 1, 3)]


def test_forward_under_autocast_equals_plain_pytorch_two_ranks() -> None:
    for rank_results in every_rank(2, _all_stages):
        for got in rank_results:
            loss, ref_loss, fp32_loss = got["loss"]
            assert loss == pytest.approx(ref_loss, abs=1e-6)
            assert abs(fp32_loss - ref_loss) > 1e-5  # the check can tell bf16 from fp32
            for grad, ref_grad in got["grads"]:
                torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
            for param, ref_param in got["params"]:
                torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6)
            marked = got["marked"]
            assert marked["fc1.weight"] == marked["fc2.bias"] == torch.bfloat16
            assert marked["norm.weight"] is None  # LayerNorm is not lower-precision safe


def _engine(autocast: dict, fp16: dict | None = None):
    cfg = _config(0, autocast)
    if fp16 is not None:
        cfg["fp16"] = fp16
    engine, *_ = zero_offload.initialize(model=_Net(), config=cfg)
    return engine


def test_named_safe_modules_are_the_ones_marked() -> None:
    names = ["torch.nn.modules.normalization.LayerNorm"]
    engine = _engine(
        {"enabled": True, "dtype": "torch.bfloat16", "lower_precision_safe_modules": names}
    )
    assert engine.module.norm.weight.comm_dtype == torch.bfloat16
    assert not hasattr(engine.module.fc1.weight, "comm_dtype")
    assert engine.torch_autocast_enabled() and engine.torch_autocast_dtype() == torch.bfloat16
    engine.destroy()


def test_disabled_section_marks_nothing_and_leaves_the_forward_alone() -> None:
    engine = _engine({"enabled": False, "dtype": "bf16"})
    assert not any(hasattr(p, "comm_dtype") for p in engine.module.parameters())
    x, y = torch.randn(4, 16), torch.randn(4, 8)
    assert engine(x, y).item() == engine.module(x, y).item()
    engine.destroy()


def test_fp16_autocast_scales_the_loss_as_torchs_grad_scaler() -> None:
    engine = _engine({"enabled": True, "dtype": "fp16"})
    assert engine.optimizer.needs_scaler()
    assert not engine.fp16_enabled()  # the params stay fp32
    assert engine.module.fc1.weight.dtype == torch.float32
    scaler = torch.amp.GradScaler("cpu")  # its defaults: the scaling expected
    assert engine.loss_scaler.loss_scale == scaler.get_scale() == 2.0**16
    assert scaler.get_backoff_factor() == 0.5 and scaler.get_growth_interval() == 2000
    expected = 2.0**16
    for overflow in (True, True, False):  # halved on every overflow (no hysteresis)
        engine.loss_scaler.update_scale(overflow)
        expected *= scaler.get_backoff_factor() if overflow else 1.0
        assert engine.loss_scaler.loss_scale == expected
    engine.destroy()


def test_bad_dtype_and_module_name_are_errors_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="torch_autocast.dtype"):
        _engine({"enabled": True, "dtype": "int8"})
    with pytest.raises(ConfigError, match="torch_autocast.lower_precision_safe_modules"):
        _engine({"enabled": True, "lower_precision_safe_modules": ["no.such.Module"]})


def _fp16_against_grad_scaler(stage: int) -> list[tuple[float, float]]:
    torch.manual_seed(1)
    ref = _Net()
    engine, *_ = zero_offload.initialize(
        model=copy.deepcopy(ref), config=_config(stage, {"enabled": True, "dtype": "fp16"})
    )
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for _ in range(4):
        x, y = torch.randn(4, 16), 300.0 * torch.randn(4, 8)  # large: the first steps overflow
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = ref(x, y)
        loss = engine(x, y)
        losses.append((loss.item(), ref_loss.item()))
        opt.zero_grad()
        scaler.scale(ref_loss).backward()
        scaler.step(opt)
        scaler.update()
        engine.backward(loss)
        engine.step()
    assert engine.skipped_steps > 0  # the overflow path ran
    engine.destroy()
    return losses


@pytest.mark.parametrize("stage", [0, 1])
def test_fp16_autocast_trains_as_plain_pytorch_with_grad_scaler(stage: int) -> None:
    for loss, ref_loss in _fp16_against_grad_scaler(stage):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
