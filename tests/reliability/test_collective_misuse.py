"""Issue: collective misuse at stage 3. Ranks that run different modules are refused before
the first gather that differs, naming its params (before, same-sized gathers paired different
params silently); a ``GatheredParameters`` block only some ranks enter fails at the timeout
naming the params it was fetching (before, a bare gloo error)."""

from __future__ import annotations

import os
import time

import torch
from distributed import answer_of, run_ranks, short_timeout_after_start_up
from parity import engine_config


class Branches(torch.nn.Module):
    """Two same-shaped branches; each rank runs its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.left = torch.nn.Linear(8, 8)
        self.right = torch.nn.Linear(8, 8)
        self.branch = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = (self.left if self.branch == 0 else self.right)(x)
        return (h - y).square().mean()


def _different_modules() -> str:
    import zero_offload

    model = Branches()
    cfg = engine_config(3, False, 1, 2, 0.0, overlap=False,
                        zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    model.branch = zero_offload.comm.get_rank()
    x = torch.randn(2, 8)
    try:
        engine.backward(engine(x, x))
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_ranks_running_different_modules_are_refused_by_name():
    msg = run_ranks(2, _different_modules)
    assert msg.startswith("RankMismatchError: ranks gather different stage-3 params at"), msg
    assert "left.weight" in msg and "right.weight" in msg and "set_z3_leaf_modules" in msg


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    import zero_offload
    from zero_offload import zero

    try:
        zero_offload.init_distributed(timeout=600)  # start-up: no race with a slow peer
        model = Branches()
        cfg = engine_config(3, False, 1, 2, 0.0, overlap=False,
                            zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
        zero_offload.initialize(model=model, config=cfg)
        short_timeout_after_start_up(5)  # the gather alone is timed
        if rank == 0:  # rank 1 never enters the block
            with zero.GatheredParameters(model.left.weight):
                pass
            queue.put((rank, "gathered alone"))
        else:
            time.sleep(3600)
    except Exception as e:  # noqa: BLE001 - the message is the result
        queue.put((rank, f"{type(e).__name__}: {e}"))
    os._exit(0)


def test_a_gather_only_one_rank_enters_names_its_params():
    msg = answer_of(2, _rank)  # refused before the gather (the peer never reached the block)
    assert msg.startswith("RankMismatchError: rank 0: at GatheredParameters block 1"), msg
    assert "left.weight" in msg and "did not reach that point" in msg, msg
