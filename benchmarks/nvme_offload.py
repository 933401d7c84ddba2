"""NVMe offload, measured side by side in one run:

1. ``disk``: the disk's sequential O_DIRECT bandwidth (one thread, 1 MiB blocks, like
   ``dd oflag=direct``) and the aio engine's, on the same folder.
2. ``update``: the streamed update path (read record k+1 / host Adam over record k / write k-1)
   over an optimizer state of ``--update-m`` million elements, against the same kernel over the
   same state in host memory. Its throughput is given as a share of the disk's sequential
   read+write bandwidth measured in (1): moving 12 bytes/element in and 12 out takes at least
   ``12 n / read_bw + 12 n / write_bw`` on a disk that serves one direction at a time.
3. ``step``: a training step of a stage-3 model with the optimizer (and params) on NVMe against
   the same model with host offload; median step times and the ratio.
4. ``cap`` (needs root and a cgroup-v1 or v2 memory controller): the same stage-3 NVMe run in a
   child process confined to a memory cap of (optimizer state bytes) / ``--cap-ratio``; it must
   train, and its losses must equal the host-offload run's (which runs without the cap).

Every timing is a median of repetitions; the CPU and the folder's filesystem are printed.

    python benchmarks/nvme_offload.py --path /tmp/nvme-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from zero_offload.kernels.bench import _cpu_name as cpu_name

GIB = 2**30


def filesystem(path: Path) -> str:
    best = ("?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                if str(path.resolve()).startswith(mnt) and len(mnt) >= len(best[0]):
                    best = (mnt, f"{fs} on {dev}")
    except OSError:
        pass
    return best[1]


# ---- 1. the disk ---------------------------------------------------------------------------------
def disk(path: Path, gib: float, threads: int, queue_depth: int = 8) -> dict:
    from zero_offload.nvme.io.aio import AioPolicy, measure_disk_bandwidth

    policy = AioPolicy(threads=threads, queue_depth=queue_depth)
    runs = [measure_disk_bandwidth(path, int(gib * GIB), policy) for _ in range(3)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.endswith("gbps")}
    return med | {"backend": runs[0]["backend"], "direct": runs[0]["direct"]}


# ---- 2. the update path --------------------------------------------------------------------------
def update(path: Path, million: float, reps: int, threads: int) -> dict:
    from zero_offload.core.state.shard_state import MemoryState
    from zero_offload.kernels.host_adam import host_adam_step
    from zero_offload.nvme.io.aio import AioEngine, AioPolicy
    from zero_offload.nvme.optimizer_state import NvmeOptimizerState
    from zero_offload.runtime.update.placement import MAX_CHUNK

    n = int(million * 1e6) // 2048 * 2048
    grad = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    chunks = [(lo, min(lo + MAX_CHUNK, n)) for lo in range(0, n, MAX_CHUNK)]
    step = [0]

    def body(lo, hi, v):
        host_adam_step(v["master"], v["exp_avg"], v["exp_avg_sq"], grad[lo:hi], out[lo:hi],
                       step=step[0], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
                       weight_decay=0.0, adamw=True, bias_correction=True, grad_scale=1.0)  # fmt: skip

    def timed(state) -> list[float]:
        times = []
        for _ in range(reps + 1):
            step[0] += 1
            t0 = time.perf_counter()
            state.update(chunks, body)
            times.append(time.perf_counter() - t0)
        return times[1:]  # the first pass warms the pages and the pool

    aio = AioEngine(AioPolicy(threads=threads))
    nv = NvmeOptimizerState(path, "bench", n, MAX_CHUNK, 4, aio, pin=torch.cuda.is_available())
    nv.fill(lambda lo, hi, o: o.zero_())
    nvme_t = timed(nv)
    nv.close()
    mem = MemoryState(n, torch.device("cpu"), "host", moments=True)
    mem.master.zero_()
    host_t = timed(mem)
    del mem
    return {"numel": n, "nvme_s": nvme_t, "host_s": host_t}


# ---- 3/4. training steps -------------------------------------------------------------------------
def model_config(
    where: str, path: str, stage3_live: int, dtype: str = "bf16", aio: dict | None = None
) -> dict:
    """The step's config; ``aio``: DeepSpeed's ``aio`` section (both engines read it)."""
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": stage3_live,
        "stage3_prefetch_bucket_size": stage3_live,
        "stage3_max_reuse_distance": 0,  # release after use: host memory bounded by live
        "reduce_bucket_size": 5_000_000,
        "offload_optimizer": {"device": where},
        "offload_param": {"device": where},
    }
    if where == "nvme":
        zero["offload_optimizer"]["nvme_path"] = path
        # room for the read-ahead of the next buffer_count (5) units beside the one in use
        zero["offload_param"] |= {"nvme_path": path, "max_in_cpu": 6 * stage3_live}
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if aio:
        cfg["aio"] = aio
    return cfg


class Residual(torch.nn.Module):
    """x + W x / 8: deep stacks keep a signal (a plain stack of 32 Linears outputs ~0)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(x) * 0.125


