"""Functions the checkpoint tests run in spawned ranks (they must be importable by module name),
and the child program of the crash tests (``python checkpoint_helpers.py crash DIR``)."""

from __future__ import annotations

import copy
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from parity import DIM, LR, VOCAB, Tiny, batches, engine_config, global_step, make_model

STEPS, SPLIT = 10, 5  # uninterrupted run length, and where the interrupted one saves
CLIENT_STATE = {"epoch": 3, "note": "resume me", "history": [1.5, 2.5]}


class TiedTiny(Tiny):
    """Tiny with a real tied head (two state-dict keys, one Parameter) and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(x)
        h = h + 0.1 * self.frozen(h)
        h = self.norm(self.l2(torch.tanh(self.l1(h))))
        return F.cross_entropy(self.head(h).float().reshape(-1, VOCAB), y.reshape(-1))


def case_config(case: dict) -> dict:
    cfg = engine_config(
        stage=case["stage"],
        offload=case["offload"],
        gas=case["gas"],
        micro=case["micro"],
        clip=case.get("clip", 0.05),
        overlap=case.get("overlap", False),
        dtype=case["dtype"],
        bucket=case.get("bucket", 100),
        offload_param=case.get("offload_param", False),
    )
    # A schedule still warming up at the split: a resume that lost the lr or the schedule's
    # position diverges at once.
    cfg["scheduler"] = {
        "type": "WarmupLR",
        "params": {
            "warmup_min_lr": LR / 10,
            "warmup_max_lr": LR,
            "warmup_num_steps": 8,
            "warmup_type": "linear",
        },
    }
    return cfg


def build(case: dict):
    import zero_offload

    if case.get("tied"):
        torch.manual_seed(0)
        model = TiedTiny()
    else:
        model = make_model()
    engine, _, _, _ = zero_offload.initialize(model=model, config=copy.deepcopy(case_config(case)))
    return engine, model


def train(engine, case: dict, first: int, last: int) -> list[float]:
    """Steps [first, last) of the run on this rank's share of each global batch."""
    from zero_offload.core import dist

    world, rank, micro, gas = dist.world_size(), dist.rank(), case["micro"], case["gas"]
    data = batches(STEPS, world, gas, micro)  # depends only on the global batch size
    losses = []
    for x, y in data[first:last]:
        t = torch.tensor([global_step(engine, x, y, world, rank)])
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    return losses


def snapshot(engine, model) -> dict:
    """fp32 masters (gathered), the live module tensors in their own dtype, and the counters."""
    from zero_offload.utils import safe_get_full_fp32_param

    engine.flush_delayed_update()
    named = dict(model.named_parameters())
    return {
        "master": {n: safe_get_full_fp32_param(p) for n, p in named.items() if p.requires_grad},
        "module": _module_state(engine, model),
        "counters": [
            engine.global_steps,
            engine.global_samples,
            engine.micro_steps,
            engine.skipped_steps,
        ],
        "lr": engine.get_lr(),
        "loss_scale": engine.loss_scale,
    }


def _module_state(engine, model) -> dict:
    with engine.params_on_host():  # stage 3: the full params
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def draws() -> list[float]:
    """One value from every generator a checkpoint restores."""
    import numpy as np

    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


class one_thread:
    """CPU kernels sum in thread-count-dependent order: every phase runs on one thread, as the
    spawned ranks do, so a run in this process and one in a fresh process compute alike."""

    def __enter__(self) -> None:
        self.prev = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.prev)


def save_phase(cases: list[dict], root: str) -> dict:
    """Per case: the uninterrupted run, and a run that saves at SPLIT (then keeps training, which
    must match the uninterrupted run too: saving changes nothing)."""
    with one_thread():
        return _save_phase(cases, root)


def _save_phase(cases: list[dict], root: str) -> dict:
    out = {}
    for case in cases:
        engine, model = build(case)
        straight = train(engine, case, 0, STEPS)
        full = snapshot(engine, model)
        engine.destroy()

        engine, model = build(case)
        first = train(engine, case, 0, SPLIT)
        at_save = snapshot(engine, model)
        torch.manual_seed(
            1234 + case.get("seed", 0)
        )  # RNG states distinct from the fresh process's
        random.seed(99)
        engine.save_checkpoint(f"{root}/{case['id']}", client_state=CLIENT_STATE)
        after_save = draws()
        rest = train(engine, case, SPLIT, STEPS)
        out[case["id"]] = {
            "straight": straight,
            "full": full,
            "first": first,
            "at_save": at_save,
            "draws": after_save,
            "continued": rest,
            "continued_state": snapshot(engine, model),
        }
        engine.destroy()
    return out


