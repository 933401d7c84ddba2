"""pytest plugin: DeepSpeed's own ``tests/unit`` on CPU ranks over gloo, against zero_offload.

Loaded with ``-p plugin`` (``run_selection.py`` does it) in a pytest run over an extracted
``tests/unit`` of DeepSpeed's repository, with ``ZERO_OFFLOAD_AS_DEEPSPEED=1`` so that
``import deepspeed`` is zero_offload's namespace. It adapts DeepSpeed's ``DistributedTest``
harness (``unit/common.py``) to a machine without GPUs and nothing else:

* every test's world size is capped at ``DS_UNIT_MAX_WORLD`` (default 2) ranks, each a CPU
  process on gloo (the harness's GPU-count skip is removed: a CPU "device" holds any number);
* the process pool is not reused between tests (each test gets fresh ranks, as a user's
  script does);
* the tests' reference ``DistributedDataParallel(..., device_ids=[i], output_device=i)`` drops
  the device ids for a CPU module (torch's form for one), as gloo replaces nccl, and the
  harness's ``reduce_boolean_flags`` puts its flags on the device by name, not by index (an
  index is a GPU to torch).

* the harness's own helper modules (``unit/common.py``, ``unit/util.py``, ``unit/simple_model.py``,
  ``unit/checkpoint/common.py``) import a few DeepSpeed names at import time that are not part of
  what zero_offload implements (pipeline and MoE classes, DeepSpeed's optimizer classes for
  ``isinstance`` checks, version info): :func:`_install_harness_stand_ins` gives those names inert
  stand-ins, so that a test fails on what it uses, not on what its helper module imports.

Test bodies are not changed: a failure is the namespace's answer to DeepSpeed's test.
"""

from __future__ import annotations

import os

import pytest

MAX_WORLD = int(os.environ.get("DS_UNIT_MAX_WORLD", "2"))


def _cap(world_size):
    if isinstance(world_size, int):
        return min(world_size, MAX_WORLD)
    return sorted({min(w, MAX_WORLD) for w in world_size})


class _StandIn:
    """An inert class for a harness-only import; instantiating it says so."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"{type(self).__name__}: harness stand-in (not provided)")


def _stand_in_module(name: str, **attrs) -> None:
    import importlib
    import sys
    import types

    try:
        module = importlib.import_module(name)
    except ImportError:
        module = types.ModuleType(name)
        sys.modules[name] = module
    for attr, value in attrs.items():
        if attr not in vars(module):
            setattr(module, attr, value)


def _no_moe_groups(param_groups, max_group_size=None) -> list:
    if isinstance(param_groups, dict):
        return [param_groups]
    return list(param_groups)


def _install_harness_stand_ins() -> None:
    """Names the harness's helper modules import (never what a test body uses)."""
    import torch

    def cls(name: str) -> type:
        return type(name, (_StandIn,), {})

    _stand_in_module("deepspeed.accelerator", is_current_accelerator_supported=lambda: True)
    cuda = getattr(torch.version, "cuda", None)
    _stand_in_module(
        "deepspeed.git_version_info",
        torch_info={
            "version": torch.__version__,
            "cuda_version": cuda or "0.0",
            "nccl_version": "0.0",  # no NCCL on CPU ranks (as DeepSpeed's CPU build records)
            "hip_version": "0.0",
        },
    )
    _stand_in_module(
        "deepspeed.pipe", PipelineModule=cls("PipelineModule"), LayerSpec=cls("LayerSpec")
    )
    _stand_in_module("deepspeed.moe")
    _stand_in_module("deepspeed.moe.layer", MoE=cls("MoE"))
    # unit/checkpoint/common.py passes every model's params through the MoE splitter; without
    # MoE params it returns the groups as a list (DeepSpeed's function does the same)
    _stand_in_module(
        "deepspeed.moe.utils", split_params_into_different_moe_groups_for_optimizer=_no_moe_groups
    )
    _stand_in_module("deepspeed.runtime.fp16")
    for module, name in (
        ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
        ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
        ("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer"),
        ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
        ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),  # unit/v1/zero/test_zero.py
    ):
        _stand_in_module(module, **{name: cls(name)})
    _install_probe_stand_ins()


def _op_builder(name: str, compatible: bool) -> type:
    return type(name, (), {"NAME": name, "is_compatible": lambda self, verbose=False: compatible})


