"""``deepspeed.runtime.zero.offload_states``: ``get_state_devices``, which DeepSpeed's tests and
RLHF code use to check where a state lives after ``engine.offload_states()``."""

from __future__ import annotations

import torch

from ....runtime.offload_states.offload_states import state_buffers
from ....runtime.update.buffers import OffloadStateType
from ..._common import not_provided_getattr


def get_state_devices(model, state: OffloadStateType) -> set[torch.device]:
    """The devices holding ``state`` of the engine ``model``: the host while it is offloaded
    (nothing for the reduce buffers, which are dropped, as DeepSpeed's), the device for what is
    there, and the host for what ``offload_optimizer`` keeps in host memory (a partial offload:
    both)."""
    state = OffloadStateType(state)
    if state in model.offloaded_states():
        if state is OffloadStateType.contiguous_grad_buffer:
            return set()
        return {torch.device("cpu")}
    devices = {b.tensor.device for b in state_buffers(model, state)}
    if state in _HOST_SIDE and model.placement.host_update:  # (the whole state or a part)
        devices.add(torch.device("cpu"))
    return devices


# The states offload_optimizer keeps in host memory: master, moments, the reduced gradients.
_HOST_SIDE = (OffloadStateType.optim_states, OffloadStateType.hp_params, OffloadStateType.lp_grads)


__all__ = ["get_state_devices"]
__getattr__ = not_provided_getattr(__name__)
