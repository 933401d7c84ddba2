"""An Accelerate training loop, run by the tests in a subprocess: ``python run_accelerate.py
SPEC.json`` (the spec's ``plugin`` builds a ``DeepSpeedPlugin``), or under ``accelerate launch
--use_deepspeed ...`` (the plugin comes from the launcher). Rank 0 prints ``RESULT <json>``.

SPEC: ``{"opt_in": "call" | "env" | "none", "model_dir": ..., "plugin": {...} | null,
"steps": N, "micro": M, "gas": G, "client_optimizer": bool, "threshold0": bool,
"save_state": folder | absent}``.
"""

from __future__ import annotations

import json
import sys

SPEC = json.loads(open(sys.argv[1]).read())
if SPEC["opt_in"] == "call":
    import zero_offload

    zero_offload.as_deepspeed()

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DeepSpeedPlugin  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForCausalLM, get_constant_schedule  # noqa: E402

VOCAB, LR = 256, 1e-2


def one_pass(accelerator, model, optimizer, loader) -> list[float]:
    """Train over ``loader`` once; each micro-step's loss (mean over the processes)."""
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
    return losses


def roundtrip(accelerator, model, optimizer, loader, folder: str) -> dict:
    """accelerate's checkpoint (the engine's save/load_checkpoint): save, train a pass (the
    weights and optimizer state move away), load, train the same pass again. The weights are
    the saved ones again, and the second pass repeats the first only if the optimizer state
    (moments, step count) came back too."""
    probe = next(iter(loader))

    def probe_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(accelerator.gather(model(**probe).loss.detach()[None]).mean())

    before = probe_loss()
    accelerator.save_state(folder)
    first = one_pass(accelerator, model, optimizer, loader)
    moved = probe_loss()
    accelerator.load_state(folder)
    after = probe_loss()
    again = one_pass(accelerator, model, optimizer, loader)
    return {"probe": [before, moved, after], "first": first, "again": again}


def main() -> None:
    plugin = DeepSpeedPlugin(**SPEC["plugin"]) if SPEC.get("plugin") else None
    accelerator = Accelerator(
        deepspeed_plugin=plugin, gradient_accumulation_steps=SPEC.get("gas", 1)
    )
    ds = accelerator.state.deepspeed_plugin
    if ds is not None and SPEC.get("threshold0"):
        # every param partitioned (the tiny model's are all under the default threshold)
        ds.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(SPEC["model_dir"], dtype=torch.float32)
    loaded = [p.numel() == 0 and getattr(p, "ds_numel", 0) > 0 for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    n = SPEC["steps"] * SPEC["micro"] * SPEC.get("gas", 1) * accelerator.num_processes
    rows = torch.randint(0, VOCAB, (n, 16), generator=g)
    data = [{"input_ids": r, "labels": r.clone()} for r in rows]
    loader = DataLoader(data, batch_size=SPEC["micro"], shuffle=False)
    config_optimizer = ds is not None and "optimizer" in ds.deepspeed_config
    if config_optimizer:
        # Only with DeepSpeed available (the opt-in): accelerate defines them only then.
        from accelerate.utils import DummyOptim, DummyScheduler

        optimizer = DummyOptim(model.parameters(), lr=LR)
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=get_constant_schedule)
    else:
        # constant: accelerate steps a scheduler once per process per step (its convention),
        # so only a constant one compares with the one-process plain run
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
        scheduler = get_constant_schedule(optimizer)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    engine = type(model).__module__ + "." + type(model).__name__
    params = list(accelerator.unwrap_model(model).parameters())
    prepared = [p.numel() == 0 and getattr(p, "ds_numel", 0) > 0 for p in params]
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:  # DeepSpeed clips itself (gradient_clipping 1.0)
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.gather(loss.detach()[None]).mean()))
    state_roundtrip = None
    if SPEC.get("save_state"):
        state_roundtrip = roundtrip(accelerator, model, optimizer, loader, SPEC["save_state"])
    if accelerator.is_main_process:
        result = {
            "losses": losses,
            "engine": engine,
            "num_processes": accelerator.num_processes,
            "distributed_type": str(accelerator.distributed_type),
            "partitioned_after_load": bool(loaded) and all(loaded),
            "partitioned_after_prepare": bool(prepared) and all(prepared),
            "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            "state_roundtrip": state_roundtrip,
        }
        print("RESULT " + json.dumps(result), flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
