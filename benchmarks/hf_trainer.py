"""The same Hugging Face ``Trainer`` run (model, config, data, steps) on zero_offload (through the
``deepspeed`` opt-in) and on the real DeepSpeed, side by side in one run.

    python benchmarks/hf_trainer.py                          # both modes, both implementations
    python benchmarks/hf_trainer.py --modes zero3-offload --steps 12 --json out.json

Each (implementation, mode) is a fresh subprocess with a launcher's environment for one rank
(RANK=0, WORLD_SIZE=1, ...: DeepSpeed needs one; zero_offload makes the same gloo group from
it). The zero_offload process opts in with ``ZERO_OFFLOAD_AS_DEEPSPEED=1``; the DeepSpeed process
runs without it (and with ``DS_ACCELERATOR=cpu`` on a machine without a GPU; DeepSpeed's ops are
built before its Trainer starts, outside the timed steps). The Trainer script is the same file
for both (this one, ``--worker``): a Llama built from a config and saved once, random token
blocks, ``TrainingArguments(deepspeed=config)`` with the config in Hugging Face's style (every
Trainer-filled value "auto").

Columns: ``s/step`` is the median wall time of an optimizer step (all its micro-steps), timed by a
Trainer callback over the steps after ``--warmup``, pooled over ``--rounds`` interleaved rounds
(each a fresh process); ``peak RSS`` is the process's maximum
resident set (imports, model, optimizer state and all); ``final loss`` is the last logged loss
(the two implementations see the same data in the same order, so it should agree);
``x DS`` is zero_offload's step time over DeepSpeed's in the same mode (< 1: faster).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
MODES = {
    "zero2-offload": {"stage": 2, "offload_param": False},
    "zero3-offload": {"stage": 3, "offload_param": True},
}
IMPLS = ("zero_offload", "deepspeed")
ENV = "ZERO_OFFLOAD_AS_DEEPSPEED"


def ds_config(stage: int, offload_param: bool) -> dict:
    zero: dict = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = "auto"
        zero["stage3_param_persistence_threshold"] = "auto"
        if offload_param:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero,
    }


# ---- the worker: one Trainer run ---------------------------------------------------------------
def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["impl"] == "zero_offload":
        assert os.environ.get(ENV) == "1"
    else:
        assert ENV not in os.environ
        if spec.get("prebuild"):
            sys.path.insert(0, str(HERE.parent))
            from _ds_compat import prebuild

            prebuild(["cpu_adam"])
    import deepspeed
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(spec["threads"])

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    args = TrainingArguments(
        output_dir=spec["out"],
        deepspeed=ds_config(**MODES[spec["mode"]]),
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["gas"],
        max_steps=spec["steps"],
        learning_rate=1e-3,
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    n = spec["steps"] * spec["micro"] * spec["gas"]
    rows = torch.randint(0, spec["vocab"], (n, spec["seq"]), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    timer = StepTimer()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[timer])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = timer.times[spec["warmup"] :]
    result = {
        "impl": spec["impl"],
        "mode": spec["mode"],
        "deepspeed_module": deepspeed.__name__,
        "deepspeed_version": deepspeed.__version__,
        "transformers": transformers.__version__,
        "engine": type(trainer.model_wrapped).__module__,
        "median_s": statistics.median(timed),
        "timed_from": spec["warmup"],
        "step_times": timer.times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_loss": losses[-1],
        "losses": losses,
    }
    print("RESULT " + json.dumps(result), flush=True)
    # Both take their process group from the launcher's environment; tear it down before the
    # interpreter does, or gloo's threads can abort the exit ("terminate called without an
    # active exception"; zero_offload.core.dist.shutdown explains the pause).
    import torch.distributed as dist

    if dist.is_initialized():
        time.sleep(0.25)
        dist.destroy_process_group()


# ---- the driver --------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_model(folder: Path, a: argparse.Namespace) -> int:
    """Save the Llama once (in a subprocess: this process stays free of torch); its size."""
    code = (
        "import sys, torch, transformers\n"
        "torch.manual_seed(0)\n"
        f"c = transformers.LlamaConfig(vocab_size={a.vocab}, hidden_size={a.hidden}, "
        f"intermediate_size={a.hidden * 8 // 3 // 8 * 8}, num_hidden_layers={a.layers}, "
        f"num_attention_heads={a.heads}, num_key_value_heads={a.heads}, "
        f"max_position_embeddings={a.seq}, tie_word_embeddings=False)\n"
        "m = transformers.AutoModelForCausalLM.from_config(c).float()\n"
        "m.save_pretrained(sys.argv[1])\n"
        "print(sum(p.numel() for p in m.parameters()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV}
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[-1])


def run_one(impl: str, mode: str, model_dir: Path, work: Path, a, prebuild: bool) -> dict:
    spec = {
        "impl": impl,
        "mode": mode,
        "model_dir": str(model_dir),
        "out": str(work / f"{impl}-{mode}"),
        "steps": a.steps,
        "warmup": a.warmup,
        "micro": a.micro,
        "gas": a.gas,
        "seq": a.seq,
        "vocab": a.vocab,
        "threads": a.threads,
        "prebuild": prebuild,
    }
    path = work / f"spec-{impl}-{mode}.json"
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_port()),
        OMP_NUM_THREADS=str(a.threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
    )
    if impl == "zero_offload":
        env[ENV] = "1"
    elif not _cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (_ds_compat.py)
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HERE), "--worker", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=a.timeout,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"impl": impl, "mode": mode, "error": " | ".join(tail)}
    out = json.loads(lines[-1][len("RESULT ") :])
    out["process_s"] = time.perf_counter() - t0
    return out


def _cuda() -> bool:
    code = "import torch; print(torch.cuda.is_available())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() == "True"


def _pool(rounds: list[dict]) -> dict:
    """One row from a configuration's rounds: the median over every round's timed steps."""
    bad = [r for r in rounds if "error" in r]
    if bad:
        return bad[0]
    out = dict(rounds[-1])
    timed = [t for r in rounds for t in r["step_times"][r["timed_from"] :]]
    out["median_s"] = statistics.median(timed)
    out["timed_steps"] = len(timed)
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in rounds)
    out["final_losses"] = [r["final_loss"] for r in rounds]
    return out


def real_deepspeed_importable() -> bool:
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec("deepspeed") is not None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument(
        "--rounds", type=int, default=2, help="run everything this many times, interleaved"
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--no-deepspeed", action="store_true", help="zero_offload rows only")
    p.add_argument("--json", help="write every result here")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hf_trainer_bench_"))
    model_dir = work / "model"
    n_params = build_model(model_dir, a)
    impls = ["zero_offload"]
    if not a.no_deepspeed and real_deepspeed_importable():
        impls.append("deepspeed")
    elif not a.no_deepspeed:
        print("DeepSpeed is not importable: zero_offload rows only")
    print(
        f"Llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab} ({n_params / 1e6:.2f}M params), "
        f"seq {a.seq}, micro batch {a.micro}, gradient accumulation {a.gas}, fp32, "
        f"{a.steps} steps ({a.warmup} warm-up) x {a.rounds} rounds, {a.threads} threads, one rank"
    )
    runs: dict[tuple[str, str], list[dict]] = {}
    prebuilt = False
    order = [(impl, mode) for mode in a.modes for impl in impls]
    for i in range(a.rounds):  # interleaved, alternating the order: a noisy machine hits both
        for impl, mode in order if i % 2 == 0 else order[::-1]:
            ds_first = impl == "deepspeed" and not prebuilt
            r = run_one(impl, mode, model_dir, work, a, prebuild=ds_first)
            prebuilt = prebuilt or impl == "deepspeed"
            runs.setdefault((impl, mode), []).append(r)
    results = [_pool(runs[key]) for key in order]
    rows = []
    for mode in a.modes:
        ds = next((r for r in results if r["mode"] == mode and r["impl"] == "deepspeed"), None)
        for r in (r for r in results if r["mode"] == mode):
            if "error" in r:
                rows.append(f"| {r['impl']} | {mode} | error: {r['error']} | | | |")
                continue
            ratio = (
                f"{r['median_s'] / ds['median_s']:.2f}"
                if ds and "error" not in ds and r["impl"] == "zero_offload"
                else "-"
            )
            rows.append(
                f"| {r['impl']} {r['deepspeed_version']} | {mode} | {r['median_s']:.3f} | "
                f"{r['peak_rss_mib']:.0f} | {r['final_loss']:.4f} | {ratio} |"
            )
    print("| impl (deepspeed version) | mode | s/step | peak RSS MiB | final loss | x DS |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
