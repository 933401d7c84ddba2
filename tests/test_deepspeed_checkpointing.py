"""DeepSpeed's activation checkpointing API (``deepspeed.checkpointing``, here
``zero_offload.activation_checkpointing``) and the ``activation_checkpointing`` section.

The one script (``checkpointing_script.py``: checkpointed layers whose dropout draws from the
default generator and from the model-parallel tracker) gives the same losses and gradients
without any checkpoint, with torch.utils.checkpoint (where torch can be right: no tracker), with
this project's ``checkpoint`` and ``non_reentrant_checkpoint`` (``cpu_checkpointing`` on and
off), and with DeepSpeed 0.19.8's own on the same script. The inputs a checkpoint keeps are
counted by where they wait: with ``cpu_checkpointing`` the device holds one layer's input.
DeepSpeed's own unit-test cases of inputs and outputs (masks, non-tensors, keyword tensors),
which it skips on a CPU accelerator, run here on the CPU."""

from __future__ import annotations

import importlib.machinery
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zero_offload
from zero_offload import activation_checkpointing as ac
from zero_offload.activation_checkpointing.settings import SETTINGS
from zero_offload.config import ConfigError
from zero_offload.models.gpt2 import GPT2Config, GPT2Model

sys.path.insert(0, str(Path(__file__).parent))
import checkpointing_script as script  # noqa: E402

SCRIPT = Path(__file__).parent / "checkpointing_script.py"
CPU = {"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": True}}
INPUT_BYTES = script.BATCH * script.HIDDEN * 4  # one layer's checkpointed input (fp32)


@pytest.fixture(autouse=True)
def _fresh_api():
    """The API's state is process-wide (as DeepSpeed's): each test starts unconfigured."""
    SETTINGS.__init__()
    ac.COUNTERS.__init__()
    ac.get_cuda_rng_tracker().reset()
    yield
    SETTINGS.__init__()
    ac.COUNTERS.__init__()
    ac.get_cuda_rng_tracker().reset()


def _close(a: dict, b: dict, tol: float = 1e-6) -> bool:
    if a["losses"] != pytest.approx(b["losses"], rel=tol, abs=tol):
        return False
    flat_a = [x for step in a["grads"] for t in step for x in t]
    flat_b = [x for step in b["grads"] for t in step for x in t]
    return flat_a == pytest.approx(flat_b, rel=tol, abs=tol)


def _untracked(mode: str, checkpointing=None) -> dict:
    """The script with a tracker that no layer forks (torch.utils.checkpoint's case)."""

    class Quiet:  # the API, but the layers get no tracker
        def __getattr__(self, name):
            return getattr(checkpointing or ac, name)

        def get_cuda_rng_tracker(self):
            return None

    return script.run(Quiet(), mode)


