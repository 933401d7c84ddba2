"""Train a tiny model with ZenFlow, under DeepSpeed itself or this project, and save the params
after initialize and after every ``step()``: the parity tests compare the two runs.

    python tests/zenflow_run.py OUT --impl deepspeed|zero_offload [--zenflow JSON] [--clip C]
        [--steps 6] [--shape mlp|nobias|odd] [--stage 1|2|3] [--offload-param]
        [--dtype fp32|bf16|fp16] [--fix-binding]

One process per rank, gloo, on the CPU (several ranks: the caller starts one per rank with
RANK, WORLD_SIZE and MASTER_PORT set; each rank trains on its own batches). DeepSpeed is imported only with ``--impl deepspeed`` (a
subprocess of the test), so the project's run never sees DeepSpeed's modules; ``--fix-binding``
runs DeepSpeed's ZenFlow with its param binding fixed, its overlapped updates in order and its
``update_interval`` "auto" made to run (docs/zenflow.md), and its stage 3 on the CPU
(``zenflow_ds3_patches.py``). Stage 3 partitions every param (``--offload-param``: into host
memory); the params are gathered to be saved, each in the model's own shape (DeepSpeed's
stage-3 ZenFlow stores 2-D params transposed)."""

from __future__ import annotations

import argparse
import json
import os

import torch
from zenflow_ds3_patches import (
    finish_overlapped_updates_stage3,
    fix_auto_update_stage3,
    fix_stage3_devices,
    fix_stage3_moment_shapes,
)

TOPK = {
    "topk_ratio": 0.25,
    "select_strategy": "step",
    "select_interval": 2,
    "update_interval": 2,
    "full_warm_up_rounds": 0,
    "overlap_step": False,
}


