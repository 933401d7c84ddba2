"""``deepspeed.comm.all_gather_into_tensor`` (DeepSpeed's name, which its test helpers call to
agree on a flag): every rank's tensor into one, in rank order, also for a 0-d tensor on gloo."""

from __future__ import annotations

import torch
from distributed import every_rank


def _gather() -> list:
    from zero_offload.deepspeed_compat import comm

    rank = comm.get_rank()
    flag = torch.tensor(rank + 1, dtype=torch.int)  # 0-d, as DeepSpeed's reduce_boolean_flags
    flags = torch.zeros(comm.get_world_size(), dtype=torch.int)
    comm.all_gather_into_tensor(flags, flag)
    rows = torch.zeros(2, 3)
    comm.all_gather_into_tensor(rows, torch.full((3,), float(rank)))
    return [flags.tolist(), rows.tolist()]


def test_all_gather_into_tensor_two_ranks() -> None:
    for flags, rows in every_rank(2, _gather):
        assert flags == [1, 2] and rows == [[0.0] * 3, [1.0] * 3]


def test_all_gather_into_tensor_without_a_group() -> None:
    from zero_offload import comm

    out = torch.zeros(1)
    comm.all_gather_into_tensor(out, torch.tensor(5.0))
    assert out.tolist() == [5.0]
