"""Issue 31, item 5: stage-3 ranks that run different modules (data-dependent control flow)
after the first step, or a ``GatheredParameters`` block only rank 0 enters while rank 1 keeps
training. Before: same-sized gathers paired different params silently, different sizes aborted
a rank (gloo SIGABRT), and the rank that followed the recorded order failed with a generic
``CollectiveError``. Now every rank ends with an error naming the params or the block, within
the collective timeout, and exits normally."""

from __future__ import annotations

import os
import time

import pytest
import torch
from distributed import _free_port
from parity import engine_config

TIMEOUT = 4  # seconds: the collective timeout of these runs


class Routed(torch.nn.Module):
    """Rank 1 takes another route from step 1 on (the first step is the same on both)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.case = case
        self.left = torch.nn.Linear(8, 8)
        self.right = torch.nn.Linear(8, 8)
        self.wide = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 8))
        self.route = 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.route and self.case == "same_size":
            h = self.right(x)  # instead of left: same sizes
        elif self.route and self.case == "other_size":
            h = self.wide(x)  # instead of left: other sizes
        else:
            h = self.left(x)
        if self.route and self.case == "extra_module":
            h = self.right(h)  # one more module
        return (h - y).square().mean()


def _rank(rank: int, port: int, case: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    import zero_offload
    from zero_offload import zero

    try:
        zero_offload.init_distributed(timeout=TIMEOUT)
        model = Routed(case)
        cfg = engine_config(3, False, 1, 2, 0.0, overlap=False,
                            zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
        engine, *_ = zero_offload.initialize(model=model, config=cfg)
        assert all(p.numel() == 0 for p in model.parameters())  # partitioned
        x = torch.randn(2, 8)
        for step in range(3):
            if case == "block_on_rank0" and step == 1 and rank == 0:
                with zero.GatheredParameters(model.left.weight):
                    pass
            model.route = rank if step >= 1 and case != "block_on_rank0" else 0
            engine.backward(engine(x, x))
            engine.step()
        queue.put((rank, "no error"))
    except Exception as e:  # noqa: BLE001 - the message is the result
        queue.put((rank, f"{type(e).__name__}: {e}"))
    os._exit(0)  # the peer failed: no orderly teardown to wait for


def _both_ranks(case: str) -> tuple[dict[int, str], list[int | None], float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, case, queue)) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)  # a hang guard only
    took = time.monotonic() - t0
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    got = {}
    while not queue.empty():
        r, msg = queue.get()
        got[r] = msg
    return got, [p.exitcode for p in procs], took


@pytest.mark.parametrize(
    ("case", "names"),
    [
        ("same_size", ("left.weight", "right.weight")),
        pytest.param("other_size", ("left.weight", "wide.0.weight"), marks=pytest.mark.slow),
        ("extra_module", ("right.weight",)),  # rank 0's next collective is not a gather
        pytest.param(
            "block_on_rank0", ("left.weight", "GatheredParameters block 1"), marks=pytest.mark.slow
        ),
    ],
)
def test_every_rank_names_the_divergence_and_exits(case, names):
    got, codes, took = _both_ranks(case)
    assert codes == [0, 0], (codes, got)  # no SIGABRT, no hang
    for rank in (0, 1):
        msg = got.get(rank, "no answer")
        assert msg.startswith(("RankMismatchError", "CollectiveError")), (rank, msg)
        for name in names:
            assert name in msg, (rank, name, msg)
    assert took < 60, took  # about one collective timeout after start-up, not 30 minutes