@pytest.mark.parametrize("config", [None, CPU], ids=["device", "cpu_checkpointing"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpoint_gives_the_gradients_of_no_checkpoint(mode: str, config) -> None:
    plain = script.run(ac, "plain")
    got = script.run(ac, mode, config)
    assert got["losses"] == plain["losses"]
    assert _close(got, plain, 1e-7)


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_a_host_copy_in_other_memory_gives_the_same_gradients(monkeypatch, mode: str) -> None:
    """On the CPU the host copy is the input itself; here it is a copy in other memory, as on a
    GPU, with no graph and no requires_grad of its own: the recompute must still lead the
    gradient back to the input."""
    copies = []

    def copy(t: torch.Tensor, pooled: list) -> torch.Tensor:
        copies.append(t.detach().clone())
        return copies[-1]

    monkeypatch.setattr(ac.stash, "_to_host", copy)
    got = script.run(ac, mode, CPU)
    assert len(copies) == script.LAYERS * script.STEPS
    assert _close(got, script.run(ac, "plain"), 1e-7)


def test_torch_checkpoint_agrees_where_it_can_and_the_tracker_is_what_it_misses() -> None:
    """torch.utils.checkpoint replays the default generator only: without the tracker it gives
    this project's gradients; with a tracked dropout its recompute draws another mask (so the
    comparison above would catch a tracker that is not replayed)."""
    torch_ckpt, ours = _untracked("torch"), _untracked("reentrant")
    assert _close(torch_ckpt, ours, 1e-7) and _close(ours, _untracked("plain"), 1e-7)
    assert not _close(script.run(ac, "torch"), script.run(ac, "plain"), 1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(mode: str, config: dict, as_deepspeed: str) -> dict | None:
    env = {k: v for k, v in os.environ.items() if k != "ZERO_OFFLOAD_AS_DEEPSPEED"}
    env.update(ZERO_OFFLOAD_AS_DEEPSPEED=as_deepspeed, MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode, json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    if line is None and as_deepspeed == "0":
        return None
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_the_same_script_under_deepspeed_and_under_the_namespace(mode: str) -> None:
    """DeepSpeed runs with its default settings: on a CPU accelerator its cpu_checkpointing
    empties the input before keeping it (its host copy of a CPU tensor is the tensor itself),
    so the recompute fails there; the namespace's cpu_checkpointing gives DeepSpeed's numbers."""
    if importlib.machinery.PathFinder.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    base = {"train_batch_size": 1}
    reference = _run_script(mode, base, "0")
    if reference is None:
        pytest.skip("deepspeed does not run the script here")
    ours = _run_script(mode, CPU, "1")
    assert ours["losses"] == reference["losses"]
    assert _close(ours, reference, 1e-7)
    assert _close(script.run(ac, mode, CPU), reference, 1e-7)


@pytest.mark.parametrize("cpu", [False, True])
@pytest.mark.parametrize("checkpoint", [ac.checkpoint, ac.non_reentrant_checkpoint])
def test_kept_inputs_are_counted_where_they_wait(checkpoint, cpu: bool) -> None:
    ac.configure(None, checkpoint_in_cpu=cpu)
    layers = [torch.nn.Linear(script.HIDDEN, script.HIDDEN) for _ in range(script.LAYERS)]
    x = torch.randn(script.BATCH, script.HIDDEN, requires_grad=True)
    with torch.no_grad():  # an eval forward keeps nothing
        checkpoint(layers[0], x)
    assert ac.COUNTERS.report() == {}
    h = x
    for layer in layers:
        h = checkpoint(layer, h)
    every = script.LAYERS * INPUT_BYTES
    assert ac.COUNTERS.held == {"device": 0 if cpu else every, "host": every if cpu else 0}
    h.sum().backward()
    del h  # the graph, and with it what the non-reentrant checkpoints kept
    assert ac.COUNTERS.held == {"device": 0, "host": 0}
    report = ac.COUNTERS.report()
    assert report["peak.device.activation_checkpoints"] == (INPUT_BYTES if cpu else every)
    assert report["peak.host.activation_checkpoints"] == (every if cpu else 0)


@pytest.mark.parametrize("cpu", [False, True])
def test_non_reentrant_needs_no_input_that_requires_grad(cpu: bool) -> None:
    ac.configure(None, checkpoint_in_cpu=cpu)
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.3))
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    layer(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    torch.manual_seed(3)
    ac.non_reentrant_checkpoint(layer, x).pow(2).sum().backward()
    assert all(torch.equal(p.grad, e) for p, e in zip(layer.parameters(), expected))


def test_memory_model_and_estimate_cpu_checkpointing(capsys) -> None:
    from zero_offload.cli.main import main
    from zero_offload.runtime.plan.memory_model import StepShape, ZeroPlan, predict
    from zero_offload.runtime.plan.model_shape import ModelShape

    shape, plan = ModelShape.gpt2(4, 64, 4, 128, 32), ZeroPlan(stage=2)
    on_device = predict(shape, StepShape(2, 32, True), plan)
    on_host = predict(shape, StepShape(2, 32, True, cpu_checkpointing=True), plan)
    inputs = 4 * 2 * 32 * 64 * 2  # layers x tokens x hidden, fp16
    assert on_host["peak.host.activation_checkpoints"] == inputs
    assert on_host["peak.host.total"] - on_device["peak.host.total"] == inputs
    moved = on_device["peak.device.activations"] - on_host["peak.device.activations"]
    assert moved == inputs * 3 // 4  # every layer's input but the one brought back
    args = ["estimate", "--model", "gpt2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch", "2",
            "--vocab-size", "128", "--stage", "2", "--checkpoint-activations"]  # fmt: skip
    assert main([*args, "--cpu-checkpointing"]) == 0
    assert "activation checkpointing on, inputs in host memory" in capsys.readouterr().out
    assert main(args[:-1] + ["--cpu-checkpointing"]) == 2
    assert "needs --checkpoint-activations" in capsys.readouterr().err


def test_configure_and_is_configured_follow_deepspeed() -> None:
    assert not ac.is_configured()
    ac.configure(None, deepspeed_config=CPU, synchronize=True, profile=True)
    assert ac.is_configured() and ac.policy().cpu_checkpointing and ac.policy().synchronize
    ac.configure(None, checkpoint_in_cpu=False)  # defaults first, then the arguments
    assert ac.policy() == ac.CheckpointPolicy()
    ac.reset()
    assert ac.is_configured()  # reset frees buffers, it does not unconfigure
    ac.configure(None, partition_activations=True)  # one model-parallel rank: a no-op
    assert script.run(ac, "reentrant")["losses"] == script.run(ac, "plain")["losses"]


@pytest.mark.parametrize("checkpoint", [ac.checkpoint, ac.non_reentrant_checkpoint])
def test_profile_logs_each_phase(caplog, checkpoint) -> None:
    ac.configure(None, synchronize=True, profile=True)
    x = torch.randn(2, 4, requires_grad=True)
    with caplog.at_level("INFO", logger="zero_offload"):
        checkpoint(torch.nn.Linear(4, 4), x).sum().backward()
    phases = [r.getMessage().split(":")[0] for r in caplog.records]
    later = "backward" if checkpoint is ac.checkpoint else "recompute"
    assert phases == ["activation checkpoint forward", f"activation checkpoint {later}"]


def test_configure_reads_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**CPU, "zero_optimization": {"stage": 2}}))
    ac.configure(None, deepspeed_config=str(path))
    assert ac.policy() == ac.CheckpointPolicy(cpu_checkpointing=True)


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.cpu_checkpoint\b.*did you"):
        ac.configure(None, {"activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ConfigError, match="contiguous_memory_optimization: true needs partition"):
        zero_offload.config.load_config(
            {
                "train_batch_size": 1,
                "activation_checkpointing": {"contiguous_memory_optimization": True},
            }
        )
    bad = {"partition_activations": True, "contiguous_memory_optimization": True}
    with pytest.raises(ConfigError, match="activation_checkpointing.number_checkpoints: null"):
        ac.configure(None, {"activation_checkpointing": bad})
    with pytest.raises(ValueError, match="number_checkpoints .num_checkpoints. must be given"):
        ac.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(ValueError, match=r"checkpoint_in_cpu=.*cpu_checkpointing.*true or false"):
        ac.configure(None, checkpoint_in_cpu="yes")
    with pytest.raises(ValueError, match=r"num_checkpoints=.*number_checkpoints.*integer > 0"):
        ac.configure(None, num_checkpoints=0)
    with pytest.raises(TypeError, match="deepspeed_config=.*a config dict"):
        ac.configure(None, deepspeed_config=3)
    with pytest.raises(ConfigError, match="cpu_checkpointing"):
        zero_offload.config.load_config(
            {"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": "yes"}}
        )


def _gpt2_engine(section: dict | None, seq: int = 8, stage: int = 2, checkpoint: bool = True):
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config(num_layers=3, hidden_size=16, num_attention_heads=2,
                                 seq_length=seq, vocab_size=32, dropout=0.1,
                                 checkpoint_activations=checkpoint))  # fmt: skip
    zero = {"stage": stage, "reduce_bucket_size": 1000}
    if stage == 3:  # every layer partitioned, so the recompute gathers
        zero["stage3_param_persistence_threshold"] = 0
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": zero,
    }
    if section is not None:
        config["activation_checkpointing"] = section
    engine, *_ = zero_offload.initialize(model=model, config=config)
    return engine


