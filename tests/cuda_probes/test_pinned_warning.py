"""GPU probe: offload from pageable host memory on CUDA warns once, naming the key; pinned
offload does not."""

from __future__ import annotations

import warnings

import pytest
import torch
from parity import engine_config, make_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _init(pin: bool) -> list[str]:
    import zero_offload

    cfg = engine_config(2, True, 1, 2, 0.0, overlap=True, dtype="bf16", pin_memory=pin)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = zero_offload.initialize(model=make_model(), config=cfg)
        engine.destroy()
    return [str(w.message) for w in caught if "pageable" in str(w.message)]


def test_unpinned_offload_warns_pinned_does_not(monkeypatch):
    from zero_offload.runtime.engine import pin_warning

    monkeypatch.setattr(pin_warning, "_warned", False)
    assert _init(pin=True) == []
    got = _init(pin=False)
    assert len(got) == 1 and "offload_optimizer.pin_memory" in got[0]
