"""ZenFlow on two ranks (stages 1 and 2, each rank on its own batches): the ranks end every step
with the same params, a checkpoint saved in the middle of an interval resumes bitwise (and
loads into a run without ZenFlow), and the estimate counts what ``memory_report()`` does per
rank. Equality with DeepSpeed's two-rank ZenFlow: ``test_zenflow_deepspeed.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from distributed import every_rank
from zenflow_run import TOPK, batches, config, make_model

import zero_offload
from zero_offload.runtime.update.buffers import OffloadStateType
from zero_offload.runtime.update.zenflow.columns import column_fragments, select_columns
from zero_offload.runtime.update.zenflow.update import ZenFlowRunner

TERMS = (
    "device.zenflow_columns",
    "device.zenflow_grad",
    "host.zenflow_accum",
    "host.zenflow_staging",
)


def _engine(zf: dict | None, stage: int):
    model = make_model()
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=config(zf, stage=stage)
    )
    return engine


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _steps(engine, data) -> list[torch.Tensor]:
    for x, y in data:
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return _params(engine)


def _checkpoint_run(path: str, zf: dict, stage: int) -> dict:
    """On each rank: a straight run of 7 steps, and one saved after 3 (mid-interval: the
    accumulator holds step 3's gradient), resumed, and loaded without ZenFlow."""
    data = batches(7, tdist.get_rank())
    engine = _engine(zf, stage)
    built = isinstance(engine.opt_groups[0].optimizer.runner, ZenFlowRunner)
    straight = _steps(engine, data)
    first = _engine(zf, stage)
    saved = _steps(first, data[:3])
    first.save_checkpoint(path, tag="mid")
    resumed = _engine(zf, stage)
    resumed.load_checkpoint(path, tag="mid")
    loaded = _params(resumed)
    after = _steps(resumed, data[3:])
    plain = _engine(None, stage)  # a run without ZenFlow loads the master
    plain.load_checkpoint(path, tag="mid")
    plain_loaded = _params(plain)
    _steps(plain, data[3:4])
    return dict(built=built, straight=straight, saved=saved, loaded=loaded, after=after,
                plain=plain_loaded)  # fmt: skip


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


@pytest.mark.parametrize("stage, overlap", [(2, False), (1, True)])
def test_two_ranks_checkpoint_mid_interval_resumes_bitwise(tmp_path, stage, overlap):
    zf = {**TOPK, "select_interval": 4, "overlap_step": overlap}
    ranks = every_rank(2, _checkpoint_run, str(tmp_path), zf, stage)
    for got in ranks:
        assert got["built"]
        assert _diff(got["loaded"], got["saved"]) == 0.0
        assert _diff(got["after"], got["straight"]) == 0.0
        if overlap:  # the master already holds the update the params get one interval later
            assert _diff(got["plain"], got["saved"]) > 1e-4
        else:
            assert _diff(got["plain"], got["saved"]) == 0.0
    assert _diff(ranks[0]["straight"], ranks[1]["straight"]) == 0.0  # the ranks agree


def _memory(stage: int) -> tuple[dict, dict, dict]:
    from test_zenflow_memory import SHAPE, _train

    from zero_offload.models.gpt2 import GPT2Model

    torch.manual_seed(0)
    model = GPT2Model(SHAPE)
    cfg = config({**TOPK, "overlap_step": True}, stage=stage)
    engine, *_ = zero_offload.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    _train(engine, 2)
    predicted = engine.expected_memory(seq_length=SHAPE.seq_length, micro_batch=2)
    out = engine.memory_report(), engine.expected_memory(), predicted
    # the gathered gradient is scratch: offload_states(lp_grads) frees it, a step refills it
    engine.offload_states(include=[OffloadStateType.lp_grads])
    assert engine.memory_report()["device.zenflow_grad"] == 0
    engine.reload_states()
    _train(engine, 1)
    return out


def test_two_ranks_estimate_equals_memory_report():
    """Per rank: the columns of each DeepSpeed fragment, the gathered gradient, the shard's
    accumulators; from the engine's params and from the model's shape."""
    for have, states, predicted in every_rank(2, _memory, 2):
        for k in (*TERMS, "host.zenflow_overlap"):
            assert have[k] > 0, k
            assert states[k] == have[k], (k, states[k], have[k])
            assert predicted[k] == have[k], (k, predicted[k], have[k])


def _save_one_rank(path: str, zf: dict) -> None:
    engine = _engine(zf, 2)
    _steps(engine, batches(3))  # mid-interval
    engine.save_checkpoint(path, tag="one")


def _resume(path: str, zf: dict) -> tuple[int, list[torch.Tensor]]:
    engine = _engine(zf, 2)
    engine.load_checkpoint(path, tag="one")
    micro = engine.opt_groups[0].optimizer.runner.micro
    return micro, _steps(engine, batches(3, tdist.get_rank()))


@pytest.mark.parametrize("overlap", [False, True])
def test_two_ranks_resume_one_rank_checkpoint_afresh_alike(tmp_path, overlap):
    """A ZenFlow checkpoint of one rank resumed on two: the shards differ, so every rank starts
    ZenFlow afresh (never one rank resuming its schedule while the other starts over)."""
    zf = {**TOPK, "select_interval": 4, "overlap_step": overlap}
    every_rank(1, _save_one_rank, str(tmp_path), zf)
    ranks = every_rank(2, _resume, str(tmp_path), zf)
    assert [micro for micro, _ in ranks] == [0, 0]  # afresh on both
    assert _diff(ranks[0][1], ranks[1][1]) == 0.0


def test_column_fragments_cut_as_deepspeed_partitions():
    """The tiny MLP without biases (368 elements, registration order) on two ranks: cut at 184,
    20 elements into the second Linear's column 4 (12 rows); padded to a multiple of 2 * N."""
    shapes = [(16, 8), (12, 16), (4, 12)]
    assert column_fragments(shapes, 1) == [[(0, 8)], [(0, 16)], [(0, 12)]]
    assert column_fragments(shapes, 2) == [[(0, 8)], [(0, 4), (5, 16)], [(0, 12)]]
    # 10 elements, padded to 12 on three ranks (4 each): the (5, 2) param's second column is
    # cut at 4 and 8; a fragment inside one column has no candidates
    assert column_fragments([(5, 2)], 3) == [[(0, 0), (1, 1), (2, 2)]]
    # after a 1-D param: cut at 6, the (2, 4) param's element 3, inside its column 1
    assert column_fragments([(3,), (2, 4)], 2) == [[], [(0, 1), (2, 4)]]
    g = torch.arange(12 * 16, dtype=torch.float32).view(16, 12).t()  # column c larger with c
    assert select_columns(g, 0.25, [(0, 4), (5, 16)]).tolist() == [3, 14, 15]


def test_rank_pieces_add_up_to_the_whole_gradient():
    """``RankGrads`` on two ranks' shards (pieces cut inside rows, whole rows between), each
    filling in only its own elements: the two halves, added as the all-reduce adds them, are the
    one-rank answers: the selected columns' and the 1-D params' gradient exactly, the column and
    |g| sums to rounding. Only those sizes exist on the device, never the whole gradient."""
    from zero_offload.runtime.update.zenflow.step_grads import RankGrads, ShardGrads

    torch.manual_seed(0)
    shapes = [torch.Size((5, 7)), torch.Size((6,)), torch.Size((4, 9))]
    numels = [s.numel() for s in shapes]
    ranges, at = [], 0
    for n in numels:
        ranges.append((at, at + n))
        at += n
    flat = torch.randn(at)
    cuts = {0: 12, 1: 3, 2: 17}  # per param: rank 0 holds [0, cut), rank 1 the rest
    pieces = [[], []]
    shards = [[], []]
    for i, (lo, hi) in enumerate(ranges):
        c = cuts[i]
        for r, (a, b) in enumerate(((0, c), (c, hi - lo))):
            pieces[r].append([(a, sum(len(x) for x in shards[r]), b - a)])
            shards[r].append(flat[lo + a : lo + b])
    columns = [torch.tensor([1, 4, 6]), None, torch.tensor([0, 8])]
    counts = [3, 0, 2]
    one = ShardGrads(ranges, shapes)
    one.bind(flat)
    halves = []
    for r in range(2):
        g = RankGrads(pieces[r], shapes, counts, torch.float32, torch.device("cpu"))
        g.bind(torch.cat(shards[r]))
        sums = g.column_sums()
        halves.append(([p.clone() for p in g.parts(columns)], [None if s is None else s.clone() for s in sums],
                       g.abs_sums([torch.float32] * 3)))  # fmt: skip
        assert g.nbytes() == 4 * (5 * 3 + 6 + 4 * 2 + 7 + 9)
    for want, a, b in zip(one.parts(columns), halves[0][0], halves[1][0]):
        assert torch.equal(a + b, want)
    for want, a, b in zip(one.column_sums(), halves[0][1], halves[1][1]):
        assert (want is None) == (a is None)
        if want is not None:
            torch.testing.assert_close(a + b, want)
    for want, a, b in zip(one.abs_sums([torch.float32] * 3), halves[0][2], halves[1][2]):
        if want is not None:
            torch.testing.assert_close(a + b, want)