def resume_phase(cases: list[dict], root: str) -> dict:
    """Per case: a fresh engine loads the case's checkpoint (``case['from']`` when set) and runs
    the remaining steps."""
    out = {}
    for case in cases:
        engine, model = build(case)
        path, client = engine.load_checkpoint(f"{root}/{case.get('from', case['id'])}")
        got = draws()
        loaded = snapshot(engine, model)
        rest = train(engine, case, SPLIT, STEPS)
        out[case["id"]] = {
            "path": path,
            "client": client,
            "draws": got,
            "loaded": loaded,
            "rest": rest,
            "final": snapshot(engine, model),
        }
        engine.destroy()
    return out


# ---- one rank fails: every rank refuses ----------------------------------------------------------
def refused_saves(case: dict, root: str) -> list[str]:
    """Saves that only some ranks refuse (rank 1's client_state is not JSON; ranks pass
    different tags under checkpoint.tag_validation "fail"): every rank must raise, and nothing
    may be published. Under "warn" (the default) different tags save under rank 0's."""
    from zero_offload.checkpoint import CheckpointError
    from zero_offload.core import dist

    with one_thread():
        engine, _ = build(case)
        msgs = []
        bad = {"x": {1, 2}} if dist.rank() == 1 else {}
        engine.config = engine.config.updated({"checkpoint": {"tag_validation": "fail"}})
        for kwargs in ({"client_state": bad, "tag": "refused"}, {"tag": f"rank{dist.rank()}"}):
            try:
                engine.save_checkpoint(f"{root}/refused", **kwargs)
                msgs.append("saved")
            except CheckpointError as e:
                msgs.append(str(e))
        engine.config = engine.config.updated({"checkpoint": {"tag_validation": "warn"}})
        engine.save_checkpoint(f"{root}/warned", tag=f"rank{dist.rank()}")
        msgs.append(",".join(sorted(p.name for p in Path(root, "warned").iterdir())))
        engine.destroy()
    return msgs


def refused_load(case: dict, root: str) -> dict:
    """A copy of the case's checkpoint in which only rank 1's file is damaged: rank 1 finds it,
    every rank refuses, and no rank's engine changes."""
    import shutil

    from zero_offload.checkpoint import CheckpointError
    from zero_offload.checkpoint.tensor_file import read_header
    from zero_offload.core import dist

    dst = Path(root) / "damaged"
    if dist.rank() == 0:
        shutil.copytree(Path(root) / case["id"], dst)
        path = dst / f"global_step{SPLIT}" / "rank_00001.safetensors"
        header = read_header(path)
        data = bytearray(path.read_bytes())
        data[header.data_start + header.tensors["group0.master"].begin + 8] ^= 0x10
        path.write_bytes(bytes(data))
    dist.barrier()
    with one_thread():
        engine, model = build(case)
        train(engine, case, 0, 1)
        before = snapshot(engine, model)
        try:
            engine.load_checkpoint(str(dst))
            msg = "loaded"
        except CheckpointError as e:
            msg = str(e)
        after = snapshot(engine, model)
        engine.destroy()
    unchanged = after["counters"] == before["counters"] and all(
        torch.equal(after[part][k], v)
        for part in ("master", "module")
        for k, v in before[part].items()
    )
    return {"msg": msg, "unchanged": unchanged}


def save_world2(cases: list[dict], root: str) -> dict:
    out = save_phase(cases, root)
    out["refused_saves"] = refused_saves(cases[0], root)
    return out


def resume_world2(cases: list[dict], root: str) -> dict:
    out = {"refused_load": refused_load(cases[0], root)}
    out.update(resume_phase(cases, root))
    return out


# ---- crash child ---------------------------------------------------------------------------------
CRASH_CASE = {"id": "crash", "stage": 2, "offload": True, "dtype": "fp32", "micro": 2, "gas": 1}


def crash_child(root: str, second_tag: str | None) -> None:
    """Save ``global_step2``, train a step, save again (under ``second_tag``, or the default tag):
    the environment makes that second save pause where the test kills it."""
    import os

    pause = os.environ.pop("ZERO_OFFLOAD_CHECKPOINT_PAUSE", None)
    engine, _ = build(CRASH_CASE)
    train(engine, CRASH_CASE, 0, 2)
    engine.save_checkpoint(root)
    train(engine, CRASH_CASE, 2, 3)
    if pause:
        os.environ["ZERO_OFFLOAD_CHECKPOINT_PAUSE"] = pause
    engine.save_checkpoint(root, tag=second_tag)
    print("save finished", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "crash":
        crash_child(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