def make_model(shape: str = "mlp") -> torch.nn.Module:
    """``"mlp"``: a tiny MLP; ``"nobias"``: the same without biases (DeepSpeed 0.19.8's column
    selection misreads its gradient bucket after a 1-D param, docs/zenflow.md); ``"odd"``:
    widths whose columns stage 3's partition cuts on two ranks, without biases (DeepSpeed 0.19.8's
    stage-3 ZenFlow fails on a 1-D param of odd length on two ranks: its last rank's gradient
    partition is one element shorter than its param partition)."""
    torch.manual_seed(0)
    # the "odd" model's (6, 9) weight has its column 4 straddle stage 3's 2-rank cut
    widths = (8, 9, 6, 4) if shape == "odd" else (8, 16, 12, 4)
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b, bias=shape == "mlp"), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batches(n: int, rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank 0's batches are the one-rank run's; every other rank has its own."""
    g = torch.Generator().manual_seed(1 + 1000 * rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def config(
    zenflow: dict | None,
    clip: float = 0.0,
    stage: int = 2,
    dtype: str = "fp32",
    offload_param: bool = False,
) -> dict:
    """Stage 3: every param partitioned (persistence threshold 0), and with ``offload_param``
    its partition in host memory."""
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
        if offload_param:
            zero["offload_param"] = {"device": "cpu"}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    precision = {dtype: {"enabled": True}} if dtype != "fp32" else {}
    return {
        **precision,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def train(
    initialize,
    cfg: dict,
    steps: int,
    shape: str = "mlp",
    rank: int = 0,
    gather=None,
    transposed: bool = False,
    boundary_each_step: bool = False,
) -> list[list[torch.Tensor]]:
    """The params after initialize, then after every step (``rank``'s batches; Muon: for the
    2-D params), each in the model's own shape. ``gather``: the ``GatheredParameters`` that
    reads a stage-3 engine's partitioned params; ``transposed``: its 2-D params are stored
    transposed (DeepSpeed's stage-3 ZenFlow); ``boundary_each_step``: every step says it ends
    the accumulation window, as accelerate's DeepSpeed wrapper does under the Trainer
    (``set_gradient_accumulation_boundary(True)`` before each backward)."""
    model = make_model(shape)
    shapes = [p.shape for p in model.parameters()]
    if (cfg.get("optimizer") or {}).get("type") == "Muon":
        for p in model.parameters():
            p.use_muon = p.dim() == 2
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=cfg)
    out = [read_params(engine, shapes, gather, transposed)]
    dtype = next(engine.module.parameters()).dtype
    for x, y in batches(steps, rank):
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        if boundary_each_step:
            engine.set_gradient_accumulation_boundary(True)
        engine.backward(loss)
        engine.step()
        out.append(read_params(engine, shapes, gather, transposed))
    return out


def read_params(engine, shapes, gather=None, transposed: bool = False) -> list[torch.Tensor]:
    """The engine's params in fp32, each in the model's shape ``shapes`` (gathered whole first
    with ``gather``; ``transposed``: every 2-D param's storage is its transpose)."""
    params = list(engine.module.parameters())
    if gather is None:
        return [p.detach().clone().float() for p in params]
    out = []
    with gather(params):
        for p, s in zip(params, shapes):
            t = p.detach().t() if transposed and p.dim() == 2 else p.detach()
            if t.shape != s:
                raise ValueError(
                    f"gathered param of shape {tuple(t.shape)}, the model's {tuple(s)}"
                )
            out.append(t.clone().float())
    return out


def fix_deepspeed_binding() -> None:
    """DeepSpeed 0.19.8's stage 1/2 ZenFlow lays 2-D params out column-major in its flat buffer
    (its gradients and selection read it so) but binds each module param as a row-major view of
    it, which scrambles every 2-D param at initialize. This binds them as the column-major
    views the rest of its code expects; nothing else of DeepSpeed changes."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def bind(self, group_index):
        flat_group = self.bit16_groups_flat[group_index]
        for p, meta, offset in zip(
            self.round_robin_bit16_groups[group_index],
            self.round_robin_bit16_meta[group_index],
            self.round_robin_bit16_offsets[group_index],
        ):
            view = flat_group.narrow(0, offset, meta.numel())
            if self.zenflow and len(meta.shape) == 2:
                view = view.view(meta.shape[1], meta.shape[0]).t()
            else:
                view = view.view(meta.shape)
            p.data = view.data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            new_index = self.round_robin_bit16_indices[group_index][param_index]
            param.data = self.round_robin_bit16_groups[group_index][new_index].data

    DeepSpeedZeroOptimizer._update_model_bit16_weights = bind


def finish_overlapped_updates() -> None:
    """DeepSpeed's overlapped host update (``overlap_step``) runs in a separate process that
    reads and writes the master while the next steps run, so which master it updates depends on
    timing (two runs of the same script differ). This makes every update finish as it is
    submitted (the order a fast optimizer process gives), keeping DeepSpeed's own waits: each
    one then takes the completion drained here."""
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizerParallel

    submit = ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step
    wait = ZenFlowZeroOptimizerParallel._wait_for_optimizer_process

    def submit_and_finish(self, now_state, norm):
        submit(self, now_state, norm)
        wait(self)
        self._finished = getattr(self, "_finished", 0) + 1

    def take_finished(self):
        if getattr(self, "_finished", 0) > 0:
            self._finished -= 1
            return
        wait(self)

    ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step = submit_and_finish
    ZenFlowZeroOptimizerParallel._wait_for_optimizer_process = take_finished


def fix_auto_update() -> None:
    """``update_interval`` "auto" in DeepSpeed 0.19.8 sets gradient_accumulation_steps to 0, so
    its backward divides the loss by 0 (NaN params from the second step), and its engine flips
    the auto-update state after the optimizer's backward prologue has cleared the flag the last
    backward set, so the rule never ends an interval. This sets gradient_accumulation_steps to 1
    under "auto" (the loss is not divided) and flips the state before that prologue; the rule
    itself is DeepSpeed's, unchanged."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizer

    configure = ds_engine.configure_zenflow

    def configure_with_gas(engine) -> None:
        configure(engine)
        if getattr(engine, "auto_update", False):
            engine._config.gradient_accumulation_steps = 1

    prologue = ZenFlowZeroOptimizer.backward_prologue

    def prologue_after_flip(self) -> None:
        if self.auto_update:  # the engine's flip, made first; undone for the engine to redo
            self.zenflow_state ^= 1
        prologue(self)
        if self.auto_update:
            self.zenflow_state ^= 1

    ds_engine.configure_zenflow = configure_with_gas
    ZenFlowZeroOptimizer.backward_prologue = prologue_after_flip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--impl", choices=["deepspeed", "zero_offload"], required=True)
    ap.add_argument("--zenflow", default=json.dumps(TOPK))
    ap.add_argument("--clip", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--shape", choices=["mlp", "nobias", "odd"], default="mlp")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--offload-param", action="store_true")  # stage 3: offload_param cpu
    # DeepSpeed's ZenFlow with its param binding fixed and its overlapped updates in order
    # (stage 3: its CUDA-only buffers on the CPU, zenflow_ds3_patches.py)
    ap.add_argument("--fix-binding", action="store_true")
    ap.add_argument("--boundary-each-step", action="store_true")  # accelerate's wrapper
    args = ap.parse_args(argv)
    if args.offload_param and args.stage != 3:
        ap.error("--offload-param needs --stage 3")
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 2000))
    torch.set_num_threads(1)
    zf = json.loads(args.zenflow)
    cfg = config(zf, args.clip, args.stage, args.dtype, args.offload_param)
    gather = None
    if args.impl == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        if args.fix_binding:
            fix_deepspeed_binding()
            finish_overlapped_updates()
            fix_auto_update()
            fix_stage3_devices()
            fix_stage3_moment_shapes()
            finish_overlapped_updates_stage3()
            fix_auto_update_stage3()
        initialize = deepspeed.initialize
        if args.stage == 3:
            gather = deepspeed.zero.GatheredParameters
    else:
        import zero_offload

        initialize = zero_offload.initialize
        if args.stage == 3:
            gather = zero_offload.zero.GatheredParameters
    rank = int(os.environ["RANK"])
    # DeepSpeed's stage-3 ZenFlow stores each 2-D param transposed (its column contiguous)
    transposed = args.impl == "deepspeed" and args.stage == 3 and zf is not None
    run = train(
        initialize, cfg, args.steps, args.shape, rank, gather, transposed, args.boundary_each_step
    )
    torch.save(run, args.out)


if __name__ == "__main__":
    main()
