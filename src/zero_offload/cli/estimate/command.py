"""``zero-offload estimate``: model-state memory per device and on the host, for every stage with
and without optimizer offload, and at stage 3 with and without parameter offload (the seeds'
arithmetic: a 1.5B model's Adam state is 18 GB; ZeRO stage 1 on 8 ranks holds 2.25 GB of it per
device)."""

from __future__ import annotations

import argparse
import math

from . import step as estimate_step


def _param_count(text: str) -> int:
    """``--params``: a finite count >= 1, written as an integer or a float (1.5e9)."""
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            value = None
    try:
        finite = value is not None and math.isfinite(value)  # float(value): an int past 1e308
    except OverflowError:
        finite = False
    if not finite or value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a finite parameter count >= 1 (e.g. 1.5e9), got {text!r}"
        )
    return int(value)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _ratio(text: str) -> float:
    """``--ratio``: a number in [0, 1], as ``offload_optimizer.ratio``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=_param_count, help="parameter count, e.g. 1.5e9")
    p.add_argument("--model", choices=["gpt2", "llama"], help="a model's shape instead of --params")
    p.add_argument("--num-layers", type=_positive_int, default=48)
    p.add_argument("--hidden-size", type=_positive_int, default=1600)
    p.add_argument("--num-attention-heads", type=_positive_int, default=16)
    p.add_argument("--seq-length", type=_positive_int, default=1024)
    p.add_argument("--vocab-size", type=_positive_int, default=50257)
    p.add_argument("--gpus", type=_positive_int, default=1, help="data-parallel ranks (default 1)")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="show only this stage")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument(
        "--ratio",
        type=_ratio,
        default=1.0,
        help="offload_optimizer.ratio of the stage-3 offload rows: the host's share of the "
        "optimizer state, the rest on the device (partial offload; default 1.0)",
    )
    p.add_argument(
        "--muon-share",
        type=_ratio,
        default=0.0,
        help='optimizer "Muon": the share of the params in its Muon group (the hidden '
        "matrices; the rest is its AdamW aux group), whose state is one momentum, not Adam's "
        "two moments; only the rows Muon runs (no partial offload). Default 0: Adam",
    )
    estimate_step.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from ..errors import report

    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as err:
        return report("estimate", err, getattr(args, "config", None))


def _offload(row: dict) -> str:
    """The offload column: none, cpu, or cpu with a partial offload's ratio (``cpu@0.5``)."""
    if not row["offload"]:
        return "none"
    return "cpu" if row["ratio"] >= 1.0 else f"cpu@{row['ratio']:g}"


def _shape(args: argparse.Namespace):
    """The model shape of ``--hf`` or ``--model llama`` (``--model gpt2``: see ``_run``)."""
    from ...runtime.plan.model_shape import ModelShape

    if args.hf:
        return ModelShape.from_path(args.hf)
    if args.model == "llama":
        return estimate_step.make_shape(args, "llama", args.num_layers, args.hidden_size,
                                        args.num_attention_heads)  # fmt: skip
    return None


def _gpt2(args: argparse.Namespace):
    """``--model gpt2``: its parameter count and shape (ValueError for sizes it cannot show)."""
    from ...models.gpt2 import GPT2Config, num_parameters
    from ...runtime.plan.model_shape import ModelShape

    if args.hidden_size % args.num_attention_heads:
        raise ValueError(
            f"--hidden-size {args.hidden_size} must be divisible by "
            f"--num-attention-heads {args.num_attention_heads}"
        )
    cfg = GPT2Config(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
    )
    numel = num_parameters(cfg)
    if numel > 1e300:  # past what the GB columns (floats) can show
        raise ValueError(
            f"the GPT-2 of --num-layers {args.num_layers}, --hidden-size "
            f"{args.hidden_size}, --vocab-size {args.vocab_size}, --seq-length "
            f"{args.seq_length} has about 1e{len(str(numel)) - 1} params, too many to "
            "estimate; give sizes of a real model"
        )
    return numel, ModelShape.from_config(cfg)


def _run(args: argparse.Namespace) -> int:
    import torch

    from ...runtime.plan.memory import per_param_table
    from ...runtime.plan.state_bytes import state_name

    dtype_bytes = 4 if args.dtype == "fp32" else 2
    if args.max_model:
        return estimate_step.print_max_model(args, dtype_bytes)
    shape = _shape(args)
    if shape is not None:
        numel = shape.numel()
        what = f"{shape.kind} {shape.layers}x{shape.hidden} ({numel / 1e9:.3f}B params)"
    elif args.model == "gpt2":
        numel, shape = _gpt2(args)
        what = f"GPT-2 {args.num_layers}x{args.hidden_size} ({numel / 1e9:.3f}B params)"
    elif args.params is not None:
        numel = args.params
        what = f"{numel / 1e9:.3f}B params"
    else:
        raise SystemExit("estimate: give --params N or --model gpt2 (with its size flags)")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    muon = args.muon_share
    optimizer = f"Muon ({muon:g} of the params) + AdamW" if muon else "Adam"
    state = estimate_step.state_of(args)
    if muon and state.compact:
        raise ValueError(
            f"--muon-share with --states {args.states}: Muon keeps fp32 state (its config "
            "refuses the compact states)"
        )
    print(
        f"model-state memory for {what}, {args.dtype} training with {optimizer} "
        f"({state_name(state)} states), "
        f"{args.gpus} rank(s); "
        "GB = 1e9 bytes; activations and bucket buffers not included"
    )
    print(
        f"{'stage':>5} {'offload':>7} {'per device GB':>14} {'host per rank GB':>17} "
        f"{'optimizer state per rank GB':>28} {'offload_param':>13}"
    )
    table = per_param_table(numel, args.gpus, dtype, args.ratio, muon_share=muon, state=state)
    for row in table:
        if args.stage is not None and row["stage"] != args.stage:
            continue
        # offload is offload_optimizer; offload_param exists at stage 3 only ("-" below it).
        params = ("cpu" if row["offload_param"] else "none") if row["stage"] == 3 else "-"
        print(
            f"{row['stage']:>5} {_offload(row):>7} "
            f"{row['device'] / 1e9:>14.2f} {row['host'] / 1e9:>17.2f} "
            f"{row['optimizer_state'] / 1e9:>28.2f} {params:>13}"
        )
    if not muon:  # Muon has no stage-3 rows
        print(
            "stage 3 also holds the gathered params of the modules running now "
            "(at most stage3_max_live_parameters), not included above"
        )
    if shape is not None:
        print()
        estimate_step.print_step_table(args, shape, dtype_bytes)
    return 0