def train_child(args) -> None:
    """One training run (this process): prints one JSON line with losses, step times, RSS."""
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    d, layers = args.dim, args.layers
    aio = json.loads(args.aio) if args.aio else None
    cfg = model_config(args.where, str(args.path), d * d, args.dtype, aio)
    dt = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    for block in ("offload_optimizer", "offload_param"):  # pinned staging where CUDA is
        cfg["zero_optimization"][block]["pin_memory"] = torch.cuda.is_available()
    if args.engine == "deepspeed":  # the anchor: DeepSpeed's own NVMe offload, same config
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import _ds_compat

        deepspeed = _ds_compat.one_process(_free_port())
        # The dtype comes from the config (bf16 enabled or not): DeepSpeed 0.19.8's Init
        # ignores a ``dtype`` passed with a config on an accelerator without fp16 (a CPU) and
        # builds bf16 params, which an fp32 input then fails to multiply.
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = torch.nn.Sequential(*[Residual(d) for _ in range(layers)])
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
    else:
        import zero_offload
        import zero_offload.zero

        with zero_offload.zero.Init(dtype=dt):
            model = torch.nn.Sequential(*[Residual(d) for _ in range(layers)])
        engine, *_ = zero_offload.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, d, generator=g).to(dt).to(engine.device)
    losses, times, update_times = [], [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = (engine(x).float() - 1.0).square().mean()
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's queued GPU work belongs to its time
        times.append(time.perf_counter() - t0)
        update_times.append(time.perf_counter() - t1)  # step() alone: the update
        losses.append(float(loss))
    report = engine.memory_report() if hasattr(engine, "memory_report") else {}
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    gpu_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    print(json.dumps({"losses": losses, "times": times, "update_times": update_times,
                      "peak_rss": hwm, "gpu_peak": gpu_peak, "memory": report}))  # fmt: skip
    # No destroy(): at stage 3 it hands the params back to zero.Init form, the whole model in
    # host memory (what a later engine starts from), which is not what is measured here. The
    # swap files go at exit.


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cgroup(cap: int) -> tuple[Path, str] | None:
    """A memory cgroup limited to ``cap`` bytes (v2 or v1), or None where none can be made."""
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    try:
        if v2.exists():
            cg = Path("/sys/fs/cgroup/zero_offload_nvme_bench")
            cg.mkdir(exist_ok=True)
            (cg / "memory.max").write_text(str(cap))
            (cg / "memory.swap.max").write_text("0")
            return cg, "cgroup v2 memory.max"
        cg = Path("/sys/fs/cgroup/memory/zero_offload_nvme_bench")
        cg.mkdir(exist_ok=True)
        (cg / "memory.limit_in_bytes").write_text(str(cap))
        (cg / "memory.max_usage_in_bytes").write_text("0")  # the peak of this run only
        return cg, "cgroup v1 memory.limit_in_bytes"
    except OSError:
        return None


def run_child(
    args, where: str, cap: int | None = None, engine: str = "zero_offload", python: str = ""
) -> dict:
    """One training run in a fresh process of ``python`` (default: this interpreter); its
    ``src`` is on the path, so an interpreter of another environment (DeepSpeed's) runs it."""
    cmd = [python or sys.executable, __file__, "--child", "--where", where, "--path",
           str(args.path), "--dim", str(args.dim), "--layers", str(args.layers), "--steps",
           str(args.steps), "--engine", engine, "--dtype", getattr(args, "dtype", "bf16"),
           "--aio", getattr(args, "aio", "") or ""]  # fmt: skip
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])}  # fmt: skip
    how = None
    pre = None
    if cap is not None:
        made = _cgroup(cap)
        if made is None:
            return {"error": "no memory cgroup could be made (needs root and a memory controller)"}
        cg, how = made

        def pre() -> None:  # in the child, before exec: join the capped group
            (cg / "cgroup.procs").write_text(str(os.getpid()))

    try:
        p = subprocess.run(
            cmd, capture_output=True, text=True, preexec_fn=pre, timeout=args.run_timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.run_timeout:.0f} s", "cap_how": how}
    peak = _cgroup_peak(cg) if cap is not None else None
    if p.returncode != 0:
        tail = p.stderr[-1500:] or "(killed: no output)"
        return {"error": f"exit {p.returncode}: {tail}", "cap_how": how, "cgroup_peak": peak}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return out | {"cap_how": how, "cgroup_peak": peak}


