"""Every GPU measurement in one call: the machine, the PCIe link, the overlap traces, the largest
model per mode, and throughput against plain PyTorch and DeepSpeed, into one report.

Parts (``--parts``, in this order; each a subprocess with its own time limit, so one failing part
does not stop the others):

- ``env``: GPU, driver, CPU, cores, host memory, torch/DeepSpeed versions, host Adam kernel;
- ``pcie``: ``pcie_bandwidth.py``, the link's measured peak per direction;
- ``overlap``: ``overlap_trace.py``, profiler traces of stage-2 offload (with and without the
  delayed update) and stage-3 param offload steps: busy fractions and overlaps;
- ``sizes``: ``model_size.py``, the largest GPT-2 per mode and what stops the next size;
- ``throughput``: ``engine_step.py`` at about 1.5B params (GPT-2 XL shape), model TFLOPS of the
  engine's no-offload, offload, delayed-update and stage-3 modes against plain PyTorch and
  DeepSpeed's same modes;
- ``throughput_large``: the same for the largest offload size ``sizes`` found (or
  ``--large-layers/--large-hidden/--large-heads``), offload modes only;
- ``nvme``: ``nvme_offload.py`` on the machine's disk (``--nvme-path``): disk and update-path
  bandwidth, a stage-3 step with both states on NVMe against host offload and DeepSpeed's NVMe
  offload (pinned buffers, uploads from the swap buffers), and the memory-cap run.

Writes ``OUT/gpu_suite.md`` (the tables, with the date and the device) and ``OUT/gpu_suite.json``
(everything), and each part's own JSON and log beside them; prints the Markdown last.

    python benchmarks/gpu_suite.py --out results/                        # the whole suite (GPU)
    python benchmarks/gpu_suite.py --out results/ --parts env pcie overlap
    python benchmarks/gpu_suite.py --tiny --out /tmp/suite               # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

PARTS = ("env", "pcie", "overlap", "sizes", "throughput", "throughput_large", "nvme")

# The ~1.5B model of the throughput part: GPT-2 XL's shape (48 x 1600, 25 heads of 64).
XL = dict(layers=48, hidden=1600, heads=25)
THROUGHPUT_MODES = ("0:-", "2:cpu", "2:cpu+delayed", "3:cpu+param")
LARGE_MODES = ("2:cpu", "2:cpu+delayed", "3:cpu+param")
# DeepSpeed's offload modes only: its no-offload run needs FusedAdam, a CUDA build of minutes;
# plain PyTorch and the engine's stage 0 are the no-offload anchors.
DEEPSPEED_MODES = ("2:cpu", "3:cpu+param")


def _sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def env_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    from zero_offload.kernels.host_adam import kernel_info

    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cores": len(os.sched_getaffinity(0)),
        "host_adam": kernel_info(),
    }
    cpu = [ln for ln in _sh(["lscpu"]).splitlines() if ln.startswith("Model name")]
    info["cpu"] = cpu[0].split(":", 1)[1].strip() if cpu else platform.processor()
    with open("/proc/meminfo") as f:
        info["host_mem_gib"] = int(f.readline().split()[1]) / 2**20
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = p.name
        info["gpu_mem_gib"] = p.total_memory / 2**30
        info["nvidia_smi"] = _sh(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max,"
                "clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ]
        )
    try:
        from importlib.metadata import version

        info["deepspeed"] = version("deepspeed")
    except Exception:  # not installed: the DeepSpeed rows say so
        info["deepspeed"] = None
    return info


def part_commands(args: argparse.Namespace, out: Path, largest: dict | None) -> dict[str, list]:
    """The command line of every part but ``env`` (``largest``: the ``sizes`` part's result)."""
    py = [sys.executable]
    tiny = args.tiny
    shape = (
        ["--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64", "--micro", "2"]
        + ["--vocab", "256", "--steps", "2", "--warmup", "1"]
        if tiny
        else [
            *("--layers", str(XL["layers"]), "--hidden", str(XL["hidden"])),
            *("--heads", str(XL["heads"]), "--seq", "1024", "--micro", str(args.micro)),
            *("--vocab", "50257", "--steps", "4", "--warmup", "2"),
        ]
    )
    common = ["--checkpoint", "--zero-init", "--dtype", "bf16" if not tiny else "fp32"]
    common += ["--world", "1", "--gas", str(args.gas), "--timeout", str(args.run_timeout)]
    common += ["--host-reserve-gib", "3", "--deepspeed-modes", *DEEPSPEED_MODES]
    impls = ["torch", "engine"] + ([] if tiny or args.no_deepspeed else ["deepspeed"])
    cmds: dict[str, list] = {
        "pcie": py + [str(HERE / "pcie_bandwidth.py"), "--json", str(out / "pcie.json")],
        # Its traces and summary.json land in OUT/traces.
        "overlap": py
        + [str(HERE / "overlap_trace.py"), "--out", str(out / "traces")]
        + (["--device", "cpu"] if tiny else []),
        "sizes": py
        + [str(HERE / "model_size.py"), "--json", str(out / "sizes.json")]
        + (["--modes", *args.size_modes] if args.size_modes else [])
        + (["--tiny", "--max-runs", "2"] if tiny else []),
        "nvme": py
        + [str(HERE / "nvme_offload.py"), "--path", str(args.nvme_path)]
        + [*("--threads", str(args.nvme_threads), "--run-timeout", str(args.run_timeout))]
        + (
            "--dim 256 --layers 4 --steps 2 --update-m 1 --disk-gib 0.0625 --reps 1 --skip cap".split()
            if tiny
            else ["--layers", str(args.nvme_layers)]
            + ([] if args.no_deepspeed else ["--deepspeed"])
        ),
        "throughput": py
        + [str(HERE / "engine_step.py"), *shape, *common]
        + ["--impls", *impls, "--modes", *THROUGHPUT_MODES]
        + ["--json", str(out / "throughput.json")],
    }
    large = _large_shape(args, largest)
    if large is not None:
        cmds["throughput_large"] = (
            py + [str(HERE / "engine_step.py"), *common]
            + [*("--layers", str(large["layers"]), "--hidden", str(large["hidden"]))]
            + [*("--heads", str(large["heads"]), "--seq", "64" if tiny else "1024")]
            + [*("--micro", str(args.micro), "--vocab", "256" if tiny else "50257")]
            + ["--steps", "2" if tiny else "3", "--warmup", "1"]
            + ["--impls", *[i for i in impls if i != "torch"], "--modes", *LARGE_MODES]
            + ["--json", str(out / "throughput_large.json")]
        )  # fmt: skip
    return cmds


def _large_shape(args: argparse.Namespace, largest: dict | None) -> dict | None:
    """The shape of ``throughput_large``: the flags, else the largest size that trained with
    optimizer offload (stage 2) in ``sizes``."""
    if args.large_layers:
        return dict(layers=args.large_layers, hidden=args.large_hidden, heads=args.large_heads)
    if not largest:
        return None
    row = next((r for r in largest["rows"] if r["mode"] == "stage2+opt" and "rung" in r), None)
    if row is None:
        return None
    return largest["meta"]["ladder"][row["rung"]]


def run_part(name: str, cmd: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """Run one part; its stdout/stderr go to ``OUT/NAME.log``. Returns status and time."""
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    print(f"== {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        # Its own session, so a timeout ends the part's workers too (they hold GPU memory).
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent, start_new_session=True
        )
        try:
            status = "ok" if proc.wait(timeout=timeout) == 0 else f"exit {proc.returncode}"
        except BaseException as e:  # a timeout, or the suite itself interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            status = f"timed out after {timeout:.0f} s"
    took = time.perf_counter() - t0
    print(f"== {name}: {status} ({took:.0f} s)", file=sys.stderr, flush=True)
    return {"status": status, "seconds": took, "command": cmd}


def _tables(log: Path) -> str:
    """The Markdown tables (and their heading lines) a part printed; ``nvme.log``, which prints
    no table, whole, as a code block."""
    if not log.exists():
        return ""
    lines = log.read_text(errors="replace").splitlines()
    if log.name == "nvme.log":
        return "\n".join(["```", *lines[-60:], "```"])
    keep = [ln for ln in lines if ln.startswith("|") or ln.startswith("GPT-2")]
    return "\n".join(keep)


def targets(throughput: dict | None) -> list[str]:
    """The issue's targets checked against one throughput table: every engine offload mode at
    least as fast as DeepSpeed's same mode (ratio <= 1), and the delayed update within 10% of
    the engine without offload (stage 0) where that ran."""
    if not throughput:
        return []
    rows = [r for r in throughput["rows"] if "error" not in r]
    out = []
    for r in rows:
        if r["impl"] == "engine" and r["offload"] != "-" and r.get("vs_deepspeed") is not None:
            ok = "meets" if r["vs_deepspeed"] <= 1.0 else "MISSES"
            out.append(
                f"- stage {r['stage']} {r['offload']}: {r['vs_deepspeed']:.2f}x DeepSpeed's step "
                f"time ({ok} the target <= 1.00)"
            )
    base = next((r for r in rows if r["impl"] == "engine" and r["offload"] == "-"), None)
    delayed = next((r for r in rows if r["offload"] == "cpu+delayed"), None)
    if base and delayed:
        ratio = delayed["median_s"] / base["median_s"]
        ok = "meets" if ratio <= 1.10 else "MISSES"
        out.append(
            f"- delayed update: {ratio:.2f}x the step time without offload ({ok} the target "
            "<= 1.10)"
        )
    return out


def link_use(pcie: dict | None, overlap: dict | None) -> list[str]:
    """Each overlap mode's achieved copy rate (bytes over the time a copy of that direction ran)
    against the link's measured pinned peak in that direction."""
    if not pcie or "peak_gbps" not in pcie or not overlap:
        return []
    peak = {"h2d": pcie["peak_gbps"].get("h2d_pinned"), "d2h": pcie["peak_gbps"].get("d2h_pinned")}
    out = []
    for mode, m in overlap.get("modes", {}).items():
        rates = ((m.get("summary") or {}).get("median") or {}).get("gbps") or {}
        parts = [
            f"{d.upper()} {rates[d]:.1f} GB/s = {100 * rates[d] / peak[d]:.0f}% of {peak[d]:.1f}"
            for d in ("h2d", "d2h")
            if rates.get(d) and peak.get(d)
        ]
        if parts:
            out.append(f"- {mode}: " + "; ".join(parts))
    return out


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def report(info: dict[str, Any], status: dict[str, Any], out: Path) -> str:
    """``gpu_suite.md``: heading with date and device, then each part's tables."""
    head = (
        f"## GPU suite, {info.get('date')}: {info.get('gpu', 'no GPU')} "
        f"({info.get('gpu_mem_gib', 0):.0f} GiB), {info.get('cpu')} x {info.get('cores')} cores, "
        f"{info.get('host_mem_gib', 0):.0f} GiB host; torch {info.get('torch')} "
        f"(CUDA {info.get('cuda')}), DeepSpeed {info.get('deepspeed')}, host Adam "
        f"{info['host_adam'].get('kernel')}/{info['host_adam'].get('isa')}"
    )
    parts = [head, ""]
    if info.get("nvidia_smi"):
        parts += [f"nvidia-smi: {info['nvidia_smi']}", ""]
    titles = {
        "pcie": "PCIe bandwidth (pcie_bandwidth.py)",
        "overlap": "Overlap (overlap_trace.py)",
        "sizes": "Largest model per mode (model_size.py)",
        "throughput": "Throughput at ~1.5B params (engine_step.py)",
        "throughput_large": "Throughput at the largest offload size (engine_step.py)",
        "nvme": "NVMe offload (nvme_offload.py)",
    }
    for name, title in titles.items():
        if name not in status:
            continue
        parts += [f"### {title}", "", f"status: {status[name]['status']}, "
                  f"{status[name]['seconds']:.0f} s", ""]  # fmt: skip
        text = _tables(out / f"{name}.log")
        if text:
            parts += [text, ""]
        if name == "overlap":
            use = link_use(_load(out / "pcie.json"), _load(out / "traces" / "summary.json"))
            if use:
                parts += ["Achieved copy rate against the link's pinned peak (pcie):", *use, ""]
        if name.startswith("throughput"):
            checks = targets(_load(out / f"{name}.json"))
            if checks:
                parts += ["Targets:", *checks, ""]
    return "\n".join(parts)


def write_report(info: dict[str, Any], status: dict[str, Any], out: Path) -> str:
    text = report(info, status, out)
    (out / "gpu_suite.md").write_text(text + "\n")
    (out / "gpu_suite.json").write_text(json.dumps({"env": info, "parts": status}, indent=1))
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for the report and logs")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke test)")
    p.add_argument("--micro", type=int, default=8, help="micro batch of the throughput runs")
    p.add_argument("--gas", type=int, default=4, help="micro-steps per step (throughput runs)")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument(
        "--size-modes",
        nargs="+",
        default=None,
        help="the sizes part's modes (default all three; one per call keeps a call short)",
    )
    p.add_argument("--large-layers", type=int, default=None)
    p.add_argument("--large-hidden", type=int, default=None)
    p.add_argument("--large-heads", type=int, default=None)
    p.add_argument("--nvme-path", type=Path, default=Path("/tmp/zero_offload_nvme_bench"),
                   help="a folder on the disk the nvme part swaps to")  # fmt: skip
    p.add_argument(
        "--nvme-layers",
        type=int,
        default=64,
        help="nvme part: Linear 4096 layers (64: 1.07B params; the cap run needs the state's "
        "third to exceed the host grad shard, the pools and CUDA's own memory)",
    )
    p.add_argument("--nvme-threads", type=int, default=4, help="nvme part: aio threads")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds per training run")
    p.add_argument("--part-timeout", type=float, default=1800, help="seconds per part")
    args = p.parse_args(argv)
    large = (args.large_layers, args.large_hidden, args.large_heads)
    if any(large) and not all(large):
        p.error("--large-layers, --large-hidden and --large-heads go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    info = env_info()
    (out / "env.json").write_text(json.dumps(info, indent=1))
    status: dict[str, Any] = {}
    for name in args.parts:
        if name == "env":
            continue
        if name == "throughput_large" and not args.large_layers:
            largest = _load(out / "sizes.json")
        else:
            largest = None
        cmds = part_commands(args, out, largest)
        if name not in cmds:
            status[name] = {"status": "skipped: no largest offload size (run sizes first, or "
                            "give --large-layers/--large-hidden/--large-heads)", "seconds": 0.0}  # fmt: skip
            continue
        status[name] = run_part(name, cmds[name], out, args.part_timeout)
        write_report(info, status, out)  # after every part: a cut-off call keeps the finished
    print(write_report(info, status, out))
    return 0 if all(s["status"] == "ok" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
