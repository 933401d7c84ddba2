"""Train the parity model (tests/parity.py) in bf16 with ZeRO + offload_optimizer "cpu", under
DeepSpeed itself or this project, and write each case's per-step losses and host bytes per
param as JSON: ``tests/test_compact_states_deepspeed.py`` compares the two.

    python tests/compact_states_run.py OUT --impl deepspeed|zero_offload [--gas N]
        [--emulate project|deepspeed] CASE [CASE ...]

A CASE is ``STAGE:STATES[:GAS]``: STAGE 2 or 3; STATES ``bf16`` (``bf16_master_weights_and_grads``
+ ``bf16_optimizer_states``: master, gradients and both Adam moments in bf16) or ``fp32`` (plain
bf16 training: fp32 master and moments); GAS, micro-steps per step, overrides ``--gas``. Every
case starts from the same fp32-initialized model (seed 0) and trains on the same batches; one
process, gloo, on the CPU. DeepSpeed is imported only with ``--impl deepspeed`` (a subprocess of
the test), so the project's run never sees its modules.

``--emulate SOURCE`` (zero_offload only): the project's engine with its host Adam kernel replaced
by ``tests/cpu_adam_arith.py``'s numpy model of the same per-element arithmetic, with the
per-step coefficients formed as SOURCE forms them: ``project`` reproduces the project's losses
bitwise, ``deepspeed`` DeepSpeed's, with or without gradient accumulation, which shows those
coefficients to be the only difference between the two runs.

Host bytes (stage 2): DeepSpeed's are read from its optimizer's own tensors
(``runtime/zero/stage_1_and_2.py``: the master partition ``single_partition_of_fp32_groups[i]``
in ``master_weights_and_grads_dtype``, its ``.grad`` (the offloaded gradient), the CPU Adam's
``exp_avg`` / ``exp_avg_sq``, and the 16-bit staging copy
``param_buffer_of_bit16_for_cpu_offload_groups[i]`` it copies the master through to the
params); the project's from ``engine.memory_report()``."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from parity import batches, engine_config, global_step, make_model  # noqa: E402

STEPS, MICRO, GAS = 12, 4, 1
BF16_STATES = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def config(stage: int, states: str, gas: int = GAS) -> dict:
    """The one config both run: bf16, AdamW, offload_optimizer "cpu"; stage 3 partitions every
    param (persistence threshold 0) and computes its linears with torch's own
    (``memory_efficient_linear`` false): DeepSpeed's memory-efficient linear
    (``runtime/zero/linear.py``) forms ``input.matmul(weight.t()) + bias`` for 3-D inputs, whose
    bf16 rounding differs from torch's linear (the project's gives torch's), so with it the two
    runs differ from the first forward on, before any optimizer state exists."""
    if states not in ("bf16", "fp32"):
        raise ValueError(f"states must be 'bf16' or 'fp32', got {states!r}")
    cfg = engine_config(stage, True, gas, MICRO, 0.0, False, "bf16", bucket=10**6,
                        zero_extra={"stage3_param_persistence_threshold": 0})  # fmt: skip
    cfg["zero_optimization"]["allgather_bucket_size"] = 10**6
    if stage == 3:
        cfg["zero_optimization"]["memory_efficient_linear"] = False
    if states == "bf16":
        cfg["bf16"].update(BF16_STATES)
    return cfg


def deepspeed_host_bytes(engine) -> dict[str, float]:
    """Bytes per element of DeepSpeed's stage-2 offload partition, by tensor and dtype."""
    opt = engine.optimizer
    masters = opt.single_partition_of_fp32_groups
    numel = sum(m.numel() for m in masters)

    def size(ts) -> float:
        return sum(t.numel() * t.element_size() for t in ts) / numel

    moments = [opt.optimizer.state[m] for m in masters]
    return {
        "master": size(masters),
        "grad": size(m.grad for m in masters),
        "exp_avg": size(s["exp_avg"] for s in moments),
        "exp_avg_sq": size(s["exp_avg_sq"] for s in moments),
        "staging_16bit": size(opt.param_buffer_of_bit16_for_cpu_offload_groups),
        "dtypes": _dtypes(masters[0], moments[0]),
    }