def _cgroup_peak(cg: Path) -> int | None:
    """The group's peak memory charge (anonymous and file pages, kernel memory in v1)."""
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            return int((cg / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--path", type=Path, default=Path("nvme-bench"))
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--update-m", type=float, default=64.0, help="million state elements")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="aio threads (intra_op_parallelism)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cap-ratio", type=float, default=3.0)
    ap.add_argument("--run-timeout", type=float, default=1200, help="seconds per training run")
    ap.add_argument("--skip", nargs="*", default=[], choices=["disk", "update", "step", "cap"])
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--where", default="nvme")
    ap.add_argument("--engine", default="zero_offload", choices=["zero_offload", "deepspeed"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--aio", default="", help="child: the config's aio section, as JSON")
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's NVMe offload")
    args = ap.parse_args()
    args.path.mkdir(parents=True, exist_ok=True)
    if args.child:
        return train_child(args)

    from zero_offload.nvme.io.aio import io_uring_available

    print(f"cpu: {cpu_name()} ({os.cpu_count()} cores); torch {torch.__version__}")
    print(f"folder: {args.path} ({filesystem(args.path)}); io_uring available: "
          f"{io_uring_available()}")  # fmt: skip
    bw = None
    if "disk" not in args.skip:
        bw = disk(args.path, args.disk_gib, args.threads)
        print(f"\n[disk] {args.disk_gib:g} GiB, medians of 3 (GB/s): sequential O_DIRECT baseline "
              f"write {bw['baseline_write_gbps']:.2f} read {bw['baseline_read_gbps']:.2f}; "
              f"aio engine ({bw['backend']}, {args.threads} thread(s)) write "
              f"{bw['write_gbps']:.2f} read {bw['read_gbps']:.2f}")  # fmt: skip
    if "update" not in args.skip:
        u = update(args.path, args.update_m, args.reps, args.threads)
        nv, host = statistics.median(u["nvme_s"]), statistics.median(u["host_s"])
        moved = 12 * u["numel"]
        print(f"\n[update] {u['numel'] / 1e6:.1f}M elements, state {moved / GIB:.2f} GiB, "
              f"median of {args.reps}: nvme {nv:.3f} s, host {host:.3f} s, "
              f"nvme/host {nv / host:.2f}x")  # fmt: skip
        if bw is not None:
            floor = moved / (bw["baseline_read_gbps"] * 1e9) + moved / (
                bw["baseline_write_gbps"] * 1e9
            )
            print(f"  disk-bound floor {floor:.3f} s (12 B/elem read + write at the baseline): "
                  f"the update path runs at {100 * floor / nv:.0f}% of the disk's sequential "
                  f"read+write bandwidth")  # fmt: skip
    params = args.dim * args.dim * args.layers
    state = 12 * params
    host_run = None
    if "step" not in args.skip or "cap" not in args.skip:
        host_run = run_child(args, "cpu")
    if "step" not in args.skip:
        nv_run = run_child(args, "nvme")
        ds_run = run_child(args, "nvme", engine="deepspeed") if args.deepspeed else None
        print(f"\n[step] stage 3, bf16, {params / 1e6:.0f}M params ({args.layers} x Linear "
              f"{args.dim}), optimizer state {state / GIB:.2f} GiB, {args.steps} steps")  # fmt: skip
        runs = [("host offload", host_run), ("nvme offload", nv_run)]
        runs += [("DeepSpeed nvme", ds_run)] if ds_run is not None else []
        for name, r in runs:
            if "error" in r:
                print(f"  {name}: {r['error']}")
                continue
            gpu = f"  GPU peak {r['gpu_peak'] / GIB:.2f} GiB" if r.get("gpu_peak") else ""
            print(f"  {name:13} median step {statistics.median(r['times'][1:] or r['times']):.2f} s"
                  f"  peak RSS {r['peak_rss'] / GIB:.2f} GiB{gpu}  losses {r['losses']}")  # fmt: skip
        if "error" not in host_run and "error" not in nv_run:
            a = statistics.median(nv_run["times"][1:] or nv_run["times"])
            b = statistics.median(host_run["times"][1:] or host_run["times"])
            print(f"  nvme/host step time {a / b:.2f}x; losses equal: "
                  f"{nv_run['losses'] == host_run['losses']}")  # fmt: skip
        if ds_run is not None and "error" not in ds_run and "error" not in nv_run:
            a = statistics.median(nv_run["times"][1:] or nv_run["times"])
            c = statistics.median(ds_run["times"][1:] or ds_run["times"])
            print(f"  DeepSpeed nvme / zero_offload nvme step time {c / a:.2f}x")
    if "cap" not in args.skip:
        cap = int(state / args.cap_ratio)
        r = run_child(args, "nvme", cap)
        print(f"\n[cap] optimizer state {state / GIB:.2f} GiB, memory cap {cap / GIB:.2f} GiB "
              f"(state / {args.cap_ratio:g}) via {r.get('cap_how')}")  # fmt: skip
        if r.get("cgroup_peak"):
            print(f"  the group's peak charge: {r['cgroup_peak'] / GIB:.2f} GiB")
        if "error" in r:
            print(f"  capped nvme run failed: {r['error']}")
        else:
            same = "error" not in host_run and r["losses"] == host_run["losses"]
            print(f"  trained {len(r['losses'])} steps under the cap, peak RSS "
                  f"{r['peak_rss'] / GIB:.2f} GiB; losses {r['losses']}; equal to the "
                  f"uncapped host-offload run: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
