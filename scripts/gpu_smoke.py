"""The GPU check's smoke step (``scripts/gpu_check.sh``): the installed package imports, the
DeepSpeed opt-in's ``.pth`` is in a site directory, both compiled modules load, and one tiny
stage-2 step with optimizer offload trains on the device the engine picks (the GPU where there is
one, else the CPU), as a world of one with no process group. With CUDA also a one-rank NCCL group
first: where it fails, that is reported (a problem) and the step still trains. Prints one
``SMOKE <json>`` line; exits non-zero when anything was missing or failed."""

from __future__ import annotations

import json
import math
import os
import site
import sys
from pathlib import Path
from typing import Any

PTH = "zero_offload_as_deepspeed.pth"


def installed() -> dict[str, Any]:
    """Where the package is imported from and which site directory holds the opt-in's .pth."""
    import zero_offload
    from zero_offload._native import load_optional
    from zero_offload.kernels.host_adam import kernel_info

    # site directories, and PYTHONPATH's where the install fell back to a target folder there
    dirs = dict.fromkeys([*site.getsitepackages(), site.getusersitepackages(), *sys.path])
    pth = [str(Path(d) / PTH) for d in dirs if d and (Path(d) / PTH).exists()]
    native = {}
    for name in ("zero_offload._host_adam", "zero_offload._aio"):
        module, why = load_optional(name)
        native[name] = "loaded" if module is not None else f"missing: {why}"
    return {
        "package": str(Path(zero_offload.__file__).parent),
        "pth": pth,
        "native": native,
        "host_adam": kernel_info(),
    }


def tiny_step() -> dict[str, Any]:
    """Two steps of a two-layer model at stage 2 with the optimizer on the host."""
    import torch

    import zero_offload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    engine, *_ = zero_offload.initialize(model=model, config=cfg)
    x = torch.randn(4, 64, device=engine.device)
    losses = []
    for _ in range(2):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"device": str(engine.device), "losses": losses}


def nccl_group() -> str:
    """A one-rank NCCL group and a barrier: a broken NCCL shows here, in seconds ("ok", else
    "failed: <error>"). Run before the engine's step and leaves no group behind, failed or not."""
    import torch
    import torch.distributed as dist

    launch = dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    saved = {k: os.environ.get(k) for k in launch}
    os.environ.update(launch)
    try:
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - any failure is the finding; the smoke goes on
        return f"failed: {type(e).__name__}: {e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return "ok"


def devices() -> dict[str, Any]:
    """torch's version, whether CUDA is there, and the GPU's name."""
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name()
    return out


def main() -> int:
    out = devices()
    out.update(installed())
    if out["cuda"]:
        out["nccl"] = nccl_group()
    out["step"] = tiny_step()
    import torch.distributed as dist

    out["step"]["process_group"] = dist.is_available() and dist.is_initialized()
    print("SMOKE " + json.dumps(out), flush=True)
    problems = [f"{k}: {v}" for k, v in out["native"].items() if v != "loaded"]
    if out.get("nccl", "ok") != "ok":
        problems.append(f"nccl: {out['nccl']} (the step trained without a process group)")
    if not out["pth"]:
        problems.append(f"{PTH} is in no site directory: the package is not installed")
    if not all(math.isfinite(x) for x in out["step"]["losses"]):
        problems.append(f"non-finite losses {out['step']['losses']}")
    for p in problems:
        print("SMOKE problem: " + p, flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
