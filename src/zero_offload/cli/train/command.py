"""``zero-offload train``: train a GPT-2 on the built-in corpus through the ZeRO-Offload engine.

With no arguments: a small GPT-2 on the Python standard library's sources, ZeRO stage 2 with the
optimizer on the host, 300 steps, a few minutes on two CPU cores; the loss falls from ln(256) =
5.5 nats to near 2. Under ``zero-offload launch --num_gpus N`` (or torchrun) each rank trains on
its own slice of the data and only rank 0 writes the run folder: metrics.csv, loss.png,
config.json (the resolved DeepSpeed config) and run.json (model, results).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from typing import Any

from ..errors import report
from .hf import add_hf_arguments, check_hf_arguments
from .job import Job, gpt2_job, model_config
from .periodic_save import PeriodicSaver
from .run_folder import METRIC_COLUMNS, RunFolder

__all__ = [
    "DEFAULT_CONFIG",
    "METRIC_COLUMNS",
    "RunFolder",
    "add_arguments",
    "model_config",
    "resolve_config",
    "run",
]

# The built-in job. fp32, not bf16, on the CPU: measured on a 2-core AVX2 CPU without AVX-512
# BF16 or AMX, the "small" model trains at about 7,300 tokens/s in fp32 and 380 tokens/s in bf16
# (plain PyTorch: 0.9 s against 8.3 s per step): with no bf16 arithmetic in the CPU, bf16
# matmuls leave the fast fp32 kernels for conversion-bound ones. On CUDA with bf16 support resolve_config turns
# bf16 on instead: 16-bit model params on the device are the point of ZeRO-Offload.
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 2e-3,
            "warmup_num_steps": 30,
            "warmup_type": "linear",
            "total_num_steps": 300,
        },
    },
    "gradient_clipping": 1.0,
    "bf16": {"enabled": False},
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
}
DEFAULT_STEPS = 300
DEFAULT_PRESET = "small"
_DECAYING_SCHEDULERS = ("WarmupDecayLR", "WarmupCosineLR")
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="DeepSpeed JSON config (default: the built-in one)")
    parser.add_argument(
        "--data", nargs="+", metavar="PATH", help="text files or folders (default: built-in)"
    )
    parser.add_argument(
        "--max-bytes", type=int, default=8 * 1024 * 1024, help="corpus size cap in bytes"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help=f"optimizer steps ({DEFAULT_STEPS})"
    )
    parser.add_argument("--out", help="run folder (default: runs/<timestamp>)")
    parser.add_argument(
        "--preset", default=DEFAULT_PRESET, help=f"GPT-2 size preset ({DEFAULT_PRESET})"
    )
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--seq-length", type=int)
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--log-every", type=int, default=50, help="print a log line every N steps (0: never)"
    )
    parser.add_argument(
        "--eval-batches", type=int, default=16, help="held-out micro-batches per rank"
    )
    parser.add_argument(
        "--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)"
    )
    parser.add_argument("--save-dir", help="checkpoint folder (default: <run folder>/checkpoints)")
    parser.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="N",
        help="with --save-every: keep only the newest N checkpoints (0: keep all)",
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="resume from the latest checkpoint in DIR (metrics.csv of the same --out is "
        "continued, not rewritten)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a collective waits for the other ranks before failing (default: "
        "$DEEPSPEED_TIMEOUT minutes, else 600 s, as in DeepSpeed)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help="micro batch per rank (train_micro_batch_size_per_gpu; must agree with the config)",
    )
    add_hf_arguments(parser)


def resolve_config(
    config_path: str | None,
    steps: int | None,
    cuda_bf16: bool = False,
    batch_size: int | None = None,
) -> tuple[dict[str, Any], int, list[str]]:
    """The DeepSpeed config dict to train with, the number of steps, and notes on what was
    filled in.

    A user config is used as given, except for what the tutorials' configs leave to the
    training script: with no batch key the built-in micro batch is used, with no ``optimizer``
    the built-in AdamW and its schedule, and a decaying schedule without ``total_num_steps``
    decays over the run. ``batch_size`` (``--batch-size``) is the micro batch; a config that
    sets a different ``train_micro_batch_size_per_gpu`` is an error saying which to change.
    ``"auto"`` values the run knows are filled: ``total_num_steps`` (the steps) and
    ``warmup_max_lr`` (the optimizer's lr).
    """
    from zero_offload.config import ConfigError, read_json_file

    if steps is not None and steps <= 0:
        raise ValueError(f"--steps must be a positive integer, got {steps}")
    if batch_size is not None and batch_size <= 0:
        raise ValueError(f"--batch-size must be a positive integer, got {batch_size}")
    steps = steps or DEFAULT_STEPS
    notes: list[str] = []
    if config_path is None:
        config = copy.deepcopy(DEFAULT_CONFIG)
        config["bf16"]["enabled"] = cuda_bf16
        config["scheduler"] = _builtin_scheduler(steps)
        if batch_size is not None:
            config["train_micro_batch_size_per_gpu"] = batch_size
        return config, steps, notes
    config = read_json_file(config_path)
    if batch_size is not None:
        micro = config.get("train_micro_batch_size_per_gpu", "auto")
        if micro != "auto" and micro != batch_size:
            raise ConfigError(
                f"train_micro_batch_size_per_gpu: {micro} in the config, but --batch-size "
                f"{batch_size}; change --batch-size to {micro}, or the config's "
                f"train_micro_batch_size_per_gpu to {batch_size} (or remove it)",
                origin=os.fspath(config_path),
            )
        config["train_micro_batch_size_per_gpu"] = batch_size
    if all(config.get(key, "auto") == "auto" for key in _BATCH_KEYS):
        micro = DEFAULT_CONFIG["train_micro_batch_size_per_gpu"]
        config["train_micro_batch_size_per_gpu"] = micro
        notes.append(f"no batch size in {config_path}: train_micro_batch_size_per_gpu {micro}")
    if "optimizer" not in config:
        config["optimizer"] = copy.deepcopy(DEFAULT_CONFIG["optimizer"])
        notes.append(f"no optimizer in {config_path}: the built-in AdamW")
        if "scheduler" not in config:
            # Only with the built-in optimizer: its warmup_max_lr is that optimizer's lr.
            config["scheduler"] = _builtin_scheduler(steps)
    _fill_scheduler(config, steps)
    return config, steps, notes


def _fill_scheduler(config: dict[str, Any], steps: int) -> None:
    """The scheduler's "auto" values the run knows: a decaying schedule's ``total_num_steps``
    (the steps) and ``warmup_max_lr`` (the optimizer's lr)."""
    scheduler = config.get("scheduler")
    if isinstance(scheduler, dict) and isinstance(scheduler.get("params", {}), dict):
        params = scheduler.setdefault("params", {})
        if (
            scheduler.get("type") in _DECAYING_SCHEDULERS
            and params.get("total_num_steps", "auto") == "auto"
        ):
            params["total_num_steps"] = steps
        lr = config.get("optimizer", {}).get("params", {}).get("lr")
        if params.get("warmup_max_lr") == "auto" and isinstance(lr, (int, float)):
            params["warmup_max_lr"] = lr  # Hugging Face's rule: the optimizer's lr


def _builtin_scheduler(steps: int) -> dict[str, Any]:
    """The built-in schedule over ``steps``: warmup for a tenth of a short run, at most 30."""
    scheduler = copy.deepcopy(DEFAULT_CONFIG["scheduler"])
    params = scheduler["params"]
    params["total_num_steps"] = steps
    params["warmup_num_steps"] = max(1, min(params["warmup_num_steps"], steps // 10))
    return scheduler


def memory_mib(device) -> float:
    """Peak CUDA memory allocated on a GPU; on the CPU the process's resident set."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, KiB on Linux


def _batches(dataset, batch_size: int, rank: int, world: int, seed: int):
    """Endless micro-batches of this rank's slice, reshuffled every epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise ValueError(
            f"the training data holds {len(dataset)} blocks, too few for one micro-batch of "
            f"{batch_size} on each of {world} ranks; give more --data or a smaller --seq-length"
        )

    def endless():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    return endless()


def _pooled(total: float, count: int, device) -> tuple[float, int]:
    """(sum, count) summed over all ranks; one small collective on the engine's device (nccl
    reduces only CUDA tensors, gloo only CPU ones, and the engine's device fits its backend)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return total, count
    pair = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
    dist.all_reduce(pair)
    total, pooled_count = pair.tolist()
    return total, int(pooled_count)


def run(args: argparse.Namespace) -> int:
    built = _build(args)
    if isinstance(built, int):  # reported
        return built
    engine, job, ds_config, steps, notes = built
    micro = engine.train_micro_batch_size_per_gpu()
    try:
        batches = _batches(job.train_set, micro, engine.global_rank, engine.world_size, args.seed)
    except ValueError as err:
        return report("train", err)
    first = 1
    if args.resume:
        try:
            first = _resume(engine, args.resume, batches)
        except _ResumeError as err:
            return report("train", ValueError(str(err)))
    folder = RunFolder.create(
        args.out, engine.global_rank, resume_at=first if args.resume else None
    )
    if engine.global_rank == 0:
        for note in notes + job.notes:
            print(f"note: {note}")
        _describe(engine, job, ds_config, steps)
        resolved = getattr(engine, "config", None)
        folder.write_json(
            "config.json", resolved.to_dict() if hasattr(resolved, "to_dict") else ds_config
        )
    if first > steps:
        if engine.global_rank == 0:
            print(
                f"the checkpoint is at step {first - 1}, the run asks for {steps} steps: nothing "
                "to train (give a larger --steps to continue)"
            )
        folder.close()
        engine.destroy()
        return 0
    return _train_and_finish(engine, job, args, batches, steps, first, folder)


def _build(args: argparse.Namespace):
    """(engine, job, DeepSpeed config, steps, notes), or the exit status of a reported error."""
    import torch

    import zero_offload
    from zero_offload.config import ConfigError
    from zero_offload.core.dist import uses_cuda

    try:
        cuda_bf16 = uses_cuda() and torch.cuda.is_bf16_supported()
        ds_config, steps, notes = resolve_config(
            args.config, args.steps, cuda_bf16, args.batch_size
        )
        if min(args.log_every, args.eval_batches, args.save_every, args.keep_last) < 0:
            raise ValueError(
                "--log-every, --eval-batches, --save-every and --keep-last must be >= 0"
            )
        check_hf_arguments(args)
        zero_offload.init_distributed(timeout=args.timeout)
        if args.model is not None:
            from .hf import hf_job

            job = hf_job(args, ds_config)
        else:
            job = gpt2_job(args)
        engine, _, _, _ = zero_offload.initialize(
            model=job.model, model_parameters=job.param_groups, config=ds_config
        )
    except (ValueError, FileNotFoundError, ImportError) as err:  # ConfigError is a ValueError
        if isinstance(err, ConfigError) and args.batch_size is not None:
            err.problems = [
                f"{p} (--batch-size {args.batch_size} sets train_micro_batch_size_per_gpu)"
                for p in err.problems
            ]
        return report("train", err, args.config)
    return engine, job, ds_config, steps, notes


class _ResumeError(Exception):
    """The run cannot resume from the folder it was given."""


def _resume(engine, resume: str, batches) -> int:
    """Load the newest checkpoint in ``resume`` and skip the data it consumed; the first step."""
    from zero_offload.checkpoint import CheckpointError

    try:
        path, client = engine.load_checkpoint(resume)
    except (CheckpointError, FileNotFoundError) as err:  # damaged or for another model
        raise _ResumeError(f"cannot resume from {resume}: {err}") from err
    if path is None:
        raise _ResumeError(f"no checkpoint to resume from in {resume}")
    position = _resume_position(engine, client)
    for _ in range(position["micro_batches"]):  # the data position, exactly
        next(batches)
    if engine.global_rank == 0:
        print(f"resumed from {path} at step {position['step'] + 1}")
    return position["step"] + 1


def _train_and_finish(engine, job, args, batches, steps: int, first: int, folder) -> int:
    """The steps, periodic saves, evaluation, export and summary; the exit status."""
    save_dir = args.save_dir or os.path.join(folder.path, "checkpoints")
    saver = PeriodicSaver(engine, save_dir, args.save_every, args.keep_last)
    losses, elapsed = _train(
        engine,
        batches,
        steps,
        job.seq_length,
        folder,
        args.log_every,
        first=first,
        saver=saver,
    )
    micro = engine.train_micro_batch_size_per_gpu()
    heldout = evaluate(engine, job.heldout_set, micro, args.eval_batches)
    exported = job.finish(engine, folder) if job.finish is not None else []
    if engine.global_rank == 0:
        _summarize(engine, job, folder, losses, elapsed, heldout, exported)
    folder.close()
    if hasattr(engine, "destroy"):
        engine.destroy()
    if saver.failures:
        if engine.global_rank == 0:
            print(
                f"zero-offload train: error: {saver.failures} checkpoint save(s) failed; the "
                f"newest good checkpoint is {saver.last_good or 'none'}"
            )
        return 1
    return 0


def _resume_position(engine, client) -> dict[str, int]:
    """Where a resumed run continues: the train command's own client state, or (a checkpoint
    written by ``engine.save_checkpoint`` without it) the engine's restored counters."""
    gas = engine.gradient_accumulation_steps()
    client = client if isinstance(client, dict) else {}
    step = client.get("step", engine.global_steps)
    micro = client.get("micro_batches", step * gas)
    if not (isinstance(step, int) and isinstance(micro, int) and step >= 0 and micro >= 0):
        raise ValueError(f"checkpoint client state has an invalid data position: {client!r}")
    return {"step": step, "micro_batches": micro}


def _tokens_per_step(engine, seq_length: int) -> int:
    return (
        engine.train_micro_batch_size_per_gpu()
        * engine.gradient_accumulation_steps()
        * engine.world_size
        * seq_length
    )


def _partitioned_count(engine) -> int:
    store = getattr(engine, "param_store", None)
    if store is None:
        return 0
    return sum(len(slot.params) for slot in store.slots if not slot.persistent)


def _describe(engine, job: Job, ds_config: dict[str, Any], steps: int) -> None:
    print(
        f"{job.title}, {job.corpus_tokens / 2**20:.1f}M corpus tokens, {engine.world_size} "
        f"rank(s) on {engine.device.type}, {next(engine.module.parameters()).dtype}, "
        f"ZeRO stage {ds_config.get('zero_optimization', {}).get('stage', 0)}, "
        f"{_tokens_per_step(engine, job.seq_length)} tokens/step, {steps} steps"
    )
    report_ = engine.memory_report()
    states = {k: v for k, v in report_.items() if not k.startswith("peak.")}
    print("model states: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in states.items()))


def _train(
    engine,
    batches,
    steps: int,
    seq_length: int,
    folder: RunFolder,
    log_every: int,
    first: int = 1,
    saver: PeriodicSaver | None = None,
) -> tuple[list[float], float]:
    """Steps ``first..steps``; returns the per-step loss (mean over ranks) and seconds. Every
    ``--save-every`` steps all ranks save a checkpoint whose client state records the data
    position, so ``--resume`` continues exactly."""
    from tqdm import tqdm

    device, gas = engine.device, engine.gradient_accumulation_steps()
    tokens_per_step = _tokens_per_step(engine, seq_length)
    rank0 = engine.global_rank == 0
    bar = tqdm(total=steps, initial=first - 1, desc="train", disable=not rank0, dynamic_ncols=True)
    losses: list[float] = []
    engine.train()
    start = time.perf_counter()
    for step in range(first, steps + 1):
        t0 = time.perf_counter()
        lr = engine.get_lr()[0]  # before step(): the schedule then moves on to the next step's
        loss_sum = 0.0
        for _ in range(gas):
            input_ids, labels = (t.to(device, non_blocking=True) for t in next(batches))
            loss = engine(input_ids, labels)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.item()
        pooled_sum, pooled_count = _pooled(loss_sum, gas, device)
        losses.append(pooled_sum / pooled_count)
        if saver is not None:
            saver.maybe_save(step, gas)
        row = {
            "step": step,
            "loss": losses[-1],
            "lr": lr,
            "tokens_per_s": tokens_per_step / (time.perf_counter() - t0),
            "grad_norm": engine.get_global_grad_norm(),
            "loss_scale": engine.loss_scale,
            "mem_mib": memory_mib(device),
        }
        if rank0:
            folder.add_metrics(row)
            _show(bar, row, steps, log_every)
    bar.close()
    return losses, time.perf_counter() - start


def _show(bar, row: dict[str, Any], steps: int, log_every: int) -> None:
    """Rank 0: the step's row on the progress bar, and every ``log_every`` steps as a line."""
    step, lr = row["step"], row["lr"]
    bar.set_postfix(
        loss=f"{row['loss']:.3f}",
        tok_s=f"{row['tokens_per_s']:.0f}",
        lr=f"{lr:.2e}",
        mem=f"{row['mem_mib']:.0f}MiB",
        refresh=False,
    )
    bar.update(1)
    if log_every and (step % log_every == 0 or step == steps):
        grad_norm = row["grad_norm"] if row["grad_norm"] is not None else math.nan
        bar.write(
            f"step {step}/{steps} loss {row['loss']:.4f} lr {lr:.3e} grad_norm "
            f"{grad_norm:.3f} {row['tokens_per_s']:.0f} tokens/s mem {row['mem_mib']:.0f} MiB"
        )


def _summarize(
    engine,
    job: Job,
    folder: RunFolder,
    losses: list[float],
    elapsed: float,
    heldout: float,
    exported: list[str],
) -> None:
    tokens_per_step = _tokens_per_step(engine, job.seq_length)
    tokens_per_s = tokens_per_step * len(losses) / elapsed
    tail = losses[-10:]
    tflops = job.flops_per_token * tokens_per_s / 1e12 if job.flops_per_token else None
    results = {
        "model": job.info,
        "num_parameters": job.num_parameters,
        "world_size": engine.world_size,
        # stage 3: params held only as shards outside a gather (not persistent); 0 below stage 3
        "partitioned_parameters": _partitioned_count(engine),
        "steps": len(losses),
        "tokens_per_step": tokens_per_step,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),  # the last ten steps: one batch is noisy
        "heldout_loss": heldout if math.isfinite(heldout) else None,  # JSON has no NaN
        "seconds": elapsed,
        "tokens_per_s": tokens_per_s,
        "model_tflops": tflops,
        "exported": [os.path.relpath(p, folder.path) for p in exported],
        "memory": engine.memory_report(),  # this rank's states and the steps' peaks, by term
    }
    folder.write_json("run.json", results)
    folder.plot_loss(heldout)
    flops_text = f", {tflops:.4f} model TFLOPS" if tflops is not None else ""
    print(
        f"loss {results['first_loss']:.3f} -> {results['final_loss']:.3f} "
        f"(held-out {heldout:.3f}) in {elapsed:.0f} s, {tokens_per_s:.0f} tokens/s{flops_text}"
    )
    print(_memory_line(results["memory"]))
    written = folder.files() + results["exported"]
    print(f"wrote {', '.join(written)} in {folder.path}")


def _memory_line(report: dict[str, int]) -> str:
    """Rank 0's bytes by term (MiB), the steps' peaks after the states, and the process's
    peak resident size on Linux (what the terms add up to, with the import's baseline)."""
    terms = sorted(report.items(), key=lambda kv: (kv[0].startswith("peak."), kv[0]))
    text = "memory (MiB): " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in terms)
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return text + f"; peak resident {hwm / 1024:.1f}"
    except (OSError, StopIteration):
        return text


def evaluate(engine, dataset, micro_batch: int, max_batches: int) -> float:
    """Mean held-out loss over up to ``max_batches`` micro-batches per rank, all ranks pooled."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    if hasattr(engine, "flush_delayed_update"):  # a pending host update belongs to the weights
        engine.flush_delayed_update()
    sampler = DistributedSampler(
        dataset, num_replicas=engine.world_size, rank=engine.global_rank, shuffle=False
    )
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler)
    total, count = 0.0, 0
    engine.eval()
    with torch.no_grad():
        for i, (input_ids, labels) in enumerate(loader):
            if i >= max_batches:
                break
            loss = engine(input_ids.to(engine.device), labels.to(engine.device))
            total += loss.item() * len(input_ids)
            count += len(input_ids)
    engine.train()
    total, count = _pooled(total, count, engine.device)
    return total / count if count else math.nan
