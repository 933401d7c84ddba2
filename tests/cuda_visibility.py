"""A CPU test on a machine with a GPU sees none (used by conftest.py's autouse fixture; its own
module, so that a test can import it without naming a ``conftest`` of which there are several)."""

from __future__ import annotations

import pytest


def hide_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU test on a machine with a GPU: ``torch.cuda`` answers "no GPU" in this process, and
    the processes the test starts inherit ``CUDA_VISIBLE_DEVICES=""``. The real answer is asked
    first: that initialises the CUDA driver with the real device list, which a later change of
    the variable no longer alters in this process (a ``cuda`` test after this one still sees the
    GPU; the variable alone, read at the driver's first use, would hide it for good)."""
    import torch

    if not torch.cuda.is_available():
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
