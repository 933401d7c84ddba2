"""Host bytes per parameter of each optimizer-state format, measured by ``engine.memory_report()``
and predicted by ``engine.expected_memory()``, side by side, on this project's GPT-2 (bf16, one
rank, offload_optimizer "cpu"): stage 2, and stage 3 with both offloads "cpu".

Formats: fp32 states (the default), bf16 states (DeepSpeed's ``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``), 8-bit moments (``AdamW8bit`` with the bf16 master). The bytes are the
report's ``host.*`` entries (the states the engine keeps; its transient ``peak.*`` terms apart),
divided by the trainable params.

    python benchmarks/state_bytes.py [--layers 6 --hidden 256]
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch

FORMATS = {
    "fp32": ({}, "AdamW"),
    "bf16": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "AdamW"),
    "8bit+bf16": ({"bf16_master_weights_and_grads": True}, "AdamW8bit"),
}


def config(stage: int, fmt: str) -> dict:
    bf16, opt = FORMATS[fmt]
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True, **bf16},
        "optimizer": {"type": opt, "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def host_bytes(report: dict[str, int]) -> int:
    return sum(v for k, v in report.items() if k.startswith("host."))


def measure(stage: int, fmt: str, args) -> tuple[float, float, int]:
    import zero_offload
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    torch.manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                 seq_length=args.seq)  # fmt: skip
    model = GPT2Model(GPT2Config(**shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=config(stage, fmt))
    numel = sum(og.flat.layout.total for og in engine.opt_groups)  # stage 3: params are empty
    x = torch.randint(0, 256, (2, args.seq))
    for _ in range(2):  # buffers made at the first step exist
        engine.backward(engine(x, labels=x))
        engine.step()
    got, want = host_bytes(engine.memory_report()), host_bytes(engine.expected_memory())
    engine.destroy()
    return got / numel, want / numel, numel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    args = p.parse_args()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    rows = []
    for stage, label in ((2, "stage 2 + offload cpu"), (3, "stage 3 + both offloads cpu")):
        base = None
        for fmt in FORMATS:
            got, want, numel = measure(stage, fmt, args)
            base = base or got
            rows.append((label, fmt, got, want, base / got, numel))
    print(
        f"GPT-2 {args.layers} layers x {args.hidden}, {rows[0][5] / 1e6:.2f}M params, bf16, 1 rank"
    )
    print("| setup | states | host B/param (memory_report) | expected_memory | fp32 / this |")
    print("| --- | --- | --- | --- | --- |")
    for label, fmt, got, want, ratio, _ in rows:
        print(f"| {label} | {fmt} | {got:.2f} | {want:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
