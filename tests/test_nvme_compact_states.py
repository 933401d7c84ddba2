"""Compact optimizer states on NVMe (``offload_optimizer`` "nvme", ``nvme/optimizer_state.py``):
DeepSpeed's bf16 master + bf16 moments and ``AdamW8bit`` with a bf16 master, each record's
regions in the format's types (``nvme/record_layout.py``).

Checked: the streamed state equals the in-memory ``CompactState`` bitwise over many chunks
(the same kernel, fp32 reads/writes, 8-bit codes and scales); an engine with the state on NVMe
trains bitwise equal to the same format on "cpu" at stages 2 and 3; the swap file shrinks to
the format's padded records (two versions each) and the memory report agrees with the
estimate; save/resume is bitwise; a read error mid-step rolls back with the format."""

from __future__ import annotations

import copy
import errno
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parity import SEQ, VOCAB, batches, engine_config, global_step, with_states
from test_nvme_offload import _Failing

from zero_offload.core.state.compact_state import CompactState
from zero_offload.core.state.format import StateFormat
from zero_offload.core.state.shard_state import KINDS
from zero_offload.kernels.adam_states import adam_step_states
from zero_offload.nvme.errors import NvmeSwapError
from zero_offload.nvme.io.aio import AioEngine, AioPolicy
from zero_offload.nvme.optimizer_state import NvmeOptimizerState
from zero_offload.runtime.update import state_build

pytestmark = pytest.mark.usefixtures("one_rank")

BF16 = StateFormat(master=torch.bfloat16, moments="bf16")
EIGHT = StateFormat(master=torch.bfloat16, moments="8bit")
CHUNK = 2048  # sub_group_size: the engine's model spans several records
MICRO = 2


