"""``zero_force_ds_cpu_optimizer`` as DeepSpeed reads it.

``deepspeed.initialize`` (the namespace) refuses a client optimizer other than
``DeepSpeedCPUAdam`` under ``offload_optimizer`` with DeepSpeed's ``ZeRORuntimeException``
unless the key is false (DeepSpeed's default is true); ``zero_offload.initialize`` keeps
running any client optimizer on the host."""

from __future__ import annotations

import pytest
import torch

import zero_offload
from zero_offload import deepspeed_compat as deepspeed
from zero_offload.deepspeed_compat.runtime.zero.utils import ZeRORuntimeException
from zero_offload.ops.adam import DeepSpeedCPUAdam


def _config(offload: str, **top) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": offload}},
        **top,
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def test_client_torch_optimizer_with_offload_is_refused_by_default() -> None:
    model = _model()
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    with pytest.raises(ZeRORuntimeException, match="zero_force_ds_cpu_optimizer"):
        deepspeed.initialize(model=model, optimizer=client, config=_config("cpu"))


def test_key_false_runs_the_client_optimizer() -> None:
    model = _model()
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = _config("cpu", zero_force_ds_cpu_optimizer=False)
    engine = deepspeed.initialize(model=model, optimizer=client, config=config)[0]
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.destroy()


@pytest.mark.parametrize(
    ("offload", "client_cls"), [("none", torch.optim.Adam), ("cpu", DeepSpeedCPUAdam)]
)
def test_no_refusal_without_offload_or_with_cpu_adam(offload: str, client_cls) -> None:
    model = _model()
    client = client_cls(model.parameters(), lr=1e-3)
    engine = deepspeed.initialize(model=model, optimizer=client, config=_config(offload))[0]
    engine.destroy()


def test_native_initialize_keeps_any_client_optimizer() -> None:
    model = _model()
    client = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine = zero_offload.initialize(model=model, optimizer=client, config=_config("cpu"))[0]
    engine.destroy()
