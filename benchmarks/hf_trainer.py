"""The same Hugging Face ``Trainer`` run (model, config, data, steps) on zero_offload (through the
``deepspeed`` opt-in) and on the real DeepSpeed, side by side in one run.

    python benchmarks/hf_trainer.py                          # both modes, both implementations
    python benchmarks/hf_trainer.py --modes zero3-offload --steps 12 --json out.json
    python benchmarks/hf_trainer.py --sizes 125M 350M        # the named Llama sizes (SIZES)

``--sizes`` runs named Llama shapes built from a ``LlamaConfig`` (no download): ``tiny`` (3.66M
params, the default custom shape), ``125M`` (122.7M) and ``350M`` (352.2M), in bf16 where the
CPU has bf16 arithmetic (AVX-512 BF16 or AMX; or with a GPU), else fp32 (``--dtype``), each
timed over at least 5 steps after the warm-up. The CPU's kind, the dtype, every row's losses
step by step and the largest gap between the two implementations' losses are printed. DeepSpeed
may live in another environment: ``--deepspeed-site`` appends its site-packages folder to the
DeepSpeed worker's ``sys.path`` (after this interpreter's torch and transformers).

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
``x DS`` is zero_offload's step time over DeepSpeed's in the same size and mode (< 1: faster);
``size`` is the named size (or ``custom``) and ``dtype`` the training dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
def _prepare(spec: dict) -> None:
    """Before the first import of deepspeed: which one this process gets, its ops built, and
    TrainingArguments' bf16 check satisfied on a CPU."""
    if spec["impl"] == "zero_offload":
        assert os.environ.get(ENV) == "1"
    else:
        assert ENV not in os.environ
        if spec.get("deepspeed_site"):  # after this interpreter's own packages: torch stays
            sys.path.append(spec["deepspeed_site"])
        if spec.get("prebuild"):
            sys.path.insert(0, str(HERE.parent))
            from _ds_compat import prebuild

            prebuild(["cpu_adam"])
    import torch

    torch.set_num_threads(spec["threads"])
    if spec.get("dtype") == "bf16" and not torch.cuda.is_available():
        # TrainingArguments accepts bf16 with DeepSpeed only where torch reports a bf16 GPU, and
        # use_cpu (its way out) turns DeepSpeed off; here the CPU stands in for the GPU (both
        # implementations run this same script).
        import transformers.training_args as ta

        ta.is_torch_bf16_gpu_available = lambda: True


def _training_args(spec: dict):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=spec["out"],
        deepspeed=ds_config(**MODES[spec["mode"]]),
        per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["gas"],
        max_steps=spec["steps"],
        bf16=spec.get("dtype") == "bf16",  # the config's "bf16": {"enabled": "auto"} follows
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


