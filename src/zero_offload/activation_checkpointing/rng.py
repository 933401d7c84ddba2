"""The random-number states a recompute must replay: the CPU generator, the device's generator
and the named states of the model-parallel tracker (Megatron's dropout in tensor-parallel
regions draws from a tracked state inside ``tracker.fork()``).

On the CPU the device's generator is the CPU's own: one state, saved and restored once."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..core.dist import default_device

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's and Megatron's name of the tracked state
MODEL_PARALLEL_SEED_OFFSET = 2718  # DeepSpeed's offset of the model-parallel seed


def _on_cuda() -> bool:
    return default_device().type == "cuda"


def device_rng_state() -> torch.Tensor:
    """The compute device's generator state (the CPU's on the CPU)."""
    return torch.cuda.get_rng_state() if _on_cuda() else torch.get_rng_state()


def set_device_rng_state(state: torch.Tensor) -> None:
    if _on_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def device_manual_seed(seed: int) -> None:
    if _on_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class RngStatesTracker:
    """Named device-generator states (DeepSpeed's ``CudaRNGStatesTracker``): ``add`` seeds one,
    ``fork`` runs a block from it and keeps where the block left it."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state mapping (the states themselves are not copied: a fork
        replaces a state, it never writes one in place)."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        before = device_rng_state()
        device_manual_seed(seed)
        self.states_[name] = device_rng_state()
        set_device_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        before = device_rng_state()
        set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = device_rng_state()
            set_device_rng_state(before)


TRACKER = RngStatesTracker()


def get_cuda_rng_tracker() -> RngStatesTracker:
    return TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0) -> None:
    """DeepSpeed's seeding: the device generator gets ``seed`` (the same on every rank of a
    model-parallel group), the tracked model-parallel state ``seed + 2718 + tp_rank``."""
    TRACKER.reset()
    device_manual_seed(seed)
    TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)


@dataclass(frozen=True)
class RngSnapshot:
    """Every state a recompute replays, taken where the checkpoint's forward began."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracked: dict[str, torch.Tensor]

    @classmethod
    def take(cls) -> RngSnapshot:
        device = torch.cuda.get_rng_state() if _on_cuda() else None
        return cls(torch.get_rng_state(), device, TRACKER.get_states())

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device)
        TRACKER.set_states(self.tracked)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run a block from these states, then put back the ones it found."""
        now = RngSnapshot.take()
        self.restore()
        try:
            yield
        finally:
            now.restore()
