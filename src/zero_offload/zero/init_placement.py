"""Where ``zero.Init`` keeps each rank's chunk of a param, from its arguments and the config.

DeepSpeed's rule: a config with ``zero_optimization.offload_param`` names the remote device and
its ``pin_memory``; here the caller's explicit ``remote_device`` wins over it (DeepSpeed's config
overrides even an explicit argument). So a config-only ``zero.Init`` (Hugging Face's
``from_pretrained`` under ZeRO-3, ``zero-offload train --model`` at stage 3) with
``offload_param`` builds the model straight into host memory: at one rank the whole 16-bit model
never has to fit the device, which is what ``offload_param`` is for. ``"nvme"`` chunks stay in
host memory until ``initialize`` moves the param shard to its swap file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REMOTE_DEVICES = (None, "cpu", "cuda", "none", "nvme")
HOST_REMOTES = ("cpu", "nvme")  # chunks in host memory (pinned when asked and CUDA runs)


@dataclass(frozen=True)
class InitPlacement:
    """``remote_device``: DeepSpeed's ``Init.remote_device`` ("cpu", "nvme", or the device's
    type when the chunks stay on the device); ``shard_device``: where the chunks are allocated;
    ``pin``: page-locked host chunks (only with a host remote device)."""

    remote_device: str
    shard_device: torch.device
    pin: bool


def resolve(
    remote_device: str | None, pin_memory: bool, offload_param, device: torch.device
) -> InitPlacement:
    """``offload_param``: the config's ``zero_optimization.offload_param`` section or None;
    ``device``: the accelerator the engine runs on (``dist.default_device()``)."""
    if remote_device is None and offload_param is not None:
        configured = str(getattr(offload_param.device, "value", offload_param.device))
        if configured != "none":
            remote_device, pin_memory = configured, bool(offload_param.pin_memory)
    if remote_device in HOST_REMOTES:
        return InitPlacement(remote_device, torch.device("cpu"), bool(pin_memory))
    return InitPlacement(device.type, device, False)
