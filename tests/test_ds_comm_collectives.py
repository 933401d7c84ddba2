"""``deepspeed.comm``'s further collectives (DeepSpeed's names and argument orders) equal
torch.distributed's results on two gloo ranks."""

from __future__ import annotations

import torch
from distributed import every_rank


def _collectives() -> dict:
    from zero_offload.deepspeed_compat import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    mine = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    gathered = torch.zeros(world * 2)
    comm.all_gather_into_tensor(gathered, mine)
    scattered = torch.zeros(1)
    comm.reduce_scatter_tensor(scattered, torch.arange(world, dtype=torch.float) + rank)
    reduced = mine.clone()
    comm.reduce(reduced, dst=0)
    objects = [None] * world
    comm.all_gather_object(objects, {"rank": rank})
    sent = [f"from {rank}"]
    comm.broadcast_object_list(sent, src=1)
    group = comm.new_group([0, 1])
    comm.all_reduce(grouped := mine.clone(), group=group)
    return {
        "gathered": gathered,
        "scattered": scattered,
        "reduced": reduced if rank == 0 else None,
        "objects": objects,
        "sent": sent,
        "grouped": grouped,
        "world_group": comm.get_world_group() is torch.distributed.group.WORLD,
        "probes": comm.has_all_gather_into_tensor() and comm.has_reduce_scatter_tensor(),
    }


def test_collectives_on_two_ranks() -> None:
    results = every_rank(2, _collectives)
    for rank, got in enumerate(results):
        assert torch.equal(got["gathered"], torch.tensor([1.0, 10.0, 2.0, 20.0]))
        # sum over ranks of (arange(2) + rank) = [1, 3]; rank r keeps element r
        assert got["scattered"].item() == [1.0, 3.0][rank]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]
        assert got["sent"] == ["from 1"]
        assert torch.equal(got["grouped"], torch.tensor([3.0, 30.0]))
        assert got["world_group"] and got["probes"]
    assert torch.equal(results[0]["reduced"], torch.tensor([3.0, 30.0]))