def _install_probe_stand_ins() -> None:
    """Capability probes the test files run at import or in skip checks: which DeepSpeed ops
    exist (zero_offload's host Adam answers for ``cpu_adam``, its NVMe I/O for ``async_io``;
    there is no Lamb) and the torch version check."""
    import deepspeed
    import torch
    from packaging import version

    builders = {
        "CPUAdamBuilder": "cpu_adam",
        "FusedAdamBuilder": "fused_adam",
        "FusedLambBuilder": "fused_lamb",
    }
    compatible = {"cpu_adam": True, "fused_adam": True, "fused_lamb": False, "async_io": True}
    _stand_in_module(
        "deepspeed.ops.op_builder",
        **{cls_name: _op_builder(op, compatible[op]) for cls_name, op in builders.items()},
    )
    # deepspeed.ops.aio's AsyncIOBuilder and the offload-device enum are the namespace's own
    if not hasattr(deepspeed.ops, "__compatible_ops__"):
        deepspeed.ops.__compatible_ops__ = compatible

    def required_torch_version(min_version=None, max_version=None) -> bool:
        ours = version.parse(torch.__version__.split("+")[0])
        if min_version and ours < version.parse(str(min_version)):
            return False
        return not (max_version and ours > version.parse(str(max_version)))

    _stand_in_module("deepspeed.utils.torch", required_torch_version=required_torch_version)


def install_stand_ins() -> None:
    """Both kinds of stand-ins (harness imports and capability probes); idempotent."""
    _install_harness_stand_ins()


def _cpu_ddp() -> None:
    """The tests' reference ``DistributedDataParallel(model, device_ids=[i], output_device=i)``
    is written for one GPU per rank; torch refuses ``device_ids`` for a CPU module. On CPU ranks
    they are dropped (torch's form for a CPU module), as the backend is gloo, not nccl."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "_zero_offload_cpu_ids", False):
        return
    original_init = DDP.__init__

    def init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        original_init(self, module, device_ids, output_device, *args, **kwargs)

    DDP.__init__ = init
    DDP._zero_offload_cpu_ids = True


def _reduce_boolean_flags(flag: bool, op=all) -> bool:
    """``unit.common.reduce_boolean_flags`` with its flag tensors on the current device by name:
    the original passes ``current_device()``, an index, which torch reads as a GPU."""
    import deepspeed.comm as dist
    import torch
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized():
        return flag
    device = get_accelerator().current_device_name()
    # one element, not a 0-d tensor: gloo's all-gather refuses 0-d inputs
    mine = torch.tensor([1 if flag else 0], dtype=torch.int, device=device)
    gathered = torch.zeros(dist.get_world_size(), dtype=torch.int, device=device)
    dist.all_gather_into_tensor(gathered, mine)
    return op(bool(f) for f in gathered.tolist())


def patch_harness(common) -> None:
    """Adapt DeepSpeed's ``unit.common`` module (in the pytest process and in every rank)."""
    exec_cls = common.DistributedExec
    if getattr(exec_cls, "_zero_offload_patched", False):
        return
    exec_cls._zero_offload_patched = True
    _cpu_ddp()
    common.reduce_boolean_flags = _reduce_boolean_flags
    original_launch = exec_cls._launch_with_file_store

    def launch_with_file_store(self, request, world_size):
        self.reuse_dist_env = False
        return original_launch(self, request, _cap(world_size))

    def launch_procs(self, num_procs, init_method):
        import torch.multiprocessing as mp

        mp.set_start_method("forkserver", force=True)
        if self.non_daemonic_procs:
            self._launch_non_daemonic_procs(num_procs, init_method)
        else:
            self._launch_daemonic_procs(num_procs, init_method)

    original_dist_run = exec_cls._dist_run

    def dist_run(self, *args, **kwargs):
        # pytest's ``fail``/``raises`` outcomes are BaseExceptions: a pool worker dies on them
        # and the pool waits forever. Hand them back as an ordinary exception instead.
        from _pytest.outcomes import Skipped

        try:
            return original_dist_run(self, *args, **kwargs)
        except Skipped:
            raise
        except Exception:
            raise
        except BaseException as error:
            raise RuntimeError(f"{type(error).__name__}: {error}") from None

    dist_run.__name__ = dist_run.__qualname__ = "_dist_run"  # pickled by name into the ranks
    exec_cls._dist_run = dist_run
    exec_cls._launch_with_file_store = launch_with_file_store
    exec_cls._launch_procs = launch_procs
    exec_cls.backend = "gloo"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ZERO_OFFLOAD_AS_DEEPSPEED") != "1":
        raise pytest.UsageError("set ZERO_OFFLOAD_AS_DEEPSPEED=1: the run is against zero_offload")
    os.environ.setdefault("DS_DISABLE_REUSE_DIST_ENV", "1")
    install_stand_ins()
    from unit import common  # DeepSpeed's harness, importable from the rootdir

    patch_harness(common)
