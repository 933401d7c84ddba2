"""``cpu_checkpointing``'s large host buffers are made (and so page-locked) once per size, not
once per step: each step's checkpoints take the buffers the previous step's freed. On the CPU the
device path is forced (every input counts as a device tensor) and the registering allocation is
a counted stand-in; ``test_cuda_checkpoint_buffers_registered_once`` counts the real
cudaHostRegister calls on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from zero_offload import activation_checkpointing as ac
from zero_offload.activation_checkpointing import stash
from zero_offload.activation_checkpointing.host_buffers import HostBuffers
from zero_offload.activation_checkpointing.settings import SETTINGS
from zero_offload.core import streams

D, BLOCKS, BATCH, STEPS = 32, 3, 8, 4


def _stack() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(BLOCKS))


def _steps(
    blocks: torch.nn.ModuleList, device: str, checkpointed: bool, batch: int = BATCH
) -> list[torch.Tensor]:
    """``STEPS`` forward/backward passes; the grads of the last."""
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        blocks.zero_grad()
        x = torch.randn(batch, D, generator=g).to(device).requires_grad_()
        for b in blocks:
            x = ac.checkpoint(b, x) if checkpointed else b(x)
        x.square().mean().backward()
    return [p.grad.detach().cpu().clone() for p in blocks.parameters()]


@pytest.fixture
def cpu_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        SETTINGS, "policy", dataclasses.replace(SETTINGS.policy, cpu_checkpointing=True)
    )


def test_large_host_buffers_are_made_once(monkeypatch, cpu_checkpointing) -> None:
    made: list[int] = []

    def counted(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        made.append(numel * torch.empty((), dtype=dtype).element_size())
        return torch.empty(numel, dtype=dtype)

    pool = HostBuffers(min_bytes=BATCH * D * 4, alloc=counted)  # every input is "large"
    monkeypatch.setattr(stash, "HOST_BUFFERS", pool)
    monkeypatch.setattr(stash, "alloc_host", counted)  # the per-step path, were it taken
    monkeypatch.setattr(stash, "_on_host", lambda t: False)  # the device path, on the CPU
    got = _steps(_stack(), "cpu", checkpointed=True)
    # one buffer per checkpoint live at once (all of a step's), reused by every later step
    assert made == [BATCH * D * 4] * BLOCKS, made
    assert pool.allocated == BLOCKS and pool.free_bytes() == BLOCKS * BATCH * D * 4
    want = _steps(_stack(), "cpu", checkpointed=False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_small_host_buffers_stay_with_the_caching_allocator(monkeypatch, cpu_checkpointing) -> None:
    pool = HostBuffers(min_bytes=BATCH * D * 4 + 1)
    monkeypatch.setattr(stash, "HOST_BUFFERS", pool)
    monkeypatch.setattr(stash, "_on_host", lambda t: False)
    _steps(_stack(), "cpu", checkpointed=True)
    assert pool.allocated == 0 and pool.free_bytes() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checkpoint_buffers_registered_once(monkeypatch, cpu_checkpointing) -> None:
    """On a GPU: checkpoint inputs of 64 MiB are page-locked (cudaHostRegister) once each over
    ``STEPS`` steps, never unregistered between steps, and the grads match the plain model's."""
    calls: list[int] = []
    real = streams._registered

    def counted(numel, dtype, nbytes):
        calls.append(nbytes)
        return real(numel, dtype, nbytes)

    monkeypatch.setattr(streams, "_registered", counted)
    monkeypatch.setattr(stash, "HOST_BUFFERS", HostBuffers())
    batch = (64 << 20) // (D * 4)  # each checkpoint's input: 64 MiB of fp32
    got = _steps(_stack().cuda(), "cuda", checkpointed=True, batch=batch)
    want = _steps(_stack().cuda(), "cuda", checkpointed=False, batch=batch)
    assert calls == [64 << 20] * BLOCKS, calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
