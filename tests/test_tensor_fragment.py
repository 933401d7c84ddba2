"""DeepSpeed's tensor-fragment API (zero_offload.utils): every stage, with and without offload,
1 and 2 ranks. A plain PyTorch copy of the model gets the same edits (weights, Adam state,
gradients); the engine's losses, gradients and updated weights must follow it."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from parity import BETAS, EPS, LR, WD, batches, engine_config, make_model

CASES = [
    dict(stage=0),
    dict(stage=1),
    dict(stage=1, offload=True),
    dict(stage=2),
    dict(stage=2, offload=True),
    dict(stage=2, offload=True, delayed=True),
    dict(stage=3),
    dict(stage=3, offload=True),
    dict(stage=3, offload_param=True),
    dict(stage=3, offload=True, offload_param=True),
    dict(stage=3, offload=True, offload_param=True, delayed=True),
]
MICRO = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _config(case: dict) -> dict:
    extra = {"delayed_update": True, "delayed_update_after": 0} if case.get("delayed") else {}
    return engine_config(
        stage=case["stage"],
        offload=case.get("offload", False),
        gas=1,
        micro=MICRO,
        clip=0.0,
        overlap=False,
        offload_param=case.get("offload_param", False),
        zero_extra={"stage3_param_persistence_threshold": 0} if case["stage"] == 3 else None,
        **extra,
    )


def _values(model, seed: int, scale: float, positive: bool = False) -> dict:
    """One new full tensor per trainable param (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            t = torch.randn(tuple(getattr(p, "ds_shape", p.shape)), generator=g) * scale
            out[n] = t.abs() if positive else t
    return out


class _Errors:
    """Largest difference seen per check, and failed conditions."""

    def __init__(self) -> None:
        self.err: dict[str, float] = {}
        self.failed: list[str] = []

    def close(self, name: str, got, want) -> None:
        got = torch.as_tensor(got).detach().float().cpu()
        want = torch.as_tensor(want).detach().float().cpu()
        if got.shape != want.shape:
            self.failed.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        try:
            torch.testing.assert_close(got, want, **TOL)
        except AssertionError:
            self.failed.append(f"{name}: max diff {float((got - want).abs().max()):.3g}")

    def check(self, name: str, ok: bool) -> None:
        if not ok:
            self.failed.append(name)


def _pieces(local: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's local piece, in rank order."""
    from zero_offload.core import dist

    out = [None] * dist.world_size()
    dist.all_gather_object(out, local.cpu())
    return out


def _set_local(set_fn, param, full: torch.Tensor, sizes: list[int], *key) -> None:
    from zero_offload.core import dist

    start = sum(sizes[: dist.rank()])
    set_fn(param, full.reshape(-1)[start : start + sizes[dist.rank()]].clone(), *key)


def _run_case(case: dict) -> list[str]:
    """One engine and its plain PyTorch twin through: a step, full and local (stage 3) edits of
    weights and Adam state, a forward, a backward with edited gradients, a step, a forward."""
    import zero_offload
    import zero_offload.zero as zero
    from zero_offload import utils as u
    from zero_offload.core import dist

    world, rank = dist.world_size(), dist.rank()
    stage = case["stage"]
    e = _Errors()
    model, ref = make_model(unused=False), make_model(unused=False)
    engine, *_ = zero_offload.initialize(model=model, config=_config(case))
    named, rnamed = dict(model.named_parameters()), dict(ref.named_parameters())
    train = [n for n, p in named.items() if p.requires_grad]
    opt = torch.optim.AdamW(
        [rnamed[n] for n in train], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD
    )
    data = batches(3, world, 1, MICRO, seed=7)
    dev = engine.device

    def mine(x):  # this rank's micro-batch of a global batch
        return x[rank * MICRO : (rank + 1) * MICRO]

    def partitioned() -> bool:
        return stage != 3 or all(p.numel() == 0 for p in model.parameters())

    def engine_loss(b) -> torch.Tensor:
        x, y = data[b]
        return engine(mine(x).to(dev), mine(y).to(dev))

    def ref_loss(b) -> torch.Tensor:
        x, y = data[b]
        with torch.no_grad():
            return ref(mine(x), mine(y))

    def ref_backward(b) -> None:
        opt.zero_grad()
        ref(*data[b]).backward()

    # a first step, so the edits land on a trained state (and, delayed, on a pending update)
    engine.backward(engine_loss(0))
    engine.step()
    ref_backward(0)
    opt.step()
    e.check("partitioned after init", partitioned())

    # ---- full fp32 weights and Adam state ---------------------------------------------------
    new = _values(model, 1, 0.3)
    for n in train:
        u.safe_set_full_fp32_param(named[n], new[n])
        rnamed[n].data.copy_(new[n])
    for n in train:
        e.close(f"full fp32 {n}", u.safe_get_full_fp32_param(named[n]), new[n])
    if stage < 3:
        for n in train:
            e.close(f"16-bit {n}", named[n], new[n])
    e.check("partitioned after full set", partitioned())
    states = {"exp_avg": _values(model, 2, 0.01), "exp_avg_sq": _values(model, 3, 1e-3, True)}
    for key, vals in states.items():
        for n in train:
            u.safe_set_full_optimizer_state(named[n], vals[n], key)
            opt.state[rnamed[n]][key].copy_(vals[n])
        for n in train:
            e.close(f"full {key} {n}", u.safe_get_full_optimizer_state(named[n], key), vals[n])

    # ---- local pieces (stage 3); other stages raise, as DeepSpeed asserts -----------------------
    if stage == 3:
        p = named["l1.weight"]
        with zero.GatheredParameters([p]):  # a gathered copy follows a set
            u.safe_set_full_fp32_param(p, new["l1.weight"] * 2)
            e.close("gathered after full set", p, new["l1.weight"] * 2)
            sizes = [t.numel() for t in _pieces(u.safe_get_local_fp32_param(p))]
            _set_local(u.safe_set_local_fp32_param, p, new["l1.weight"], sizes)
            e.close("gathered after local set", p, new["l1.weight"])
        for n in train:
            p = named[n]
            pieces = _pieces(u.safe_get_local_fp32_param(p))
            e.check(f"local pieces 1-D {n}", all(t.dim() == 1 for t in pieces))
            e.check(
                f"local piece is ds_tensor's size {n}", pieces[rank].numel() == p.ds_tensor.numel()
            )
            e.close(f"local fp32 {n}", torch.cat(pieces), new[n].reshape(-1))
            sizes = [t.numel() for t in pieces]
            new[n] = new[n] * 0.5 + 0.01
            _set_local(u.safe_set_local_fp32_param, p, new[n], sizes)
            rnamed[n].data.copy_(new[n])
            e.close(f"full after local set {n}", u.safe_get_full_fp32_param(p), new[n])
            for key, vals in states.items():
                pieces = _pieces(u.safe_get_local_optimizer_state(p, key))
                e.close(f"local {key} {n}", torch.cat(pieces), vals[n].reshape(-1))
                vals[n] = vals[n] * 2
                _set_local(u.safe_set_local_optimizer_state, p, vals[n], sizes, key)
                opt.state[rnamed[n]][key].copy_(vals[n])
                e.close(
                    f"full {key} after local set {n}",
                    u.safe_get_full_optimizer_state(p, key),
                    vals[n],
                )
        e.check("partitioned after local set", partitioned())
    else:
        for fn, args in (
            (u.safe_get_local_fp32_param, ()),
            (u.safe_get_local_grad, ()),
            (u.safe_get_local_optimizer_state, ("exp_avg",)),
            (u.safe_set_local_fp32_param, (torch.zeros(1),)),
            (u.safe_set_local_optimizer_state, (torch.zeros(1), "exp_avg")),
        ):
            with pytest.raises(AssertionError, match=fn.__name__):
                fn(named["l1.weight"], *args)

    # ---- frozen and unmanaged params ------------------------------------------------------------
    frozen = named["frozen.weight"]
    e.check("frozen fp32 None", u.safe_get_full_fp32_param(frozen) is None)
    e.check("frozen grad None", u.safe_get_full_grad(frozen) is None)
    e.check("frozen state None", u.safe_get_full_optimizer_state(frozen, "exp_avg") is None)
    u.safe_set_full_fp32_param(
        frozen, torch.full(frozen.ds_shape if stage == 3 else frozen.shape, 9.0)
    )
    u.safe_set_full_optimizer_state(frozen, torch.zeros(256), "exp_avg")
    if stage == 3:
        e.check("frozen local None", u.safe_get_local_fp32_param(frozen) is None)
        e.check(
            "frozen local state None", u.safe_get_local_optimizer_state(frozen, "exp_avg") is None
        )
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not managed by a live zero_offload engine"):
        u.safe_get_full_fp32_param(stray)
    with pytest.raises(ValueError, match="not managed"):
        u.safe_set_full_fp32_param(stray, torch.ones(3))
    e.check("frozen stray None", u.safe_get_full_fp32_param(stray.requires_grad_(False)) is None)
    with pytest.raises(ValueError, match="elements"):
        u.safe_set_full_fp32_param(named["l1.weight"], torch.zeros(5))

    # ---- a forward on the edited weights; a backward; edited gradients ---------------------------
    e.close("loss after edits", engine_loss(1).detach(), ref_loss(1))
    loss = engine_loss(1)
    with pytest.raises(RuntimeError, match="after the backward"):
        u.safe_set_full_grad(named["l1.bias"], torch.zeros(24))
    engine.backward(loss)
    ref_backward(1)
    for n in train:
        e.close(f"grad {n}", u.safe_get_full_grad(named[n]), rnamed[n].grad)
    if stage == 3:
        for n in train:
            e.close(
                f"local grad {n}",
                torch.cat(_pieces(u.safe_get_local_grad(named[n]))),
                rnamed[n].grad.reshape(-1),
            )

    def update(g, p):
        return g * 3.0 + (0.01 if len(getattr(p, "ds_shape", p.shape)) == 2 else -0.02)

    u.safe_update_full_grad_vectorized([named[n] for n in train] + [frozen], update)
    for n in train:
        rnamed[n].grad.copy_(update(rnamed[n].grad, rnamed[n]))
    bias = torch.linspace(-1, 1, 24)
    u.safe_set_full_grad(named["l1.bias"], bias)
    rnamed["l1.bias"].grad.copy_(bias)
    if stage == 3:
        p = named["norm.weight"]
        sizes = [t.numel() for t in _pieces(u.safe_get_local_grad(p))]
        _set_local(u.safe_set_local_grad, p, torch.full((16,), 0.25), sizes)
        rnamed["norm.weight"].grad.fill_(0.25)
    for n in train:
        e.close(f"edited grad {n}", u.safe_get_full_grad(named[n]), rnamed[n].grad)
    ref_norm = torch.linalg.vector_norm(torch.stack([rnamed[n].grad.norm() for n in train]))

    # ---- the step continues from the edited weights, state and gradients -----------------------
    engine.step()
    opt.step()
    e.close("grad norm of edited grads", engine.get_global_grad_norm(), ref_norm)
    for n in train:
        e.close(f"stepped fp32 {n}", u.safe_get_full_fp32_param(named[n]), rnamed[n])
        for key in states:
            e.close(
                f"stepped {key} {n}",
                u.safe_get_full_optimizer_state(named[n], key),
                opt.state[rnamed[n]][key],
            )
    e.check("partitioned after step", partitioned())
    e.close("loss after step", engine_loss(2).detach(), ref_loss(2))
    engine.destroy()
    with pytest.raises(ValueError, match="not managed"):  # its engine is gone
        u.safe_get_full_fp32_param(named["l1.weight"])
    return e.failed


def _sweep(cases: list[dict]) -> list[list[str]]:
    """Every case on this rank; every rank's failures (gathered, so rank 1's are seen too)."""
    from zero_offload.core import dist

    mine = [[f"{case}: {f}" for f in _run_case(copy.deepcopy(case))] for case in cases]
    out = [None] * dist.world_size()
    dist.all_gather_object(out, mine)
    return [f for rank in out for case in rank for f in case]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_tensor_fragment_world1(case):
    assert _sweep([case]) == []


def test_tensor_fragment_world2():
    assert run_ranks(2, _sweep, CASES) == []


@pytest.mark.parametrize("stage", [1, 3])
def test_client_optimizer_state(stage):
    """A client optimizer's own state (SGD's momentum_buffer) is reachable by its key, as
    DeepSpeed exposes any state tensor shaped like the partition; writing it changes the step."""
    import zero_offload
    from zero_offload import utils as u

    cfg = _config(dict(stage=stage))
    del cfg["optimizer"]
    model, ref = make_model(unused=False), make_model(unused=False)
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731
    engine, *_ = zero_offload.initialize(
        model=model, optimizer=sgd([p for p in model.parameters() if p.requires_grad]), config=cfg
    )
    opt = sgd([p for p in ref.parameters() if p.requires_grad])
    named, rnamed = dict(model.named_parameters()), dict(ref.named_parameters())
    train = [n for n, p in named.items() if p.requires_grad]
    x, y = batches(1, 1, 1, MICRO)[0]
    with pytest.raises(ValueError, match="momentum_buffer"):  # created at the first step
        u.safe_get_full_optimizer_state(named["l1.weight"], "momentum_buffer")
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
        opt.zero_grad()
        ref(x, y).backward()
        opt.step()
        buf = _values(model, 4, 0.1)
        for n in train:
            u.safe_set_full_optimizer_state(named[n], buf[n], "momentum_buffer")
            opt.state[rnamed[n]]["momentum_buffer"].copy_(buf[n])
            got = u.safe_get_full_optimizer_state(named[n], "momentum_buffer")
            torch.testing.assert_close(got, buf[n], rtol=0, atol=0)
    for n in train:
        torch.testing.assert_close(u.safe_get_full_fp32_param(named[n]), rnamed[n].detach(), **TOL)
    with pytest.raises(ValueError, match="'exp_avg' is not in the optimizer state"):
        u.safe_get_full_optimizer_state(named["l1.weight"], "exp_avg")
