"""``zero-offload estimate`` with a model shape: the step's peak per rank on the device and on the
host, by category, for every stage and placement (or the one a DeepSpeed config names), and
``--max-model``: the largest GPT/Llama that trains in given device, host and NVMe memory."""

from __future__ import annotations

import argparse
import dataclasses

from ...core.state.format import FP32, StateFormat
from ...runtime.plan.memory_model import StepShape, ZeroPlan, predict
from ...runtime.plan.model_shape import ModelShape
from ...runtime.plan.state_bytes import MODES, mode_format, modes_for, state_name
from ...runtime.plan.zenflow_memory import ZenFlowPlan

GB = 1e9
# (stage, optimizer, params) rows: every stage and placement.
PLACEMENTS = (
    (0, "device", "device"),
    (1, "device", "device"),
    (1, "host", "device"),
    (2, "device", "device"),
    (2, "host", "device"),
    (2, "nvme", "device"),
    (3, "device", "device"),
    (3, "host", "device"),
    (3, "host", "host"),
    (3, "nvme", "host"),
    (3, "nvme", "nvme"),
)
NAMES = {"device": "none", "host": "cpu", "nvme": "nvme"}
# Widths and head counts of the shapes --max-model tries (GPT-3's table), layers searched.
WIDTHS = ((768, 12), (1024, 16), (1536, 16), (2048, 16), (2560, 32), (4096, 32), (5120, 40),
          (6144, 48), (8192, 64), (12288, 96))  # fmt: skip
# A CPU run's host memory beyond the engine's states and working set, measured at a 220M and a
# 1.06B Llama (stage 3, both offloads, fp32): malloc's free heap, the report's
# ``peak.host.allocator_free`` (0.83 and 0.88 GiB, not growing with the model), and the process
# itself (interpreter, torch and their libraries: 0.3 GiB). With both states on NVMe the free
# heap is smaller (0.60 GiB at a 2.60B Llama), so the same term is a little conservative there.
CPU_PROCESS_BYTES = int(1.2 * 2**30)
MAX_LAYERS = 128  # deeper than any of those models: a plausible shape, not a 500-layer tower


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--micro-batch", type=int, help="micro batch per rank (default: --config's, or 1)"
    )
    p.add_argument("--checkpoint-activations", action="store_true")
    p.add_argument("--cpu-checkpointing", action="store_true",
                   help="with --checkpoint-activations: the layer inputs in host memory "
                   "(activation_checkpointing.cpu_checkpointing; default: --config's)")  # fmt: skip
    p.add_argument("--config", help="a DeepSpeed JSON config: its placement and buffer sizes")
    p.add_argument("--hf", help="a Hugging Face model folder or config.json (its shape)")
    p.add_argument("--ffn-hidden-size", type=int, help="llama: the MLP width")
    p.add_argument("--num-kv-heads", type=int, default=0, help="llama: key/value heads")
    p.add_argument("--max-model", action="store_true",
                   help="the largest GPT-2 (or --model llama) that fits, per placement")  # fmt: skip
    p.add_argument("--device-memory", type=float,
                   help="GB of device memory per rank; without it (--max-model on a CPU) the "
                   "device's terms count against --host-memory")  # fmt: skip
    p.add_argument("--host-memory", type=float, help="GB of host memory per rank")
    p.add_argument("--nvme-size", type=float, default=0.0, help="GB of NVMe per rank")
    p.add_argument("--topk-ratio", type=float,
                   help="zero_optimization.zenflow.topk_ratio: count ZenFlow's buffers (the "
                   "selected columns' device moments, the host accumulator) in the stage 1/2 "
                   "cpu rows, per rank (a --config with a zenflow block does it too)")  # fmt: skip
    p.add_argument("--overlap-step", action="store_true",
                   help="with --topk-ratio: zero_optimization.zenflow.overlap_step")  # fmt: skip
    p.add_argument("--states", choices=MODES,
                   help="the optimizer state's format: fp32 (master and moments), bf16 (bf16."
                   "bf16_master_weights_and_grads + bf16_optimizer_states; --dtype bf16) or "
                   "8bit (Adam8bit/AdamW8bit moments, with a bf16 master under --dtype bf16). "
                   "Default: --config's, else fp32; --max-model without it: a row per format "
                   "for the offloaded optimizer")  # fmt: skip


def load(args: argparse.Namespace):
    """``--config`` validated for ``--gpus`` ranks (``--micro-batch`` supplies its batch size)."""
    from ...config.loading.load import load_config

    return load_config(args.config, args.gpus, micro_batch_size=args.micro_batch)


def state_of(args: argparse.Namespace) -> StateFormat:
    """``--states``'s format for ``--dtype``, else ``--config``'s, else fp32 states."""
    import torch

    mode = getattr(args, "states", None)
    if mode is not None:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        return mode_format(mode, dtype[getattr(args, "dtype", "fp16")])
    if args.config:
        return StateFormat.from_config(load(args))
    return FP32


