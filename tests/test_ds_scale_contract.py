"""DeepSpeed's user-backward contract: ``engine.scale(loss)`` asserts a scalar loss (an
``AssertionError`` naming a scalar tensor), an unscaled fp16 ``loss.backward()`` is a
``RuntimeError`` that says loss scaling is required, and ``engine.optimizer.needs_scaler()``
answers whether a plain backward needs ``engine.scale`` (fp16 yes; bf16 and fp32 no)."""

from __future__ import annotations

import pytest
import torch
from parity import engine_config, make_model

import zero_offload


def _engine(dtype: str | None = None):
    extra = {"dtype": dtype} if dtype else {}
    cfg = engine_config(2, False, 1, 1, 0.0, overlap=False, **extra)
    engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
    return engine, torch.randint(0, 32, (2, 5))


@pytest.mark.parametrize("dtype", [None, "bf16", "fp16"])
def test_needs_scaler_is_true_with_fp16_only(dtype: str | None) -> None:
    engine, _ = _engine(dtype)
    assert engine.optimizer.needs_scaler() is (dtype == "fp16")
    engine.destroy()


def test_scale_of_a_non_scalar_is_an_assertion_naming_a_scalar_tensor() -> None:
    engine, x = _engine()
    out = engine(x, x)
    with pytest.raises(AssertionError, match="scalar tensor"):
        engine.scale(out.reshape(1).expand(3))
    with pytest.raises(ValueError, match="scalar tensor"):  # as this project raised it before
        engine.backward(out.reshape(1).expand(3))
    engine.destroy()


def test_unscaled_fp16_plain_backward_is_a_runtime_error() -> None:
    engine, x = _engine("fp16")
    with pytest.raises(RuntimeError, match="Loss scaling is required"):
        engine(x, x).backward()
    engine.destroy()


def test_managed_gradient_accumulation_accessor_defaults_true() -> None:
    engine, _ = _engine()
    assert engine.managed_gradient_accumulation() is True
    engine.destroy()