def deepspeed_stage3_dtypes(engine) -> list[str]:
    """The dtypes of DeepSpeed's stage-3 master partition, its gradient and the moments."""
    opt = engine.optimizer
    master = opt.fp32_partitioned_groups_flat[0]
    return _dtypes(master, opt.optimizer.state[master])


def _dtypes(master: torch.Tensor, state: dict) -> list[str]:
    """master, its gradient, exp_avg, exp_avg_sq."""
    tensors = (master, master.grad, state["exp_avg"], state["exp_avg_sq"])
    return [str(t.dtype) if t is not None else "None" for t in tensors]


def project_host_bytes(engine) -> dict[str, float]:
    """``engine.memory_report()``'s host entries per element of the optimizer's shard."""
    report = engine.memory_report()
    numel = sum(og.optimizer.state.numel for og in engine.opt_groups)
    return {
        k: v / numel for k, v in report.items() if k.startswith("host.") and "allocator" not in k
    }


def parse_case(case: str, gas: int = GAS) -> tuple[int, str, int]:
    """``STAGE:STATES[:GAS]`` -> (stage, states, gas); ``gas`` where the case names none."""
    parts = case.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("2", "3") or parts[1] not in ("bf16", "fp32"):
        raise ValueError(f"case {case!r}: want STAGE:STATES[:GAS], STAGE 2|3, STATES bf16|fp32")
    if len(parts) == 3 and not (parts[2].isdigit() and int(parts[2]) >= 1):
        raise ValueError(f"case {case!r}: GAS must be an int >= 1, got {parts[2]!r}")
    return int(parts[0]), parts[1], int(parts[2]) if len(parts) == 3 else gas


def run_case(
    impl: str, stage: int, states: str, gas: int = GAS, emulate: str | None = None
) -> dict:
    """One case's losses and host bytes, with one intra-op thread (the forward's and backward's
    bf16 matmuls then reduce in one order, whichever process runs it). ``emulate``: the
    project's host kernel replaced by ``cpu_adam_arith.emulated_kernel(emulate)``."""
    if emulate is not None and impl != "zero_offload":
        raise ValueError("emulate: only with impl 'zero_offload'")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if emulate is None:
            return _run_case(impl, stage, states, gas)
        return _emulated(stage, states, gas, emulate)
    finally:
        torch.set_num_threads(threads)


def _emulated(stage: int, states: str, gas: int, source: str) -> dict:
    """The project's run with its host kernels (both state kinds) swapped for the emulation
    while the engine is built and trains (the update path takes its kernel when built)."""
    from cpu_adam_arith import emulated_kernel

    import zero_offload.runtime.update.paths.host_update as hu

    calls = [0]
    kernel = emulated_kernel(source, calls)
    saved = hu.adam_step_states, hu.host_adam_step
    hu.adam_step_states = hu.host_adam_step = kernel
    try:
        out = _run_case("zero_offload", stage, states, gas)
    finally:
        hu.adam_step_states, hu.host_adam_step = saved
    if calls[0] == 0:
        raise RuntimeError("the emulated kernel never ran: the host update no longer takes it")
    return out


def _run_case(impl: str, stage: int, states: str, gas: int) -> dict:
    cfg = config(stage, states, gas)
    model = make_model()  # fp32-initialized, seed 0; each engine casts it to bf16
    if impl == "deepspeed":
        import deepspeed

        initialize = deepspeed.initialize
    else:
        import zero_offload

        initialize = zero_offload.initialize
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = initialize(
            model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg)
        )
    losses = [global_step(engine, x, y) for x, y in batches(STEPS, 1, gas, MICRO)]
    out: dict = {"losses": losses}
    if impl == "deepspeed":
        out["bytes"] = deepspeed_host_bytes(engine) if stage == 2 else {}
        if stage == 3:
            out["dtypes"] = deepspeed_stage3_dtypes(engine)
    else:
        out["bytes"] = project_host_bytes(engine)
    return out