def _train(engine, steps: int = 2, seq: int = 8) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (2, seq))
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_applies_the_section_and_reports_the_bytes_moved() -> None:
    """The section configures the API at initialize; the project's GPT-2 then checkpoints
    through it: torch's losses, its layer inputs in host memory (counted in memory_report and
    predicted by expected_memory), one on the device at a time."""
    reference = _train(_gpt2_engine(None))
    assert not ac.is_configured() and ac.COUNTERS.report() == {}
    engine = _gpt2_engine({"cpu_checkpointing": True})
    assert ac.is_configured() and ac.policy().cpu_checkpointing
    assert _train(engine) == pytest.approx(reference, rel=1e-6)
    report = engine.memory_report()
    one = 2 * 8 * 16 * 4  # micro batch x seq x hidden, fp32
    assert report["peak.host.activation_checkpoints"] == 3 * one
    assert report["peak.device.activation_checkpoints"] == one
    assert "host.activation_checkpoints" not in report  # a transient, not a state
    predicted = engine.expected_memory(seq_length=8)
    assert predicted["peak.host.activation_checkpoints"] == 3 * one
    without = engine.expected_memory(seq_length=8, cpu_checkpointing=False)
    saved = without["peak.device.activations"] - predicted["peak.device.activations"]
    assert saved == 2 * one  # every input but the one brought back
    engine.reset_peak_memory()
    assert engine.memory_report()["peak.host.activation_checkpoints"] == 0


