"""Every host byte of a stage-3 offload run at a real size, accounted: the engine's memory report
by term against the measured peak anonymous RSS, and DeepSpeed's peak on the same model and
config beside it.

A Llama built from its config under ``zero.Init`` (nothing is downloaded), fp32 training (bf16 with ``--states``), stage 3
with both offloads "cpu", ``reduce_bucket_size`` and ``stage3_max_live_parameters`` 1e7, micro
batch 1, a few steps of sequence 32, one process per engine. Anonymous RSS is what the process
allocated (file pages are not counted), sampled every 5 ms from after the imports (the
baseline) to after the last step. On a CPU the engine's ``device.*`` terms are host memory too,
so every term counts: the states the engine keeps, the steps' transient peaks
(``peak.device.*``: reduce buffers, held gradients, gathered params) and malloc's free heap
(``peak.host.allocator_free``).

``--states`` picks the optimizer state's format: ``fp32`` (fp32 training, fp32 master and moments),
``bf16`` (bf16 training with DeepSpeed's ``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``: 8 bytes a param of host state) or ``8bit`` (bf16 training, the bf16
master and ``AdamW8bit``'s 8-bit moments: this project's extension, which DeepSpeed does not offer).

    python benchmarks/host_account.py --hidden 1024 --layers 12 [--deepspeed] [--states bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

GIB = 2**30
# The optimizer state's formats: (the config's bf16 block, optimizer type). fp32 trains in fp32;
# the others train in bf16 (a bf16 master is the bf16 params' dtype).
STATES = {
    "fp32": ({}, "AdamW"),
    "bf16": (
        {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "AdamW",
    ),  # fmt: skip
    "8bit": ({"enabled": True, "bf16_master_weights_and_grads": True}, "AdamW8bit"),
}
# The formats DeepSpeed 0.19.8 has (no 8-bit optimizer state).
DEEPSPEED_STATES = ("fp32", "bf16")


def config(
    bucket: float,
    live: float,
    offload: str = "cpu",
    nvme_path: str = "",
    sub_group: float = 0,
    states: str = "fp32",
) -> dict:
    """The run's DeepSpeed config: both offloads on ``offload`` ("cpu" or "nvme", the latter
    under ``nvme_path``); ``sub_group_size`` where ``sub_group`` is given (else the default);
    the optimizer state's format ``states`` (a key of :data:`STATES`)."""
    if states not in STATES:
        raise ValueError(f"--states must be one of {', '.join(STATES)}, got {states!r}")
    bf16, opt = STATES[states]
    where = {"device": offload} | ({"nvme_path": nvme_path} if offload == "nvme" else {})
    zc = {"sub_group_size": sub_group} if sub_group else {}
    return {
        "train_micro_batch_size_per_gpu": 1,
        **({"bf16": dict(bf16)} if bf16 else {}),
        "optimizer": {"type": opt, "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": bucket,
            "stage3_max_live_parameters": live,
            "offload_optimizer": dict(where),
            "offload_param": dict(where),
            **zc,
        },
        "steps_per_print": 10**9,
    }


def training(states: str) -> str:
    """The training dtype a state format runs with: fp32 for fp32 states, else bf16."""
    return "fp32" if states == "fp32" else "bf16"


def _llama(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 64), tie_word_embeddings=False,
    )  # fmt: skip


def _warm_up(args) -> None:
    """A tiny model's forward and backward before the baseline: the modules a first call
    imports lazily (the model's code, torch's compiler front end) are loaded outside the
    measured window, and outside DeepSpeed's zero.Init, whose patched constructors break them."""
    import torch
    import transformers

    tiny = argparse.Namespace(**{**vars(args), "hidden": 64, "layers": 1, "vocab": 128})
    model = transformers.LlamaForCausalLM(_llama(tiny))
    x = torch.randint(0, 128, (1, 8))
    model(input_ids=x, labels=x).loss.backward()


def child(args) -> None:
    """One engine in this process; prints one JSON line."""
    import torch
    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _ds_compat
    from checkpoint_io import PeakMemory

    torch.manual_seed(0)
    cfg = config(args.bucket, args.live, args.offload, args.nvme_path, args.sub_group, args.states)
    if args.engine == "deepspeed":
        if args.states not in DEEPSPEED_STATES:
            sys.exit(f"DeepSpeed 0.19.8 has no {args.states} optimizer state: not offered")
        ds = _ds_compat.one_process(args.port)
    else:
        import zero_offload as ds
    _warm_up(args)
    with PeakMemory() as peak:
        with ds.zero.Init(config_dict_or_path=cfg):
            model = transformers.LlamaForCausalLM(_llama(args))
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        set_up = PeakMemory.read()[1] - peak.base[1]
        losses, steps_s = _ds_compat.train_lm(engine, args.vocab, args.seq, args.steps)
    report = engine.memory_report() if hasattr(engine, "memory_report") else {}
    print(json.dumps({"params": params, "losses": losses, "peak_anon": peak.delta[1],
                      "set_up_anon": set_up, "report": report, "steps_s": steps_s}))  # fmt: skip


