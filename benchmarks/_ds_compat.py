"""DeepSpeed as a benchmark anchor, on a machine without a GPU.

What it takes (DeepSpeed 0.19): the CPU accelerator (``DS_ACCELERATOR=cpu``, set before the first
``import deepspeed``; on a GPU machine DeepSpeed picks CUDA itself), and a gloo process group
(the CPU accelerator asks for oneCCL's ``ccl`` backend only when ``oneccl_bindings_for_pytorch``
is installed, so ``init_distributed(dist_backend="gloo")`` is explicit about it). Its ops are
JIT-compiled C++ the first time they are used (``fused_adam`` for stages 0-2 without offload, the
CPU accelerator's build of the same AVX Adam as ``cpu_adam``, which backs DeepSpeedCPUAdam under
offload), each tens of seconds, cached under the torch extensions directory; :func:`prebuild`
does it once, outside any timed run. A build killed half-way leaves a ``lock`` file in that
directory and every later build waits on it forever: delete the lock. The cache is keyed by the
sources' paths and flags, so two environments (virtual environments, checkouts) sharing one
extensions directory rebuild each other's ops on every load: give each its own
``TORCH_EXTENSIONS_DIR``.

DeepSpeed is never imported by the package; only these benchmark processes import it.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def select_accelerator() -> None:
    """Pick DeepSpeed's CPU accelerator when there is no GPU; must run before ``import deepspeed``."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def one_process(port: int):
    """``deepspeed`` as a process group of one (this process, gloo on a CPU): the launcher's
    variables DeepSpeed reads, then ``init_distributed`` (it would look for MPI otherwise)."""
    select_accelerator()
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend(), verbose=False)
    return deepspeed


def train_lm(engine, vocab: int, seq: int, steps: int) -> tuple[list[float], float]:
    """``steps`` steps of a causal LM on random tokens (seeded: the same batches for every
    engine), micro-batch 1; returns the losses and the seconds the steps took."""
    import time

    g = torch.Generator().manual_seed(1)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        x = torch.randint(0, vocab, (1, seq), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses, time.perf_counter() - start


def initialize(model: torch.nn.Module, model_parameters: list[dict], config: dict[str, Any]):
    """``deepspeed.initialize`` on this machine; returns DeepSpeed's engine."""
    select_accelerator()
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend(), verbose=False)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model_parameters, config=config
    )
    return engine


def optimizer_name(engine) -> str:
    """DeepSpeed's wrapper and the inner optimizer it chose, e.g. ``DeepSpeedZeroOptimizer(FusedAdam)``."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", None)
    if inner is None or inner is opt:
        return type(opt).__name__
    return f"{type(opt).__name__}({type(inner).__name__})"


BUILDERS = {"fused_adam": "FusedAdamBuilder", "cpu_adam": "CPUAdamBuilder"}


def prebuild(ops: list[str] | None = None) -> list[str]:
    """JIT-build the Adam ops the runs use (default both; names from :data:`BUILDERS`) and, on
    the CPU accelerator, its shared-memory comm op, so no timed run pays for a build."""
    select_accelerator()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    names = [BUILDERS[o] for o in (ops or list(BUILDERS))]
    if not torch.cuda.is_available():
        # ShareMemCommBuilder: the shared-memory collectives that DeepSpeed's torch backend loads
        # in init_distributed on the CPU accelerator (when the op is compatible; gloo otherwise).
        names.append("ShareMemCommBuilder")
    built = []
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or (
            name == "ShareMemCommBuilder"
            and not deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
        ):
            continue
        builder.load(verbose=False)
        built.append(f"{type(builder).__module__}.{type(builder).__name__}")
    return built