def plan_for(
    args: argparse.Namespace,
    stage: int,
    opt: str,
    par: str,
    dtype_bytes: int,
    state: StateFormat | None = None,
) -> ZeroPlan:
    """A placement row's plan: DeepSpeed's defaults, or the buffer sizes of ``--config``;
    ``state``: the optimizer state's format (default: ``state_of(args)``)."""
    base = ZeroPlan(stage=stage, dtype_bytes=dtype_bytes, world=args.gpus)
    if args.config:
        base = ZeroPlan.from_config(load(args), args.gpus)
    state = state_of(args) if state is None else state
    ratio = getattr(args, "ratio", 1.0)  # --ratio, else the config's
    zenflow = zenflow_of(args, dtype_bytes) or base.zenflow
    if zenflow is not None:  # the row's stage and param placement
        zenflow = dataclasses.replace(zenflow, stage3=stage == 3,
                                      shard_on_device=stage == 3 and par == "device")  # fmt: skip
    return dataclasses.replace(base, stage=stage, optimizer=opt, params=par,
                               dtype_bytes=dtype_bytes, world=args.gpus,
                               ratio=ratio if ratio < 1.0 else base.ratio,
                               zenflow=zenflow, state=state)  # fmt: skip


def zenflow_of(args: argparse.Namespace, dtype_bytes: int) -> ZenFlowPlan | None:
    """``--topk-ratio``'s ZenFlow (None without it)."""
    ratio = getattr(args, "topk_ratio", None)
    if ratio is None:
        return None
    if not 0.0 < ratio < 1.0:
        raise ValueError(
            f"--topk-ratio (zero_optimization.zenflow.topk_ratio) must be in (0, 1), got {ratio}"
        )
    fp16 = getattr(args, "dtype", "fp16") == "fp16"
    return ZenFlowPlan.for_dtype(ratio, bool(args.overlap_step), dtype_bytes, fp16)


def step_of(args) -> StepShape:
    micro = args.micro_batch
    if micro is None and args.config:
        micro = load(args).train_micro_batch_size_per_gpu
    cpu = args.cpu_checkpointing
    if not cpu and args.config:
        cpu = load(args).activation_checkpointing.cpu_checkpointing
    if cpu and not args.checkpoint_activations:
        raise ValueError(
            "--cpu-checkpointing (or activation_checkpointing.cpu_checkpointing) needs "
            "--checkpoint-activations: it moves the checkpointed layer inputs"
        )
    return StepShape(micro or 1, args.seq_length, args.checkpoint_activations, cpu)


def checkpointing_name(step: StepShape) -> str:
    if not step.checkpointing:
        return "off"
    return "on, inputs in host memory" if step.cpu_checkpointing else "on"


def rows(args, shape: ModelShape, dtype_bytes: int) -> list[tuple[ZeroPlan, dict]]:
    step = step_of(args)
    if args.config and not args.max_model:
        plan = dataclasses.replace(
            ZeroPlan.from_config(load(args), args.gpus), state=state_of(args)
        )
        return [(plan, predict(shape, step, plan))]
    out = []
    for stage, opt, par in PLACEMENTS:
        if args.stage is None or stage == args.stage:
            plan = plan_for(args, stage, opt, par, dtype_bytes)
            out.append((plan, predict(shape, step, plan)))
    return out


def optimizer_name(plan: ZeroPlan) -> str:
    """The offload_optimizer column: none, cpu, nvme, or a partial offload (``cpu@0.5``)."""
    if plan.stage == 3 and plan.optimizer == "host" and plan.ratio < 1.0:
        return f"cpu@{plan.ratio:g}"
    return NAMES[plan.optimizer]


def nvme_bytes(pred: dict) -> int:
    return sum(v for k, v in pred.items() if k.startswith("nvme."))


def print_step_table(args, shape: ModelShape, dtype_bytes: int) -> None:
    print(
        f"step peak per rank (micro batch {step_of(args).micro_batch}, seq {args.seq_length}, activation "
        f"checkpointing {checkpointing_name(step_of(args))}, {state_name(state_of(args))} "
        "optimizer states); GB = 1e9 bytes"
    )
    print(f"{'stage':>5} {'offload_optimizer':>17} {'offload_param':>13} {'device GB':>10} "
          f"{'host GB':>8} {'nvme GB':>8}  device working set GB by category")  # fmt: skip
    for plan, pred in rows(args, shape, dtype_bytes):
        stage, par = plan.stage, plan.params
        work = ", ".join(
            f"{k.split('.')[-1]} {v / GB:.2f}"
            for k, v in pred.items()
            if k.startswith("peak.device.") and not k.endswith("total") and v
        )
        print(f"{stage:>5} {optimizer_name(plan):>17} {NAMES[par] if stage == 3 else '-':>13} "
              f"{pred['peak.device.total'] / GB:>10.2f} {pred['peak.host.total'] / GB:>8.2f} "
              f"{nvme_bytes(pred) / GB:>8.2f}  {work}")  # fmt: skip
        zenflow = {k: v for k, v in pred.items() if ".zenflow_" in k}
        if zenflow:  # in the totals above: ZenFlow's own states
            print("      zenflow (in the totals): "
                  + ", ".join(f"{k} {v / GB:.3f}" for k, v in zenflow.items()))  # fmt: skip