def child_command(args, engine: str) -> list[str]:
    """The command line of one engine's run in a fresh process (a free port for DeepSpeed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--child", engine, "--port", str(port)]
    for k in ("hidden", "layers", "vocab", "steps", "seq", "bucket", "live", "offload"):
        cmd += [f"--{k}", str(getattr(args, k))]
    cmd += ["--sub-group", str(getattr(args, "sub_group", 0))]
    cmd += ["--states", getattr(args, "states", "fp32")]
    return cmd + ["--nvme-path", str(getattr(args, "nvme_path", "") or "")]


def run(args, engine: str) -> dict:
    cmd = child_command(args, engine)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def host_terms(report: dict) -> dict:
    """The report's terms held in host memory: every one but the states on disk (``nvme.*``),
    and ``host.param_spares`` only where no ``peak.host.param_buffers`` counts them already
    (that peak is of the NVMe param cache, its spares and its writes together)."""
    out = {k: v for k, v in report.items() if not k.startswith("nvme.")}
    if "peak.host.param_buffers" in out:
        out.pop("host.param_spares", None)
    return out


def account(ours: dict) -> None:
    """The report's terms (MiB) and their sum against the measured peak above the baseline."""
    report, measured = ours["report"], ours["peak_anon"]
    summed = host_terms(report)
    states = {k: v for k, v in report.items() if not k.startswith("peak.")}
    peaks = {k: v for k, v in report.items() if k.startswith("peak.")}
    print("| term | MiB |\n| --- | --- |")
    for k, v in sorted(states.items()) + sorted(peaks.items()):
        note = "" if k in summed else " (not in the sum)"
        print(f"| {k}{note} | {v / 2**20:.1f} |")
    total = sum(summed.values())
    host_states = sum(v for k, v in summed.items() if not k.startswith("peak."))
    print(f"| sum of the terms | {total / 2**20:.1f} |")
    print(f"| measured peak anonymous RSS above the baseline | {measured / 2**20:.1f} |")
    print(f"terms / measured: {total / measured:.3f} (after set-up: "
          f"{ours['set_up_anon'] / 2**20:.1f} MiB measured, host states "
          f"{host_states / 2**20:.1f})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--bucket", type=float, default=1e7, help="reduce_bucket_size")
    ap.add_argument("--live", type=float, default=1e7, help="stage3_max_live_parameters")
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's engine")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", choices=["zero_offload", "deepspeed"])
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--offload", choices=["cpu", "nvme"], default="cpu", help="both offloads")
    ap.add_argument("--nvme-path", default="", help="nvme_path of the nvme offloads")
    ap.add_argument("--sub-group", type=float, default=0, help="sub_group_size (0: the default)")
    ap.add_argument("--states", choices=list(STATES), default="fp32",
                    help="the optimizer state's format (bf16, 8bit: bf16 training)")  # fmt: skip
    args = ap.parse_args()
    if args.child:
        args.engine = args.child
        return child(args)
    from zero_offload.kernels.bench import _cpu_name

    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); "
          f"Llama {args.layers} x {args.hidden}, vocab {args.vocab}, {training(args.states)} "
          f"training, {args.states} states, stage 3 + both "
          f"offloads {args.offload}, {args.steps} steps of {args.seq} tokens")  # fmt: skip
    ours = run(args, "zero_offload")
    if "error" in ours:
        sys.exit(f"zero_offload failed:\n{ours['error']}")
    print(
        f"{ours['params'] / 1e6:.1f}M params; losses {ours['losses']}; "
        f"{ours['steps_s']:.1f} s for the steps"
    )
    account(ours)
    if args.deepspeed and args.states not in DEEPSPEED_STATES:
        print(f"DeepSpeed: not offered (DeepSpeed 0.19.8 has no {args.states} optimizer state)")
    elif args.deepspeed:
        ds = run(args, "deepspeed")
        if "error" in ds:
            print(f"DeepSpeed failed:\n{ds['error']}")
            return
        print(f"DeepSpeed: losses {ds['losses']}; peak anonymous RSS above the baseline "
              f"{ds['peak_anon'] / GIB:.2f} GiB (after set-up {ds['set_up_anon'] / GIB:.2f}); "
              f"ours / DeepSpeed: {ours['peak_anon'] / ds['peak_anon']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
