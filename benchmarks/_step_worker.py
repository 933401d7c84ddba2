"""One rank of one benchmark run, in a process of its own (fresh memory, no cross-talk).

Usage (by ``engine_step.py``): ``python _step_worker.py SPEC_JSON OUT_JSON``, with the launcher's
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
OMP_NUM_THREADS); ``python _step_worker.py --prebuild-deepspeed`` builds DeepSpeed's ops.

Writes per-step wall and CPU seconds, the losses, peak and steady RSS, the bytes of every live
tensor after the last step, the engine's memory accounting next to its formula and, on a GPU,
the device's peak memory (while building, and over the steps).
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]  # the checkout's package, not an install


def _threads() -> int:
    return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def live_tensor_bytes() -> dict[str, int]:
    """Bytes of the distinct storages behind every tensor Python can reach, by device type.

    Counts what each implementation keeps between steps (params, grads, master copies, optimizer
    state, flat and bucket buffers) the same way for all three; tensors held only inside C++
    extensions are missed, and none of the three keeps model state there.
    """
    import torch

    gc.collect()
    seen: dict[tuple[str, int], int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module proxies warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if not isinstance(obj, torch.Tensor) or obj.is_meta:
                    continue
                st = obj.untyped_storage()
                if st.data_ptr() != 0:
                    key = (obj.device.type, st.data_ptr())
                    seen[key] = max(seen.get(key, 0), st.nbytes())
            except (RuntimeError, ReferenceError):  # sparse, wrapper subclasses, dead weakrefs
                continue
    out: dict[str, int] = {}
    for (dev, _), n in seen.items():
        out[dev] = out.get(dev, 0) + n
    return out


def _batches(shape, rank: int, device, count: int = 4):
    """A few fixed token batches per rank (different on each rank), reused cyclically."""
    import torch

    g = torch.Generator().manual_seed(shape.seed + 1 + rank)
    tok = torch.randint(0, shape.vocab, (count, shape.micro, shape.seq + 1), generator=g)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tok]


def current_rss_bytes() -> int:
    """Resident set size now (``VmRSS``), 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cuda_peaks(torch) -> dict[str, int]:
    return {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
    }


def run(spec: dict) -> dict:
    import torch
    from _spec import from_json
    from _trainers import build_model, build_trainer

    from zero_offload.models.gpt2 import GPT2Config, flops_per_token, num_parameters

    shape, run_ = from_json(spec)
    torch.set_num_threads(_threads())
    rank = int(os.environ.get("RANK", "0"))
    # ZERO_OFFLOAD_DEVICE=cpu (the engine's own switch) keeps every implementation on the CPU.
    cuda = torch.cuda.is_available() and os.environ.get("ZERO_OFFLOAD_DEVICE") != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if run_.impl == "torch" and run_.world > 1:
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rss_start = peak_rss_bytes()

    cfg = GPT2Config(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        seq_length=shape.seq,
        vocab_size=shape.vocab,
        checkpoint_activations=shape.checkpoint,
    )
    t_init = time.perf_counter()
    model = build_model(cfg, shape, run_, device)
    trainer = build_trainer(model, shape, run_, device)
    sync()
    init_s = time.perf_counter() - t_init
    batches = _batches(shape, rank, device)
    cuda_init = _cuda_peaks(torch) if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # from here: the steps' peak

    wall, cpu, losses = [], [], []
    for i in range(shape.warmup + shape.steps):
        step_batches = [batches[(i * shape.gas + k) % len(batches)] for k in range(shape.gas)]
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = trainer.step(step_batches)
        sync()
        t1, c1 = time.perf_counter(), time.process_time()
        losses.append(float(loss))  # after the clock: the read is not part of the step
        if i >= shape.warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
    rss_steady = current_rss_bytes()
    cuda_steps = _cuda_peaks(torch) if cuda else None
    live = live_tensor_bytes()  # steady state: the delayed update still holds its next step
    trainer.finish()
    acct = trainer.accounting()
    out = {
        "rank": rank,
        "params": num_parameters(cfg),
        # Model FLOPs per token (6N + attention); the recompute adds one forward (a third).
        "flops_per_token": flops_per_token(cfg),
        "recompute": shape.checkpoint,
        "wall": wall,
        "cpu": cpu,
        "losses": losses,
        "init_s": init_s,
        "peak_rss": peak_rss_bytes(),
        "rss_after_imports": rss_start,
        "rss_steady": rss_steady,
        "live": live,
        "threads": torch.get_num_threads(),
        "info": trainer.info,
        "accounted": acct[0] if acct else None,
        "expected": acct[1] if acct else None,
        "cuda": None
        if not cuda
        else {
            "name": torch.cuda.get_device_name(device),
            "total": torch.cuda.get_device_properties(device).total_memory,
            "peak_init": cuda_init,
            "peak_steps": cuda_steps,
        },
    }
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--prebuild-deepspeed"]:
        import _ds_compat

        print("built:", ", ".join(_ds_compat.prebuild(argv[1:])))
        return 0
    if len(argv) != 2:
        print(
            "usage: _step_worker.py SPEC_JSON OUT_JSON | --prebuild-deepspeed [OP ...]",
            file=sys.stderr,
        )
        return 2
    spec, out_path = json.loads(argv[0]), Path(argv[1])
    if spec["run"]["impl"] == "deepspeed":
        import _ds_compat

        _ds_compat.select_accelerator()
    result = run(spec)
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