def fits(pred: dict, args) -> bool:
    """Within the given memories; without ``--device-memory`` (a CPU run) the device's terms are
    host memory too, so both peaks and the process's own bytes count against ``--host-memory``."""
    if args.device_memory is None:
        total = pred["peak.device.total"] + pred["peak.host.total"] + CPU_PROCESS_BYTES
        return total <= args.host_memory * GB and nvme_bytes(pred) <= args.nvme_size * GB
    return (
        pred["peak.device.total"] <= args.device_memory * GB
        and (args.host_memory is None or pred["peak.host.total"] <= args.host_memory * GB)
        and nvme_bytes(pred) <= args.nvme_size * GB
    )


def largest(
    args, kind: str, place: tuple, dtype_bytes: int, state: StateFormat | None = None
) -> tuple[ModelShape, dict] | None:
    """The shape with the most params that fits: each width's deepest fitting depth."""
    step = step_of(args)
    plan = plan_for(args, *place, dtype_bytes, state)
    best = None
    for hidden, heads in WIDTHS:
        lo, hi = 0, MAX_LAYERS  # deepest depth that fits, by bisection (memory grows with depth)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            shape = make_shape(args, kind, mid, hidden, heads)
            lo, hi = (mid, hi) if fits(predict(shape, step, plan), args) else (lo, mid - 1)
        if lo:
            shape = make_shape(args, kind, lo, hidden, heads)
            if best is None or shape.numel() > best[0].numel():
                best = (shape, predict(shape, step, plan))
    return best


def make_shape(args, kind: str, layers: int, hidden: int, heads: int) -> ModelShape:
    if kind == "llama":
        ffn = args.ffn_hidden_size or 256 * -(-(8 * hidden // 3) // 256)
        return ModelShape.llama(layers, hidden, heads, args.vocab_size, ffn, args.num_kv_heads)
    return ModelShape.gpt2(layers, hidden, heads, args.vocab_size, args.seq_length)


def max_model_rows(args) -> list[tuple[tuple, StateFormat]]:
    """``--max-model``'s (placement, state format) rows: with the optimizer offloaded ("cpu" or
    NVMe) one per format that exists for ``--dtype`` (fp32, bf16 and 8-bit moments with bf16;
    fp32 and 8-bit otherwise), unless ``--states`` (or ``--config``) names one; else the one
    format ``state_of`` gives."""
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    every = getattr(args, "states", None) is None and not args.config
    modes = modes_for(dtype[getattr(args, "dtype", "fp16")])
    out = []
    for place in PLACEMENTS:
        if args.stage is not None and place[0] != args.stage:
            continue
        if every and place[1] != "device":
            out += [(place, mode_format(m, dtype[args.dtype])) for m in modes]
        else:
            out.append((place, state_of(args)))
    return out


def print_max_model(args, dtype_bytes: int) -> int:
    if args.device_memory is None and args.host_memory is None:
        raise ValueError("--max-model needs --device-memory GB or --host-memory GB (a CPU run)")
    kind = "llama" if args.model == "llama" else "gpt2"
    device = "no device (a CPU run: device terms in host memory)"
    if args.device_memory is not None:
        device = f"{args.device_memory:g} GB device"
    print(f"largest {kind} per placement in {device}, "
          f"{'unbounded' if args.host_memory is None else f'{args.host_memory:g} GB'} host, "
          f"{args.nvme_size:g} GB NVMe per rank, {args.gpus} rank(s), micro batch "
          f"{step_of(args).micro_batch}, seq {args.seq_length}")  # fmt: skip
    # the states column last: the columns before it keep their places (scripts read them)
    print(f"{'stage':>5} {'offload_optimizer':>17} {'offload_param':>13} {'params B':>9} "
          f"{'layers':>6} {'hidden':>6} {'device GB':>10} {'host GB':>8} {'nvme GB':>8}  "
          "states")  # fmt: skip
    for place, state in max_model_rows(args):
        got = largest(args, kind, place, dtype_bytes, state)
        head = (
            f"{place[0]:>5} {NAMES[place[1]]:>17} {NAMES[place[2]] if place[0] == 3 else '-':>13}"
        )
        if got is None:
            print(f"{head} {'none fits':>9}  {'':>6} {'':>6} {'':>10} {'':>8} {'':>8}  "
                  f"{state_name(state)}")  # fmt: skip
            continue
        shape, pred = got
        print(f"{head} {shape.numel() / 1e9:>9.2f} {shape.layers:>6} {shape.hidden:>6} "
              f"{pred['peak.device.total'] / GB:>10.2f} {pred['peak.host.total'] / GB:>8.2f} "
              f"{nvme_bytes(pred) / GB:>8.2f}  {state_name(state)}")  # fmt: skip
    return 0
