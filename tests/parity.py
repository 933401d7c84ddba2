"""Parity harness: train the same tiny model with the engine (any stage, offload, world size) and
with plain single-process PyTorch AdamW on the same global batch, and measure the difference the
way the design notes define it: gradients by relative error, parameters by their distance from
the reference divided by the reference's own displacement from the initial weights."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

VOCAB, DIM, HID, SEQ = 32, 16, 24, 5


class Tiny(torch.nn.Module):
    """Tied embedding/head (a param larger than the test buckets), an unused param, a frozen one."""

    def __init__(self, unused: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.l1 = torch.nn.Linear(DIM, HID)
        self.l2 = torch.nn.Linear(HID, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        if unused:
            self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + 0.1 * self.frozen(h)
        h = self.norm(self.l2(torch.tanh(self.l1(h))))
        logits = h @ self.emb.weight.t()
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def make_model(seed: int = 0, unused: bool = True) -> Tiny:
    torch.manual_seed(seed)
    return Tiny(unused)


def batches(steps: int, world: int, gas: int, micro: int, seed: int = 1):
    """Global batches: step -> (x, y) of world*gas*micro samples."""
    g = torch.Generator().manual_seed(seed)
    n = world * gas * micro
    return [
        (
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
            torch.randint(0, VOCAB, (n, SEQ), generator=g),
        )
        for _ in range(steps)
    ]


LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8


def reference_step(model, opt, x, y, clip: float = 0.0, grads: list | None = None):
    """One plain PyTorch step on the whole global batch; unused params get zero gradients, as
    the engine reduces them."""
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    if grads is not None:
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def reference(steps: int, world: int, gas: int, micro: int, clip: float):
    """Plain PyTorch: one process, whole global batch, AdamW."""
    model = make_model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WD,
    )
    grads, losses = [], []
    for x, y in batches(steps, world, gas, micro):
        loss = reference_step(model, opt, x, y, clip, grads)
        losses.append(float(loss))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return init, params, grads, losses


def engine_config(
    stage: int,
    offload: bool | str,
    gas: int,
    micro: int,
    clip: float,
    overlap: bool,
    dtype: str = "fp32",
    bucket: int = 100,
    offload_param: bool | str = False,
    zero_extra: dict | None = None,
    **offload_extra,
) -> dict:
    zero: dict = {
        "stage": stage,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": 40,
        "overlap_comm": overlap,
        **(zero_extra or {}),
    }
    # offload / offload_param: True means "cpu"; a string names the device ("nvme" takes the
    # nvme_path of offload_extra).
    nvme_path = offload_extra.pop("nvme_path", None)
    if offload:
        device = offload if isinstance(offload, str) else "cpu"
        zero["offload_optimizer"] = {"device": device, **offload_extra}
        if device == "nvme":
            zero["offload_optimizer"]["nvme_path"] = nvme_path
    if offload_param:
        device = offload_param if isinstance(offload_param, str) else "cpu"
        zero["offload_param"] = {"device": device}
        if device == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def with_states(cfg: dict, states: str) -> dict:
    """``cfg`` (bf16 training) with an optimizer state format: "bf16" (DeepSpeed's
    ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``), "8bit" (the bf16 master and
    ``AdamW8bit``) or "fp32" (unchanged)."""
    if states in ("bf16", "8bit"):
        cfg["bf16"]["bf16_master_weights_and_grads"] = True
    if states == "bf16":
        cfg["bf16"]["bf16_optimizer_states"] = True
    elif states == "8bit":
        cfg["optimizer"]["type"] = "AdamW8bit"
    return cfg


def global_step(engine, x: torch.Tensor, y: torch.Tensor, world: int = 1, rank: int = 0) -> float:
    """One optimizer step of ``engine`` on this rank's share of the global batch ``x, y``
    (rows ordered micro-step by micro-step, rank by rank); returns this rank's mean loss."""
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    total = 0.0
    for k in range(gas):
        lo = (k * world + rank) * micro
        loss = engine(x[lo : lo + micro], y[lo : lo + micro])
        engine.backward(loss)
        engine.step()
        total += float(loss.detach()) / gas
    return total