def _pad(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _record(fmt: StateFormat, chunk: int) -> int:
    """The record as the layout promises it, written out: each region padded to 4096 bytes."""
    if fmt.moments == "8bit":
        moment = _pad(chunk + -(-chunk // fmt.block) * 4)  # codes, then fp32 scales
    else:
        moment = _pad(chunk * (2 if fmt.moments == "bf16" else 4))
    return _pad(chunk * fmt.master_bytes) + 2 * moment


# ---- the streamed state against the in-memory one ----------------------------------------------
@pytest.mark.parametrize(
    "fmt", [BF16, EIGHT, StateFormat(moments="8bit", block=64)], ids=lambda f: f.name
)
def test_streamed_compact_state_equals_memory(tmp_path, fmt):
    numel, chunk = 4 * 2048 + 777, 2048  # a short last chunk: a partial 8-bit block
    nv = NvmeOptimizerState(tmp_path, "g", numel, chunk, 3, AioEngine(AioPolicy()), False, fmt)
    mem = CompactState(numel, torch.device("cpu"), "host", fmt)
    assert nv.master_dtype == fmt.master
    assert nv.file.path.stat().st_size == 2 * 5 * _record(fmt, chunk)
    init = torch.randn(numel)
    for s in (nv, mem):
        s.fill(lambda lo, hi, out: out.copy_(init[lo:hi]))
    chunks = [(lo, min(lo + chunk, numel)) for lo in range(0, numel, chunk)]
    for step in range(1, 4):
        g = torch.randn(numel)

        def body(lo, hi, v, g=g, step=step):
            adam_step_states(v["master"], v["exp_avg"], v["exp_avg_sq"], g[lo:hi], None,
                             step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                             weight_decay=0.01, adamw=True)  # fmt: skip

        nv.update(chunks, body)
        mem.update(chunks, body)
    for kind in KINDS:
        assert torch.equal(nv.read(kind, 0, numel), mem.read(kind, 0, numel)), kind
        assert torch.equal(nv.read(kind, 1000, 5000), mem.read(kind, 1000, 5000)), kind
    # fp32 writes across chunks and into partial blocks (8-bit: the touched blocks re-encoded)
    for kind, at, n in (("master", 1500, 3000), ("exp_avg", 2000, 100), ("exp_avg_sq", 8100, 300)):
        piece = torch.rand(n)
        nv.write(kind, at, piece)
        mem.write(kind, at, piece)
        assert torch.equal(nv.read(kind, 0, numel), mem.read(kind, 0, numel)), kind
    raw = mem.raw()
    assert nv.raw().keys() == raw.keys() and ("exp_avg.codes" in raw) is (fmt.moments == "8bit")
    assert all(torch.equal(t, raw[name]) for name, t in nv.raw().items())
    # load_raw: the stored tensors back bitwise into another state's records
    other = NvmeOptimizerState(tmp_path, "h", numel, chunk, 2, AioEngine(AioPolicy()), False, fmt)
    other.fill(lambda lo, hi, out: out.zero_())
    other.load_raw(raw.get)
    for name, t in other.raw().items():
        assert torch.equal(t, raw[name]), name
    assert nv.nbytes()["nvme.optimizer_state"] == mem.nbytes()["host.optimizer_state"]
    assert nv.nbytes()["nvme.master_shard"] == mem.nbytes()["host.master_shard"]
    nv.close()
    other.close()


# ---- engines ----------------------------------------------------------------------------------
class Wide(torch.nn.Module):
    """About 16k trainable params: several 2048-element records per rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 64)
        self.l1 = torch.nn.Linear(64, 96)
        self.l2 = torch.nn.Linear(96, 64)
        self.head = torch.nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l2(torch.tanh(self.l1(self.emb(x))))
        return F.cross_entropy(self.head(h).float().reshape(-1, VOCAB), y.reshape(-1))


def _config(stage: int, states: str, offload: str, path: Path) -> dict:
    path.mkdir(parents=True, exist_ok=True)
    cfg = engine_config(stage, offload, 1, MICRO, 0.05, False, "bf16", nvme_path=str(path),
                        zero_extra={"stage3_param_persistence_threshold": 0,
                                    "sub_group_size": CHUNK})  # fmt: skip
    return with_states(cfg, states)


def _engine(cfg: dict):
    import zero_offload

    model = Wide()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    return engine


def _train(engine, steps: range, seed: int = 1) -> list[float]:
    data = batches(max(steps) + 1, 1, 1, MICRO, seed)
    assert data[0][0].shape[1] == SEQ
    return [global_step(engine, *data[i]) for i in steps]


def _state(engine, kind: str = "master") -> torch.Tensor:
    return torch.cat([
        og.optimizer.state.read(kind, 0, og.optimizer.state.numel) for og in engine.opt_groups
    ])  # fmt: skip


def _all_state(engine) -> dict[str, torch.Tensor]:
    out = {k: _state(engine, k) for k in KINDS}
    for og in engine.opt_groups:
        out.update({f"{og.index}.{n}": t for n, t in og.optimizer.state.raw().items()})
    return out


def _params(engine) -> torch.Tensor:
    """The 16-bit params in the master's order (this rank's pieces)."""
    return torch.cat([so.home.read(0, so.state.numel).float().cpu()
                      for so in (og.optimizer for og in engine.opt_groups)])  # fmt: skip


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_nvme_trains_bitwise_as_cpu_and_the_file_shrinks(tmp_path, stage, states):
    fmt = BF16 if states == "bf16" else EIGHT
    host = _engine(_config(stage, states, "cpu", tmp_path / "swap"))
    want = _train(host, range(4))
    nvme = _engine(_config(stage, states, "nvme", tmp_path / "swap"))
    state = nvme.opt_groups[0].optimizer.state
    assert isinstance(state, NvmeOptimizerState) and state.master_dtype == torch.bfloat16
    assert state.nchunks > 2, "the model spans several records"
    # the same kernel on the same values: NVMe changes where the state lives, not a bit
    assert _train(nvme, range(4)) == want
    mine, theirs = _all_state(nvme), _all_state(host)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs), states
    assert torch.equal(_params(nvme), _params(host))
    # the drive's bytes: two versions of the format's padded record per chunk
    for og in nvme.opt_groups:
        s = og.optimizer.state
        assert s.file.path.stat().st_size == 2 * s.nchunks * _record(fmt, s.chunk)
        assert s.file.path.stat().st_size * 2 <= 2 * s.nchunks * s.chunk * 12  # fp32's record
    # the preflight's room check asks for exactly those bytes (not fp32's)
    flats = [og.flat for og in nvme.opt_groups]
    (need,) = state_build._needs(nvme.placement, flats, None, True, None)
    assert need.nbytes == sum(og.optimizer.state.file.path.stat().st_size for og in nvme.opt_groups)
    report, expected = nvme.memory_report(), nvme.expected_memory()
    cpu = host.memory_report()
    for key in ("master_shard", "optimizer_state"):
        assert report[f"nvme.{key}"] == cpu[f"host.{key}"], key
    for key in ("nvme.master_shard", "nvme.optimizer_state", "nvme.second_version"):
        assert report[key] == expected[key], key
    if torch.cuda.is_available():  # pinned records: as the allocator holds them, rounded up
        assert report["host.nvme_buffers"] >= expected["host.nvme_buffers"]
    else:
        assert report["host.nvme_buffers"] == expected["host.nvme_buffers"]
    host.destroy()
    nvme.destroy()


@pytest.mark.parametrize("states", ["bf16", "8bit"])
def test_resume_on_nvme_is_bitwise(tmp_path, states):
    cfg = _config(2, states, "nvme", tmp_path / "swap")
    engine = _engine(cfg)
    _train(engine, range(3))
    engine.save_checkpoint(str(tmp_path / "ck"), tag="t")
    after = _train(engine, range(3), seed=7)
    want = _all_state(engine)
    engine.destroy()
    for offload in ("nvme", "cpu"):  # back onto NVMe, and across to host memory
        again = _engine(_config(2, states, offload, tmp_path / "swap"))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the same format: no conversion
            again.load_checkpoint(str(tmp_path / "ck"), tag="t")
        assert _train(again, range(3), seed=7) == after, offload
        got = _all_state(again)
        assert all(torch.equal(got[k], want[k]) for k in want), offload
        again.destroy()


def test_read_error_mid_step_rolls_back_eight_bit(tmp_path, monkeypatch):
    engine = _engine(_config(2, "8bit", "nvme", tmp_path / "swap"))
    _train(engine, range(2))
    before, params = _all_state(engine), _params(engine)
    steps = engine.opt_groups[0].optimizer.step_count
    real, calls = engine.aio.read, {"n": 0}

    def flaky(f, offset, buf):  # the third record's read of the step fails
        calls["n"] += 1
        return _Failing(errno.EIO) if calls["n"] == 3 else real(f, offset, buf)

    monkeypatch.setattr(engine.aio, "read", flaky)
    state = engine.opt_groups[0].optimizer.state
    with pytest.raises(NvmeSwapError, match="read of optimizer-state chunk"):
        _train(engine, range(2, 3))
    monkeypatch.undo()
    assert calls["n"] >= 3 and str(state.file.path)
    after = _all_state(engine)
    assert all(torch.equal(after[k], before[k]) for k in before), "a failed step was committed"
    assert torch.equal(_params(engine), params)
    assert engine.opt_groups[0].optimizer.step_count == steps
    # and the retry trains as a run that never failed
    clean = _engine(_config(2, "8bit", "nvme", tmp_path / "clean"))
    assert _train(clean, range(3))[2:] == _train(engine, range(2, 3))
    assert torch.equal(_state(clean), _state(engine))
    clean.destroy()
    engine.destroy()


def test_params_on_nvme_are_counted_on_the_drive(tmp_path):
    """Stage 3 with both offloads "nvme": the 16-bit param shard lives in the param swapper's
    file, and ``expected_memory`` names it there as ``memory_report`` does (not on the host)."""
    cfg = _config(3, "8bit", "nvme", tmp_path / "swap")
    cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(tmp_path)}
    engine = _engine(cfg)
    _train(engine, range(2))
    # stage 3 with persistence threshold 0: every param partitioned (empty outside a gather)
    assert all(p.numel() == 0 for p in engine.module.parameters())
    report, expected = engine.memory_report(), engine.expected_memory()
    assert report["nvme.param_shard"] > 0
    assert "host.param_shard" not in report and "host.param_shard" not in expected
    for key in ("nvme.param_shard", "nvme.master_shard", "nvme.optimizer_state", "host.grad_shard"):
        assert report[key] == expected[key], key
    engine.destroy()
