"""Host memory with both states on NVMe against what the config allows, ours and DeepSpeed's.

A GPT-2 (Hugging Face's ``GPT2LMHeadModel``, default 18 x 768, vocab 50257, tied embeddings: 166M
params) built under ``zero.Init``, fp32, stage 3 with both offloads "nvme", ``sub_group_size``
4e6, ``offload_optimizer.buffer_count`` 4, ``offload_param.max_in_cpu`` 4e7,
``stage3_max_live_parameters`` 2e7, micro batch 1, a few steps of sequence 128, one process per
engine, the same config on both. Anonymous RSS (what the process allocated) is sampled every
5 ms from after the imports and a tiny warm-up step (the baseline) to after the last step.

What the config allows on the host: the fp32 gradient partition (4 bytes/param), the optimizer
swap buffers (``buffer_count`` x ``sub_group_size`` x 12 bytes: fp32 master and two moments),
the param cache (``max_in_cpu`` x 4 bytes), the live params (``stage3_max_live_parameters`` x 4
bytes), two full gradients of the largest param, and 128 MiB for the rest. On a CPU the device is
host memory too, so the device's share of the step is added beside it: the running module, which
is gathered whatever the live bound (the largest param x 4 bytes), and the activations and logits
the memory model predicts for the model's shape (on a GPU all three are on the device).

The account: ours' ``memory_report()`` terms held in host memory (``host_account.host_terms``)
plus the memory model's activations and logits (the model's bytes, not the engine's) against the
measured peak.

    python benchmarks/nvme_host_bound.py --path DIR [--deepspeed]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_account  # noqa: E402

GIB = 2**30


def config(path: str, param_buffers: tuple[int, float] | None = None) -> dict:
    """The run's config; ``param_buffers``: ``offload_param``'s ``buffer_count`` and
    ``buffer_size`` (DeepSpeed's defaults, 5 of 1e8 elements, where None)."""
    where = {"device": "nvme", "nvme_path": path}
    pbuf = (
        {}
        if param_buffers is None
        else {"buffer_count": int(param_buffers[0]), "buffer_size": param_buffers[1]}
    )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 4e6,
            "stage3_max_live_parameters": 2e7,
            "offload_optimizer": {**where, "buffer_count": 4},
            "offload_param": {**where, "max_in_cpu": 4e7, **pbuf},
        },
        "steps_per_print": 10**9,
    }


def allowed(params: int, largest: int, cfg: dict) -> dict[str, int]:
    """What the config allows on the host, by term (bytes)."""
    zc = cfg["zero_optimization"]
    return {
        "fp32 gradient partition": 4 * params,
        "optimizer swap buffers": int(
            zc["offload_optimizer"]["buffer_count"] * zc["sub_group_size"] * 12
        ),  # fmt: skip
        "param cache (max_in_cpu)": int(zc["offload_param"]["max_in_cpu"] * 4),
        "live params": int(zc["stage3_max_live_parameters"] * 4),
        "two full gradients of the largest param": 2 * 4 * largest,
        "the rest": 128 * 2**20,
    }


def device_share(largest: int, predicted: dict) -> dict[str, int]:
    """What a GPU would hold of the step and a CPU holds in host memory (bytes)."""
    return {
        "running module beyond the live bound (largest param)": 4 * largest,
        "activations (memory model)": predicted.get("peak.device.activations", 0),
        "logits (memory model)": predicted.get("peak.device.logits", 0),
    }


