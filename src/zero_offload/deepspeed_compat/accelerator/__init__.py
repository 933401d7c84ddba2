"""``deepspeed.accelerator.get_accelerator()``: the device zero_offload's engine uses (CUDA, or
the CPU on a machine without a GPU, with gloo, or with ZERO_OFFLOAD_DEVICE=cpu), with the
methods of DeepSpeed's accelerator object that the Hugging Face libraries call. Any other
method raises ``DeepSpeedNotProvidedError`` naming it."""

from __future__ import annotations

import os

import torch

from ...core import dist as _rt
from .._common import DeepSpeedNotProvidedError, not_provided_getattr
from .memory import MemoryCounters

__all__ = ["get_accelerator"]
__getattr__ = not_provided_getattr(__name__)


class ZeroOffloadAccelerator(MemoryCounters):
    """The parts of DeepSpeed's ``DeepSpeedAccelerator`` in use, over ``torch``."""

    @property
    def _name(self) -> str:
        return _rt.default_device().type

    def device_name(self, device_index=None) -> str:
        name = self._name
        if name == "cpu" or device_index is None:
            return name
        return f"{name}:{int(device_index)}"

    def current_device(self) -> int:
        device = _rt.default_device()
        return device.index if device.index is not None else 0

    def current_device_name(self) -> str:
        return str(_rt.default_device())

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        """CUDA's device count; on the CPU, as DeepSpeed's CPU accelerator counts: one "device"
        per local rank (``LOCAL_SIZE``, else torchrun's ``LOCAL_WORLD_SIZE``), else 1."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
            value = os.environ.get(key, "")
            if value.isdigit() and int(value) > 0:
                return int(value)
        return 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` the current CUDA device; the CPU has one device (a no-op)."""
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    # The random-number generator of the device (the CPU's default generator on the CPU).
    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._name == "cuda" else torch.initial_seed()

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        if self._name == "cuda":
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(
                new_state, device_index if device_index is not None else "cuda"
            )
        else:
            torch.set_rng_state(new_state)

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """The training dtypes the engine runs on this device (DeepSpeed's order)."""
        if self._name == "cuda":
            bf16 = [torch.bfloat16] if self.is_bf16_supported() else []
            return [torch.float, torch.half, *bf16]
        return [torch.float, torch.bfloat16, torch.float16]

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise DeepSpeedNotProvidedError(f"deepspeed.accelerator.get_accelerator().{name}")


_ACCELERATOR = ZeroOffloadAccelerator()


def get_accelerator() -> ZeroOffloadAccelerator:
    return _ACCELERATOR