KERNEL_N, KERNEL_HYPER = (
    4133,
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
)


def kernel_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 params and a bf16 gradient spanning five decades (the kernel comparison's)."""
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(KERNEL_N, generator=g) * 0.1).bfloat16()
    scale = 10.0 ** torch.randint(-4, 1, (KERNEL_N,), generator=g).float()
    return p, (torch.randn(KERNEL_N, generator=g) * scale).bfloat16()


KERNEL_STEPS = 30


def kernel_grad(step: int) -> torch.Tensor:
    """Step ``step``'s bf16 gradient of the multi-step kernel comparison: ``kernel_inputs``'s
    gradient, each element scaled by its own factor drawn for that step."""
    g = torch.Generator().manual_seed(100 + step)
    base = kernel_inputs()[1].float()
    return (base * (1 + 0.5 * torch.randn(KERNEL_N, generator=g))).bfloat16()


def deepspeed_kernel_step() -> dict[str, torch.Tensor]:
    """One step of DeepSpeed's CPU Adam (AdamW, bf16 params, bf16 moments) on
    ``kernel_inputs``: the param and both moments after it."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p, grad = kernel_inputs()
    param = torch.nn.Parameter(p)
    opt = DeepSpeedCPUAdam([param], adamw_mode=True, fp32_optimizer_states=False, **KERNEL_HYPER)
    param.grad = grad
    opt.step()
    state = opt.state[param]
    return {"master": param.data, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def deepspeed_kernel_steps(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``KERNEL_STEPS`` steps of DeepSpeed's CPU Adam (AdamW) from ``kernel_inputs``'s params
    with ``kernel_grad(step)``: params and moments in ``dtype`` (bf16: its bf16 states; fp32: its
    fp32 kernel), the param and both moments after the last step."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(kernel_inputs()[0].to(dtype))
    fp32_states = dtype == torch.float32
    opt = DeepSpeedCPUAdam([param], adamw_mode=True, fp32_optimizer_states=fp32_states,
                           **KERNEL_HYPER)  # fmt: skip
    for step in range(1, KERNEL_STEPS + 1):
        param.grad = kernel_grad(step).to(dtype)
        opt.step()
    state = opt.state[param]
    return {"master": param.data, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--impl", choices=["deepspeed", "zero_offload"], required=True)
    ap.add_argument("--gas", type=int, default=GAS, help="micro-steps per optimizer step")
    ap.add_argument(
        "--kernel-out",
        help="deepspeed: also save its CPU Adam's results here (deepspeed_kernel_step() as "
        "'step1', deepspeed_kernel_steps() of bf16 and fp32 as 'steps_bf16', 'steps_fp32')",
    )
    ap.add_argument(
        "--emulate",
        choices=["project", "deepspeed"],
        help="zero_offload: the host kernel replaced by cpu_adam_arith's model of its arithmetic "
        "with these per-step coefficients",
    )
    ap.add_argument("cases", nargs="+", help="STAGE:STATES[:GAS], e.g. 2:bf16 3:fp32 2:bf16:2")
    args = ap.parse_args(argv)
    if args.emulate and args.impl != "zero_offload":
        ap.error("--emulate: only with --impl zero_offload")
    try:
        cases = {case: parse_case(case, args.gas) for case in args.cases}
    except ValueError as e:
        ap.error(str(e))
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        if args.kernel_out:
            kernel = {"step1": deepspeed_kernel_step()}
            for name, dt in (("steps_bf16", torch.bfloat16), ("steps_fp32", torch.float32)):
                kernel[name] = deepspeed_kernel_steps(dt)
            torch.save(kernel, args.kernel_out)
    results = {}
    for case, (stage, states, gas) in cases.items():
        results[case] = run_case(args.impl, stage, states, gas, args.emulate)
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