def _step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._t = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    return StepTimer()


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _prepare(spec)
    import deepspeed
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, Trainer

    args = _training_args(spec)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    n = spec["steps"] * spec["micro"] * spec["gas"]
    rows = torch.randint(0, spec["vocab"], (n, spec["seq"]), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    timer = _step_timer()
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
# Named Llama sizes for --sizes: (layers, hidden, heads, vocab). "tiny" is the default custom shape
# (3.66M params); "125M" and "350M" have GPT-3 Small's and Medium's depth and width with Llama
# blocks (SwiGLU MLP of 8/3 x hidden, RMSNorm, rotary positions) and an untied 24576-token
# vocabulary: 122.7M and 352.2M params.
SIZES = {
    "tiny": {"layers": 4, "hidden": 256, "heads": 4, "vocab": 1024},
    "125M": {"layers": 12, "hidden": 768, "heads": 12, "vocab": 24576},
    "350M": {"layers": 24, "hidden": 1024, "heads": 16, "vocab": 24576},
}
SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab")
MIN_TIMED = 5  # timed steps (all rounds) of a named size other than "tiny"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_kind() -> tuple[str, bool]:
    """The CPU's model name, and whether it has bf16 arithmetic (AVX-512 BF16 or AMX-BF16)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), bool(
        flags & {"avx512_bf16", "amx_bf16"}
    )


def build_model(folder: Path, shape: dict, seq: int) -> int:
    """Save the Llama once (in a subprocess: this process stays free of torch); its size."""
    h = shape["hidden"]
    code = (
        "import sys, torch, transformers\n"
        "torch.manual_seed(0)\n"
        f"c = transformers.LlamaConfig(vocab_size={shape['vocab']}, hidden_size={h}, "
        f"intermediate_size={h * 8 // 3 // 8 * 8}, num_hidden_layers={shape['layers']}, "
        f"num_attention_heads={shape['heads']}, num_key_value_heads={shape['heads']}, "
        f"max_position_embeddings={seq}, tie_word_embeddings=False)\n"
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


def _worker_env(impl: str, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_port()),
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
    )
    if impl == "zero_offload":
        env[ENV] = "1"
    elif not _cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (_ds_compat.py)
    return env


def run_one(impl: str, mode: str, model_dir: Path, a, shape: dict, prebuild: bool) -> dict:
    tag = f"{impl}-{mode}-{model_dir.name}"
    spec = {
        "impl": impl,
        "mode": mode,
        "model_dir": str(model_dir),
        "out": str(a.work / tag),
        "steps": a.steps,
        "warmup": a.warmup,
        "micro": a.micro,
        "gas": a.gas,
        "seq": a.seq,
        "vocab": shape["vocab"],
        "threads": a.threads,
        "dtype": a.dtype,
        "prebuild": prebuild,
        "deepspeed_site": a.deepspeed_site,
    }
    path = a.work / f"spec-{tag}.json"
    path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(HERE), "--worker", str(path)],
        env=_worker_env(impl, a.threads),
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
    out["losses"] = rounds[0]["losses"]  # the first round's, step by step
    return out


def real_deepspeed_importable(site: str | None = None) -> bool:
    import importlib.machinery

    path = [*sys.path, site] if site else None
    return importlib.machinery.PathFinder.find_spec("deepspeed", path) is not None


def run_size(name: str, shape: dict, a, impls: list[str], prebuilt: list[bool]) -> list[dict]:
    """Every (impl, mode) of one model size, in ``a.rounds`` interleaved rounds; pooled rows."""
    model_dir = a.work / f"model-{name}"
    n_params = build_model(model_dir, shape, a.seq)
    print(
        f"Llama {name}: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} "
        f"heads, vocab {shape['vocab']} ({n_params / 1e6:.2f}M params), seq {a.seq}, micro batch "
        f"{a.micro}, gradient accumulation {a.gas}, {a.dtype}, {a.steps} steps ({a.warmup} "
        f"warm-up) x {a.rounds} rounds, {a.threads} threads, one rank",
        flush=True,
    )
    runs: dict[tuple[str, str], list[dict]] = {}
    order = [(impl, mode) for mode in a.modes for impl in impls]
    for i in range(a.rounds):  # interleaved, alternating the order: a noisy machine hits both
        for impl, mode in order if i % 2 == 0 else order[::-1]:
            ds_first = impl == "deepspeed" and not prebuilt[0]
            r = run_one(impl, mode, model_dir, a, shape, prebuild=ds_first)
            prebuilt[0] = prebuilt[0] or impl == "deepspeed"
            runs.setdefault((impl, mode), []).append(r)
    rows = [_pool(runs[key]) for key in order]
    for r in rows:
        r.update(size=name, params=n_params, dtype=a.dtype)
    return rows


def table(results: list[dict]) -> list[str]:
    out = [
        "| size | impl (deepspeed version) | mode | dtype | s/step | peak RSS MiB | final loss "
        "| x DS |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        if "error" in r:
            out.append(f"| {r['size']} | {r['impl']} | {r['mode']} | error: {r['error']} |||||")
            continue
        ds = next(
            (x for x in results if (x["size"], x["mode"], x["impl"]) == (r["size"], r["mode"],
             "deepspeed") and "error" not in x), None,
        )  # fmt: skip
        ratio = f"{r['median_s'] / ds['median_s']:.2f}" if ds and r is not ds else "-"
        out.append(
            f"| {r['size']} | {r['impl']} {r['deepspeed_version']} | {r['mode']} | {r['dtype']} | "
            f"{r['median_s']:.3f} | {r['peak_rss_mib']:.0f} | {r['final_loss']:.4f} | {ratio} |"
        )
    return out


def loss_lines(results: list[dict]) -> list[str]:
    """Each row's losses, step by step (first round), and the largest gap between the two
    implementations' in the same size and mode."""
    out = []
    for r in (r for r in results if "error" not in r):
        out.append(f"losses {r['size']} {r['mode']} {r['impl']}: " + " ".join(
            f"{v:.4f}" for v in r["losses"]))  # fmt: skip
        other = [x for x in results if "error" not in x and x is not r and
                 (x["size"], x["mode"]) == (r["size"], r["mode"])]  # fmt: skip
        if r["impl"] == "zero_offload" and other:
            gap = max(abs(u - v) for u, v in zip(r["losses"], other[0]["losses"]))
            out.append(f"largest loss gap {r['size']} {r['mode']}: {gap:.2e}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), help="named Llama sizes")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    for flag in SHAPE_FLAGS:
        p.add_argument(f"--{flag}", type=int, help=f"custom shape (default {SIZES['tiny'][flag]})")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--steps", type=int, help="default 12; 10 with --sizes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"),
                   help="auto: bf16 where the CPU has bf16 arithmetic (AVX-512 BF16 or AMX) or "
                   "there is a GPU, else fp32; default auto with --sizes, fp32 without")  # fmt: skip
    p.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    p.add_argument("--rounds", type=int, help="interleaved repeats; default 2, 1 with --sizes")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--no-deepspeed", action="store_true", help="zero_offload rows only")
    p.add_argument("--deepspeed-site", help="a site-packages folder holding DeepSpeed, appended to "
                   "the DeepSpeed worker's sys.path (torch and transformers stay this "
                   "interpreter's)")  # fmt: skip
    p.add_argument("--json", help="write every result here")
    a = p.parse_args(argv)
    _settle(p, a)
    return a


def _settle(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Defaults that depend on --sizes, and the checks that name the flag at fault."""
    given = [f"--{f}" for f in SHAPE_FLAGS if getattr(a, f) is not None]
    if a.sizes and given:
        p.error(f"--sizes names the model shapes; drop {', '.join(given)} or --sizes")
    a.shapes = (
        {n: SIZES[n] for n in a.sizes}
        if a.sizes
        else {"custom": {f: getattr(a, f) or SIZES["tiny"][f] for f in SHAPE_FLAGS}}
    )
    a.steps = a.steps if a.steps is not None else (10 if a.sizes else 12)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.sizes else 2)
    if a.steps <= a.warmup:
        p.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}): no step is timed")
    timed = (a.steps - a.warmup) * a.rounds
    if any(n != "tiny" for n in a.sizes or ()) and timed < MIN_TIMED:
        p.error(f"(--steps - --warmup) x --rounds is {timed}; a named size is measured over at "
                f"least {MIN_TIMED} steps")  # fmt: skip
    if a.deepspeed_site and not (Path(a.deepspeed_site) / "deepspeed").is_dir():
        p.error(f"--deepspeed-site {a.deepspeed_site}: no deepspeed package in that folder")
    name, bf16_cpu = cpu_kind()
    a.cpu, a.cpu_bf16 = name, bf16_cpu
    choice = a.dtype or ("auto" if a.sizes else "fp32")
    a.dtype = choice if choice != "auto" else ("bf16" if bf16_cpu or _cuda() else "fp32")


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.work = Path(tempfile.mkdtemp(prefix="hf_trainer_bench_"))
    impls = ["zero_offload"]
    if not a.no_deepspeed and real_deepspeed_importable(a.deepspeed_site):
        impls.append("deepspeed")
    elif not a.no_deepspeed:
        print("DeepSpeed is not importable: zero_offload rows only")
    print(f"CPU: {a.cpu} (bf16 arithmetic: {'yes' if a.cpu_bf16 else 'no'}); dtype {a.dtype}")
    prebuilt = [False]  # DeepSpeed's ops are built by its first run only
    results = []
    for name, shape in a.shapes.items():
        results += run_size(name, shape, a, impls, prebuilt)
    print("\n".join(table(results)))
    print("\n".join(loss_lines(results)))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