def run_engine(
    cfg: dict, steps: int, micro: int, gas: int, init: bool = False, plain: bool = False
):
    """Train with the engine on this rank's share of each global batch; ``plain``: a plain
    ``loss.backward()`` (``engine.scale(loss).backward()`` with fp16) instead of
    ``engine.backward(loss)``."""
    import zero_offload
    import zero_offload.zero
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param, safe_get_full_grad

    world, rank = dist.world_size(), dist.rank()
    with zero_offload.zero.Init(enabled=init):  # init: partitioned as it is built
        model = make_model()
    engine, _, _, _ = zero_offload.initialize(model=model, config=copy.deepcopy(cfg))
    assert_partitioned_if_asked(model, cfg)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    grads, losses = [], []
    for x, y in batches(steps, world, gas, micro):
        step_loss = 0.0
        for k in range(gas):
            lo = (k * world + rank) * micro
            loss = engine(
                x[lo : lo + micro].to(engine.device), y[lo : lo + micro].to(engine.device)
            )
            if not plain:
                engine.backward(loss)
            elif engine.fp16_enabled():
                engine.scale(loss).backward()
            else:
                loss.backward()
            step_loss += float(loss.detach()) / gas
            if engine.is_gradient_accumulation_boundary():
                grads.append(
                    {
                        n: safe_get_full_grad(p)
                        for n, p in zip(names, [dict(model.named_parameters())[n] for n in names])
                    }
                )
            engine.step()
        t = torch.tensor([step_loss])
        if world > 1:
            torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    engine.flush_delayed_update()
    named = dict(model.named_parameters())
    params = {n: safe_get_full_fp32_param(named[n]).cpu() for n in names}
    with zero_offload.zero.GatheredParameters(model.parameters()):  # stage 3: full params
        params.update(
            {n: p.detach().float().cpu() for n, p in named.items() if not p.requires_grad}
        )
        device_params = {n: p.detach().float().cpu() for n, p in named.items()}
    grads = [{n: t.cpu() for n, t in g.items()} for g in grads]
    return params, device_params, grads, losses, engine.memory_report(), engine.expected_memory()


def grad_rel_err(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b)


def displacement_err(params: dict, ref: dict, init: dict) -> float:
    num = sum(float((params[n].float() - ref[n]).square().sum()) for n in ref)
    den = sum(float((ref[n] - init[n]).square().sum()) for n in ref)
    return (num / den) ** 0.5


def run_cases(cases: list[dict]) -> list[dict]:
    """Each case: engine config kwargs + steps/micro/gas; returns measured errors per case."""
    from zero_offload.core import dist

    world = dist.world_size()
    out = []
    refs: dict = {}
    for case in cases:
        c = dict(case)
        steps, micro = c.pop("steps", 4), c.pop("micro", 2)
        gas, clip = c["gas"], c["clip"]
        key = (steps, world, gas, micro, clip)
        if key not in refs:
            refs[key] = reference(steps, world, gas, micro, clip)
        init, ref_params, ref_grads, ref_losses = refs[key]
        init_ctx, plain = c.pop("init", False), c.pop("plain", False)
        params, device_params, grads, losses, mem, expected = run_engine(
            engine_config(micro=micro, **c), steps, micro, gas, init=init_ctx, plain=plain
        )
        out.append(
            {
                "case": case,
                "grad_err": max(grad_rel_err(g, rg) for g, rg in zip(grads, ref_grads)),
                "param_err": displacement_err(params, ref_params, init),
                "device_param_err": displacement_err(device_params, ref_params, init),
                "losses": losses,
                "ref_losses": ref_losses,
                "params": params,
                "init": init,
                "memory": mem,
                "expected": expected,
            }
        )
    return out


def assert_partitioned_if_asked(model: torch.nn.Module, cfg: dict) -> None:
    """A stage-3 config with persistence threshold 0 really partitioned every param."""
    zc = cfg.get("zero_optimization", {})
    if zc.get("stage") == 3 and zc.get("stage3_param_persistence_threshold") == 0:
        assert all(p.numel() == 0 < p.ds_numel for p in model.parameters())
