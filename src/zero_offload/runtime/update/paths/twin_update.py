"""Partial offload (``offload_optimizer.ratio`` < 1; DeepSpeed's ZeRO-Offload++ "Twin-Flow"): one
group's update shared by the accelerator and the host CPU.

The group's shard is cut at ``Placement.host_from``: a ``DeviceUpdate`` owns the device part
``[0, cut)`` (master and moments on the accelerator, torch's fused Adam(W); a compact format's
reference arithmetic, ``device_update.py``), a ``HostUpdate`` the
host part ``[cut, numel)`` (host memory, the SIMD host kernel chunk by chunk). Their state is one
``TwinState``, so checkpoints and accessors see the whole shard.

Order of a step (CUDA): the device part's kernels are queued first and run while the host
computes its chunks (the host part's uploads wait for the compute stream, as every upload does);
then the device part's 16-bit values go to the param home (with a host home, a copy that waits
for those kernels, so it comes last); then the whole home is published once. Gradient clipping,
the overflow check and the norm are the grad shard's, computed on the device over both parts
before either update runs.
"""

from __future__ import annotations

import torch

from ....core.flat_group import FlatGroup
from ....core.state.twin_state import TwinState
from ....core.streams import Streams
from ...reduce.grad_shard import GradShard
from ..param_home import ParamHome
from ..part import Span
from ..shard_optimizer import ShardOptimizer, UpdatePolicy
from .device_update import DeviceUpdate
from .host_update import HostUpdate


class TwinUpdate(ShardOptimizer):
    def __init__(
        self,
        group: FlatGroup,
        grads: GradShard,
        home: ParamHome,
        state: TwinState,
        policy: UpdatePolicy,
        streams: Streams,
        client: torch.optim.Optimizer | None = None,
    ) -> None:
        """``state``: the twin's parts, still empty; each part's update fills its own from the
        home. A client optimizer, Muon and the delayed update are refused by the config."""
        assert client is None, "the twin update is Adam(W), synchronous"
        cut, numel = state.cut, state.numel
        assert cut == grads.host_from, "the grad shard's cut is the state's"
        args = (group, grads, home)
        self.device_part = DeviceUpdate(*args, state.device, policy, streams, span=Span(0, cut))
        self.host_part = HostUpdate(*args, state.host, policy, streams, span=Span(cut, numel))
        super().__init__(group, grads, home, state, policy, streams)
        # Each part's chunks in shard coordinates: none crosses the cut (TwinState's rule).
        self.chunks = [(lo, hi) for lo, hi in self.device_part.chunks] + [
            (cut + lo, cut + hi) for lo, hi in self.host_part.chunks
        ]

    @property
    def step_count(self) -> int:
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        """One count for both parts (their bias corrections are the step's)."""
        self._step_count = value
        self.device_part.step_count = self.host_part.step_count = value

    @property
    def master(self) -> torch.Tensor:
        raise AttributeError("a twin's master is in two parts: read it through state.read")

    def adam(self, factor: float, commit: bool = True) -> None:
        self.device_part.compute(factor)  # queued: runs beside the host pass on CUDA
        self.host_part.adam(factor)
        self.device_part.write_home()

    def nbytes(self) -> dict[str, int]:
        out = self.device_part.nbytes()
        for k, v in self.host_part.nbytes().items():
            out[k] = out.get(k, 0) + v
        return out