def test_stage3_recomputes_from_host_copies() -> None:
    """Stage 3 gathers a layer's params again for its recompute (inside backward): the losses
    of no checkpoint at all."""
    reference = _train(_gpt2_engine(None, stage=3, checkpoint=False), steps=3)
    SETTINGS.__init__()
    engine = _gpt2_engine({"cpu_checkpointing": True}, stage=3)
    assert engine.param_store is not None and engine.param_store.slots
    assert _train(engine, steps=3) == reference
    assert engine.memory_report()["peak.device.activation_checkpoints"] == 2 * 8 * 16 * 4


def test_an_explicit_configure_wins_over_the_section() -> None:
    _gpt2_engine({"profile": True})
    _gpt2_engine({"synchronize_checkpoint_boundary": True})  # a later engine's section
    assert ac.policy() == ac.CheckpointPolicy(synchronize=True)
    ac.configure(None, checkpoint_in_cpu=False, synchronize=True)
    _gpt2_engine({"cpu_checkpointing": True})
    assert not ac.policy().cpu_checkpointing and ac.policy().synchronize


def test_the_namespace_names() -> None:
    from zero_offload import deepspeed_compat as ds
    from zero_offload.deepspeed_compat.runtime.activation_checkpointing import checkpointing

    assert ds.checkpointing is checkpointing
    for name in ("configure", "is_configured", "checkpoint", "non_reentrant_checkpoint", "reset",
                 "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed"):  # fmt: skip
        assert getattr(ds.checkpointing, name) is getattr(ac, name), name
    assert ds.checkpointing.CPU_CHECKPOINT is False and not ds.checkpointing.PARTITION_ACTIVATIONS
    ac.configure(None, checkpoint_in_cpu=True, num_checkpoints=4)
    assert ds.checkpointing.CPU_CHECKPOINT is True and ds.checkpointing.num_layers == 4
    assert ds.checkpointing.deepspeed_checkpointing_enabled is True
    with pytest.raises(ds.DeepSpeedNotProvidedError, match="checkpointing.gather_partitioned"):
        ds.checkpointing.gather_partitioned_activations  # noqa: B018


def test_tracker_fork_add_and_seed() -> None:
    tracker = ac.get_cuda_rng_tracker()
    ac.model_parallel_cuda_manual_seed(7)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default state is untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the tracked state moved on
    torch.manual_seed(7 + 2718)
    assert torch.equal(a, torch.rand(3))  # DeepSpeed's model-parallel seed


