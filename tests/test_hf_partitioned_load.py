"""Loading a Hugging Face folder as each rank holds it (issue: host memory that scales with the
model): at stage 3 straight into the partitions, reading only this rank's rows of each weight;
at stages 0-2 in the training dtype. Logits after loading equal a plain ``from_pretrained``,
to the bit in fp32."""

from __future__ import annotations

import weakref

import pytest
import torch
from hf_models import tiny_model

from zero_offload.core import partitioned

transformers = pytest.importorskip("transformers")

STAGE3 = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def _save(kind: str, folder, dtype=torch.float32) -> None:
    model = tiny_model(kind).to(dtype)
    model.save_pretrained(str(folder), max_shard_size="20KB")  # several shards


def _logits_after_partitioned_load(kind: str, folder: str) -> torch.Tensor:
    import zero_offload
    from zero_offload.hf import load_causal_lm

    model = load_causal_lm(folder, torch.float32, STAGE3)
    params = list(model.parameters())
    assert all(
        p.numel() == 0 and partitioned.init_shard(p) is not None for p in params
    )  # never whole
    engine, *_ = zero_offload.initialize(model=model, config=STAGE3)
    ids = torch.arange(12).reshape(2, 6) % 256
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    engine.destroy()
    return logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # gpt2: tied head, absent from the files
@pytest.mark.parametrize("world", [1, 2])
def test_stage3_load_streams_into_partitions(tmp_path, kind, world):
    from distributed import run_ranks

    _save(kind, tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ids = torch.arange(12).reshape(2, 6) % 256
    with torch.no_grad():
        want = plain(input_ids=ids).logits
    if world == 1:
        got = _logits_after_partitioned_load(kind, str(tmp_path))
    else:
        got = run_ranks(2, _logits_after_partitioned_load, kind, str(tmp_path))
    assert torch.equal(got, want)


def test_stages_0_to_2_load_in_the_training_dtype(tmp_path):
    from zero_offload.hf import load_causal_lm

    _save("llama", tmp_path)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    model = load_causal_lm(str(tmp_path), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), n


class _Rows:
    """A safetensors slice stand-in that records which rows were read."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.reads = t, []

    def get_shape(self):
        return list(self.t.shape)

    def __getitem__(self, key):
        self.reads.append((key.start, key.stop))
        return self.t[key]


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 2), (1, 9)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_reads_only_the_rows_of_its_chunk(shape, world):
    from zero_offload.hf.partitioned_load import _chunk
    from zero_offload.runtime.stage3.init_partition import InitShard

    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    flat = full.reshape(-1)
    row = flat.numel() // shape[0] if len(shape) > 1 else 1
    for rank in range(world):
        spec = InitShard(flat.numel(), shape, world, rank)
        view = _Rows(full)
        assert torch.equal(_chunk(view, spec), flat[spec.lo : spec.hi])
        for start, stop in view.reads:  # the rows read hold the chunk and at most a row more
            assert (stop - start) * row <= (spec.hi - spec.lo) + 2 * row


class _LiveParams:
    """Every param registered on a module while installed, and the most elements they held at
    once (materialized, not on the meta device), measured at each registration: a model built
    whole holds all of them by its last registration; one partitioned while it is built holds
    about one module's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref] = []
        self.peak = 0
        real = torch.nn.Module.register_parameter

        def register(module, name, param):
            real(module, name, param)
            if param is not None and param.device.type != "meta":  # a meta probe holds nothing
                self.refs.append(weakref.ref(param))
            alive = [r() for r in self.refs]
            with torch._C.DisableTorchFunction():  # the storage held, not zero.Init's shape
                held = sum(p.numel() for p in alive if p is not None and p.device.type != "meta")
            self.peak = max(self.peak, held)

        monkeypatch.setattr(torch.nn.Module, "register_parameter", register)


def test_train_model_at_stage3_never_builds_the_whole_model(tmp_path, monkeypatch):
    """The CLI's load: the model is partitioned while it is being built (watched as it is built,
    not only in the finished model)."""
    import zero_offload.hf.model as hf_model

    _save("llama", tmp_path / "m")
    seen = []
    real = hf_model._load_partitioned

    def spy(*args):
        model = real(*args)
        seen.append(all(p.numel() == 0 for p in model.parameters()))
        return model

    monkeypatch.setattr(hf_model, "_load_partitioned", spy)
    from zero_offload.cli.train.hf import _load_plan

    dtype, zero3 = _load_plan(STAGE3)
    assert dtype == torch.float32 and zero3 is STAGE3
    live = _LiveParams(monkeypatch)
    model = hf_model.load_causal_lm(str(tmp_path / "m"), dtype, zero3)
    assert seen == [True]
    total = sum(p.ds_numel for p in model.parameters())
    largest_module = max(
        sum(p.ds_numel for p in m.parameters(recurse=False)) for m in model.modules()
    )
    assert len(live.refs) == len(list(model.parameters()))  # every param was watched
    assert 0 < live.peak <= largest_module < total / 4, (live.peak, largest_module, total)
