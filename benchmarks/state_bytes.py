"""Host bytes per parameter of each optimizer-state format, measured by ``engine.memory_report()``
and predicted by ``engine.expected_memory()``, side by side, on this project's GPT-2 (bf16, one
rank, offload_optimizer "cpu"): stage 2, and stage 3 with both offloads "cpu"; with ``--nvme DIR``
also stage 3 with both offloads "nvme" under DIR, where the drive's bytes per param are the
report's ``nvme.*`` entries and the host's per-param bytes leave out the swap and param buffers
(a fixed size set by the config, printed apart in MiB).

Formats: fp32 states (the default), bf16 states (DeepSpeed's ``bf16_master_weights_and_grads`` +
``bf16_optimizer_states``), 8-bit moments (``AdamW8bit`` with the bf16 master). The bytes are the
report's ``host.*`` entries (the states the engine keeps; its transient ``peak.*`` terms apart),
divided by the trainable params.

    python benchmarks/state_bytes.py [--layers 6 --hidden 256] [--nvme DIR]
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


# Host buffers whose size the config sets (swap buffers, param buffers), not the model.
FIXED = ("host.nvme_buffers", "host.param_spares", "host.param_staging")


def config(stage: int, fmt: str, nvme: str = "") -> dict:
    bf16, opt = FORMATS[fmt]
    place = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    zero: dict = {"stage": stage, "offload_optimizer": dict(place)}
    if stage == 3:
        zero["offload_param"] = dict(place)
    return {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True, **bf16},
        "optimizer": {"type": opt, "params": {"lr": 1e-3}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def host_bytes(report: dict[str, int], nvme: bool = False) -> int:
    """The host's bytes; with the states on NVMe without the config's fixed buffers."""
    return sum(v for k, v in report.items() if k.startswith("host.") and not (nvme and k in FIXED))


def drive_bytes(report: dict[str, int]) -> int:
    return sum(v for k, v in report.items() if k.startswith("nvme."))


def measure(stage: int, fmt: str, args, nvme: str = "") -> dict[str, float]:
    """Per trainable param: host and drive bytes reported and expected, and the fixed host
    buffers (bytes) with NVMe."""
    import zero_offload
    from zero_offload.models.gpt2 import GPT2Config, GPT2Model

    torch.manual_seed(0)
    shape = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                 seq_length=args.seq)  # fmt: skip
    model = GPT2Model(GPT2Config(**shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zero_offload.initialize(model=model, config=config(stage, fmt, nvme))
    numel = sum(og.flat.layout.total for og in engine.opt_groups)  # stage 3: params are empty
    x = torch.randint(0, 256, (2, args.seq))
    for _ in range(2):  # buffers made at the first step exist
        engine.backward(engine(x, labels=x))
        engine.step()
    got, want = engine.memory_report(), engine.expected_memory()
    engine.destroy()
    return {
        "host": host_bytes(got, bool(nvme)) / numel,
        "host_expected": host_bytes(want, bool(nvme)) / numel,
        "drive": drive_bytes(got) / numel,
        "drive_expected": drive_bytes(want) / numel,
        "fixed": sum(got.get(k, 0) for k in FIXED) if nvme else 0,
        "numel": numel,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--nvme", default="", help="a folder on the drive: add the NVMe rows")
    args = p.parse_args()
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():  # fmt: skip
        os.environ.setdefault(k, v)
    setups = [(2, "stage 2 + offload cpu", ""), (3, "stage 3 + both offloads cpu", "")]
    if args.nvme:
        setups.append((3, "stage 3 + both offloads nvme", args.nvme))
    rows = []
    for stage, label, nvme in setups:
        base = None
        for fmt in FORMATS:
            m = measure(stage, fmt, args, nvme)
            total = m["host"] + m["drive"]
            base = base or total
            rows.append((label, fmt, m, base / total))
    numel = rows[0][2]["numel"]
    print(f"GPT-2 {args.layers} layers x {args.hidden}, {numel / 1e6:.2f}M params, bf16, 1 rank")
    print(
        "| setup | states | host B/param (memory_report) | expected_memory "
        "| drive B/param (memory_report) | expected_memory | fixed host buffers | fp32 / this |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, fmt, m, ratio in rows:
        fixed = f"{m['fixed'] / 2**20:.1f} MiB" if m["fixed"] else "-"
        print(
            f"| {label} | {fmt} | {m['host']:.2f} | {m['host_expected']:.2f} "
            f"| {m['drive']:.2f} | {m['drive_expected']:.2f} | {fixed} | {ratio:.2f}x |"
        )


if __name__ == "__main__":
    main()
