"""``zero-offload env``: report the package, torch, devices, distributed backends, the
active host update kernel (its ISA, SIMD width and thread count) and the DeepSpeed opt-in
(``ZERO_OFFLOAD_AS_DEEPSPEED``: active or not, and whether a real DeepSpeed is installed)."""

from __future__ import annotations

import argparse
import json
import platform


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def _package_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("zero_offload")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    try:
        import zero_offload

        return getattr(zero_offload, "__version__", "unknown (not installed)")
    except Exception:
        return "unknown (not installed)"


def collect() -> dict:
    import torch
    import torch.distributed as dist

    from zero_offload.kernels import host_adam

    info: dict = {
        "zero_offload": _package_version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [],
    }
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda_devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / 2**30, 1),
                }
            )
    backends = {}
    if dist.is_available():
        backends = {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        }
    info["distributed_available"] = dist.is_available()
    info["distributed_backends"] = backends
    try:
        info["host_adam"] = host_adam.kernel_info()
    except Exception as exc:  # e.g. a bad ZERO_OFFLOAD_KERNEL value
        info["host_adam"] = {"error": f"{type(exc).__name__}: {exc}"}
    info["torch_threads"] = torch.get_num_threads()
    from zero_offload._as_deepspeed import status

    info["deepspeed_opt_in"] = status()
    return info


def run(args: argparse.Namespace) -> int:
    info = collect()
    if getattr(args, "json", False):
        print(json.dumps(info, indent=2))
        return 0
    k = info["host_adam"]
    devices = (
        ", ".join(
            f"cuda:{d['index']} {d['name']} (sm {d['capability']}, {d['memory_gib']} GiB)"
            for d in info["cuda_devices"]
        )
        or "none"
    )
    backends = ", ".join(name for name, ok in info["distributed_backends"].items() if ok) or "none"
    lines = [
        f"zero_offload      {info['zero_offload']}",
        f"python            {info['python']} ({info['platform']})",
        f"torch             {info['torch']} (CUDA build: {info['torch_cuda_build'] or 'none'}, "
        f"intra-op threads: {info['torch_threads']})",
        f"CUDA available    {info['cuda_available']}",
        f"CUDA devices      {devices}",
        f"dist backends     {backends}",
    ]
    if "error" in k:
        lines.append(f"host Adam kernel  error: {k['error']}")
    else:
        lines.append(
            f"host Adam kernel  {k['kernel']}" + (f" ({k['reason']})" if k["reason"] else "")
        )
        lines.append(
            f"  ISA             {k['isa']} (supported: "
            f"{', '.join(k.get('supported_isas') or []) or 'n/a'})"
        )
        lines.append(f"  SIMD width      {k['simd_width']} fp32 lanes")
        lines.append(f"  threads         {k['threads']} (cores available / LOCAL_WORLD_SIZE)")
    ds = info["deepspeed_opt_in"]
    real = ds["real_deepspeed"]
    lines.append(
        "deepspeed opt-in  "
        + (
            f"active ({ds['source']}): 'import deepspeed' is zero_offload, version "
            f"{ds['reported_version']}"
            if ds["active"]
            else "off (set ZERO_OFFLOAD_AS_DEEPSPEED=1 to use zero_offload as deepspeed)"
        )
    )
    lines.append(
        "  real DeepSpeed  "
        + (
            f"{real['version']} at {real['location']}"
            + (" (shadowed by the opt-in)" if ds["active"] else "")
            if real
            else "not installed"
        )
    )
    print("\n".join(lines))
    return 0