def _gpt(args, **over):
    """Hugging Face's GPT-2 (both engines' zero.Init can build it), dropout off."""
    import transformers

    shape = dict(n_layer=args.layers, n_embd=args.hidden, vocab_size=args.vocab,
                 n_head=max(1, args.hidden // 64), n_positions=args.seq, resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=not args.untied)  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**shape, **over}))


def child(args) -> None:
    """One engine in this process; prints one JSON line."""
    import _ds_compat
    import torch
    from checkpoint_io import PeakMemory

    torch.manual_seed(0)
    cfg = config(args.path, args.param_buffers)
    if args.child == "deepspeed":
        ds = _ds_compat.one_process(args.port)
    else:
        import zero_offload as ds
    tiny = _gpt(args, n_layer=1, n_embd=64, n_head=1, vocab_size=128)
    x = torch.randint(0, 128, (1, 8))
    tiny(input_ids=x, labels=x).loss.backward()  # lazy imports outside the measured window
    del tiny
    with PeakMemory() as peak:
        with ds.zero.Init(config_dict_or_path=cfg):
            model = _gpt(args)
        numels = [getattr(p, "ds_numel", p.numel()) for p in model.parameters()]
        engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses, steps_s = _ds_compat.train_lm(engine, args.vocab, args.seq, args.steps)
    report = engine.memory_report() if hasattr(engine, "memory_report") else {}
    predicted = engine.expected_memory(seq_length=args.seq) if report else {}
    print(json.dumps({"params": sum(numels), "largest": max(numels), "losses": losses,
                      "peak_anon": peak.delta[1], "report": report, "predicted": predicted,
                      "steps_s": steps_s}))  # fmt: skip


def run(args, engine: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = os.path.join(args.path, engine)
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, __file__, "--child", engine, "--port", str(port), "--path", folder]
    for k in ("hidden", "layers", "vocab", "steps", "seq"):
        cmd += [f"--{k}", str(getattr(args, k))]
    if args.untied:
        cmd.append("--untied")
    if args.param_buffers:
        cmd += ["--param-buffers", *map(str, args.param_buffers)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        return {"error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--path", required=True, help="a folder on the disk to offload to")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed's engine")
    ap.add_argument(
        "--untied",
        action="store_true",
        help="an untied LM head (DeepSpeed's NVMe "
        "param swapper fails on the tied one: 'Not enough buffers 0 for swapping 1')",
    )
    ap.add_argument(
        "--param-buffers",
        nargs=2,
        type=float,
        metavar=("COUNT", "SIZE"),
        help="offload_param buffer_count and buffer_size (DeepSpeed's defaults, 5 "
        "and 1e8, fail on GPT-2 with 'Not enough buffers 0 for swapping 1')",
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--child", choices=["zero_offload", "deepspeed"])
    ap.add_argument("--port", type=int, default=29500)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from zero_offload.kernels.bench import _cpu_name

    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); GPT-2 {args.layers} x {args.hidden}, "
          f"vocab {args.vocab}, fp32, stage 3, both offloads nvme, {args.steps} steps of "
          f"{args.seq} tokens")  # fmt: skip
    ours = run(args, "zero_offload")
    if "error" in ours:
        sys.exit(f"zero_offload failed:\n{ours['error']}")
    bound = allowed(ours["params"], ours["largest"], config(args.path))
    share = device_share(ours["largest"], ours["predicted"])
    print(f"{ours['params'] / 1e6:.1f}M params; losses {ours['losses']}")
    print("| what the config allows | GiB |\n| --- | --- |")
    for k, v in (bound | share).items():
        print(f"| {k} | {v / GIB:.3f} |")
    total = sum(bound.values()) + sum(share.values())
    print(f"| total | {total / GIB:.2f} |")
    report = host_account.host_terms(ours["report"])
    model = {k: v for k, v in share.items() if "memory model" in k}
    print("| ours' account | GiB |\n| --- | --- |")
    for k, v in sorted(report.items()) + sorted(model.items()):
        print(f"| {k} | {v / GIB:.3f} |")
    terms = sum(report.values()) + sum(model.values())
    measured = ours["peak_anon"]
    print(f"| sum | {terms / GIB:.2f} |")
    print(f"zero_offload: peak anonymous RSS above the baseline {measured / GIB:.2f} GiB: "
          f"{measured / total:.2f}x what the config allows, the account {terms / measured:.2f}x "
          f"the measured peak; 3 steps {ours['steps_s']:.1f} s")  # fmt: skip
    if args.deepspeed:
        ds = run(args, "deepspeed")
        if "error" in ds:
            print(f"DeepSpeed failed:\n{ds['error']}")
            return
        print(f"DeepSpeed: losses {ds['losses']}; peak anonymous RSS above the baseline "
              f"{ds['peak_anon'] / GIB:.2f} GiB ({ds['peak_anon'] / total:.2f}x what the config "
              f"allows); 3 steps {ds['steps_s']:.1f} s; ours / DeepSpeed: "
              f"{ours['peak_anon'] / ds['peak_anon']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
