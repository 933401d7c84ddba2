"""A Muon group's update with its state in host memory (``offload_optimizer`` "cpu", stages
1-2): the master shard and the momentum live on the host as Adam's state does, Muon's steps
(``muon_update.py``) read the host grad shard, and only the look-ahead's and the
orthogonalized update's slices of this rank cross the bus (4 bytes per element each way);
Newton-Schulz runs on the device over each whole matrix (on the CPU when the device is one).
The updated master reaches the param home as the host update's does: cast into the 16-bit
staging buffer, uploaded chunk by chunk, all-gathered per bucket.

The delayed update is not built for Muon (the all-gather of step 2 is a collective the worker
thread would issue behind the next forward's): the config refuses it by key, and ``launch``
says so if reached.
"""

from __future__ import annotations

from ..paths.host_update import HostUpdate
from .muon_update import MuonSteps


class HostMuonUpdate(MuonSteps, HostUpdate):
    def _apply(self, factor: float) -> None:
        self._muon_step(factor, self._views(self.grads.host_grad()), self._views(self.master))
        self._write_home()

    def launch(self, factor: float) -> None:
        raise RuntimeError(
            'optimizer "Muon" has no delayed update: its step all-gathers the look-ahead, a '
            "collective that cannot run behind the next forward"
        )