@pytest.mark.cuda  # run by the GPU check's cuda_tests step (scripts/gpu_check.sh)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_checkpointing_on_cuda_keeps_pinned_host_copies(monkeypatch) -> None:
    ac.configure(None, checkpoint_in_cpu=True)
    layer = torch.nn.Linear(16, 16).cuda()
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    seen: list[torch.Tensor] = []
    real = ac.stash.Stash.__init__

    def spy(self, args, to_host):
        real(self, args, to_host)
        seen.extend(self.kept)

    monkeypatch.setattr(ac.stash.Stash, "__init__", spy)
    h = ac.checkpoint(layer, ac.checkpoint(layer, x))
    assert len(seen) == 2 and all(t.device.type == "cpu" and t.is_pinned() for t in seen)
    assert ac.COUNTERS.held == {"device": 0, "host": 2 * 4 * 16 * 4}
    h.sum().backward()
    assert ac.COUNTERS.peak["device"] == 4 * 16 * 4  # one input back on the device at a time
    g = x.grad.clone()
    x.grad = None
    layer(layer(x)).sum().backward()
    torch.testing.assert_close(g, x.grad)


# ---- DeepSpeed's own cases (its unit tests skip them on a CPU accelerator) ----------------------

H = 20


class MaskedLinear(torch.nn.Linear):
    def forward(self, x, mask):
        return super().forward(x) * mask.type_as(x)


class MaskedLinearSeqDup(MaskedLinear):
    """More outputs than inputs, one not differentiable and one not requiring grad."""

    def forward(self, x, mask):
        return x.detach() * 1.38, super().forward(x, mask), mask


class NonTensorIO(torch.nn.Linear):
    def __init__(self, extra) -> None:
        super().__init__(H, H)
        self.extra = extra

    def forward(self, x, ignored=None):
        return super().forward(x), self.extra


def _case(name: str):
    mask = torch.randn(H) > 0
    return {
        "one_in_one_out": (torch.nn.Linear(H, H), ()),
        "bool_mask": (MaskedLinear(H, H), (mask,)),
        "float_mask": (MaskedLinear(H, H), (mask.float(),)),
        "three_outputs": (MaskedLinearSeqDup(H, H), (mask,)),
        "none_input": (NonTensorIO(2), (None,)),
        "non_tensor_input": (NonTensorIO(None), ((None, 2.5),)),
        "nested_non_tensor_output": (NonTensorIO((None, True, torch.randn(H))), ()),
    }[name]


def _outputs_and_grads(module, call, x, extra):
    x = x.detach().clone().requires_grad_()
    out = call(module, x, *extra)
    out = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in out if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    return out, [p.grad for p in module.parameters()] + [x.grad]


@pytest.mark.parametrize(
    "name",
    ["one_in_one_out", "bool_mask", "float_mask", "three_outputs", "none_input",
     "non_tensor_input", "nested_non_tensor_output"],
)  # fmt: skip
@pytest.mark.parametrize("checkpoint", [ac.checkpoint, ac.non_reentrant_checkpoint])
def test_deepspeeds_input_and_output_cases(checkpoint, name: str) -> None:
    import copy

    torch.manual_seed(0)
    module, extra = _case(name)
    x = torch.rand(H)
    base = _outputs_and_grads(copy.deepcopy(module), lambda m, *a: m(*a), x, extra)
    got = _outputs_and_grads(copy.deepcopy(module), checkpoint, x, extra)
    assert [type(o) for o in got[0]] == [type(o) for o in base[0]]
    for a, b in zip(got[0], base[0]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(a, tuple):
            assert [type(v) for v in a] == [type(v) for v in b]
        else:
            assert a == b
    for a, b in zip(got[1], base[1]):
        torch.testing.assert_close(a, b)


def test_keyword_tensors_take_part_in_autograd() -> None:
    value, scale = torch.randn(H, requires_grad=True), torch.randn(H, requires_grad=True)
    out = ac.checkpoint(
        lambda v, *, scale, offset: v * scale + offset, value, scale=scale, offset=1.5
    )
    out.sum().backward()
    torch.testing.assert_close(out, value * scale + 1.5)
    torch.testing.assert_close(value.grad, scale.detach())
    torch.testing.assert_close(scale.grad, value.detach())
