"""DeepSpeed's ``"optimizer": {"type": "Muon"}``: Muon for the params with ``use_muon`` true, an
AdamW aux group for the rest, at stages 0-3 on 1 and 2 ranks, trains like the published
algorithm in plain single-process PyTorch (``muon_reference.py``) on the same global batch, with
gradient accumulation and clipping; its momentum buffer resumes bitwise from a checkpoint and
loads at another world size; config keys and the ``use_muon`` flag are checked by name."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from muon_reference import ReferenceMuon, orthogonalize
from parity import assert_partitioned_if_asked, batches, global_step, make_model, reference_step

import zero_offload
from zero_offload.config import ConfigError
from zero_offload.runtime.update.muon.muon_math import orthogonalized

LR, ADAM_LR, MOMENTUM, WD, BETAS, EPS = 0.02, 3e-3, 0.9, 0.01, (0.9, 0.95), 1e-8
MUON = ("l1.weight", "l2.weight")  # both rectangular (24x16, 16x24): tall and wide
STEPS, GAS, MICRO, CLIP = 3, 2, 2, 0.5


def _model():
    model = make_model(unused=False)
    for name, p in model.named_parameters():
        p.use_muon = name in MUON
    return model


def _config(
    stage: int,
    dtype: str = "fp32",
    ns: str = "standard",
    world: int = 2,
    offload: bool = False,
    extra: dict | None = None,
) -> dict:
    """``extra``: {"params": {...}, "zero": {...}} laid over the optimizer params and the
    zero_optimization section."""
    cfg = {  # the global batch is 2 * GAS * MICRO samples at every world size
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS * 2 // world,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "Muon",
            "params": {
                "muon_lr": LR,
                "adam_lr": ADAM_LR,
                "momentum": MOMENTUM,
                "weight_decay": WD,
                "betas": list(BETAS),
                "eps": EPS,
                "ns_method": ns,
            },
        },
        # buckets of 100 elements: each Muon matrix is a bucket of its own, split across ranks
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
        "steps_per_print": 10**6,
    }
    if stage == 3:  # every param partitioned (asserted by _train)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling: the factor unscales before the momentum
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if offload:  # the state in host memory (reduce_scatter: its default, true)
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["optimizer"]["params"].update((extra or {}).get("params", {}))
    cfg["zero_optimization"].update((extra or {}).get("zero", {}))
    return cfg


def _reference(adamw: bool = True) -> tuple[dict, dict]:
    model = _model()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = ReferenceMuon(
        [p for n, p in named if n in MUON],
        [p for n, p in named if n not in MUON],
        LR,
        MOMENTUM,
        WD,
        ADAM_LR,
        BETAS,
        EPS,
        adamw,
    )
    for x, y in batches(STEPS, 2, GAS, MICRO):
        reference_step(model, opt, x, y, CLIP)
    return init, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(
    stage: int, dtype: str, ns: str, world: int, offload: bool = False, extra: dict | None = None
) -> dict:
    from zero_offload.core import dist
    from zero_offload.utils import safe_get_full_fp32_param

    cfg = _config(stage, dtype, ns, world, offload, extra)
    model = _model()
    engine = zero_offload.initialize(model=model, config=cfg)[0]
    assert_partitioned_if_asked(model, cfg)
    # (where the state lives, a momentum only): the Muon path is the one tested, beside Adam's
    kinds = {(g.state.where, g.state.exp_avg_sq is None) for g in engine.opt_groups}
    where = "host" if offload else "device"
    assert kinds == {(where, True), (where, False)}, kinds
    for x, y in batches(STEPS, 2, GAS, MICRO):  # the reference's global batches
        global_step(engine, x, y, world, dist.rank())
    named = engine.module.named_parameters()
    out = {n: safe_get_full_fp32_param(p).clone() for n, p in named if p.requires_grad}
    engine.destroy()
    return out


def _assert_parity(got: dict, init: dict, want: dict, tol: float) -> None:
    for n in MUON + ("emb.weight", "l1.bias", "norm.weight"):
        moved = (want[n] - init[n]).norm()
        err = (got[n].float() - want[n]).norm()
        assert moved > 0 and err / moved < tol, f"{n}: {float(err / moved):.2e} of its move"


@pytest.mark.parametrize(
    "world,stage",
    [
        (1, 0),
        pytest.param(1, 2, marks=pytest.mark.slow),
        pytest.param(2, 0, marks=pytest.mark.slow),
        (2, 1),
        (2, 2),
        (1, 3),
        (2, 3),
    ],
)
def test_muon_matches_reference(world: int, stage: int) -> None:
    init, want = _reference()
    got = run_ranks(world, _train, stage, "fp32", "standard", world)
    _assert_parity(got, init, want, 1e-4)


@pytest.mark.parametrize(
    "dtype,ns,tol",
    [
        ("fp32", "gram", 1e-4),
        ("bf16", "standard", 0.15),
        pytest.param("fp16", "standard", 0.05, marks=pytest.mark.slow),
    ],
)
def test_muon_variants_match_reference(dtype: str, ns: str, tol: float) -> None:
    """ "gram" is the same polynomial as the published quintic (fp32: equal to rounding); bf16
    params (fp32 master and momentum) track it within bf16's rounding of the forward."""
    init, want = _reference()
    got = run_ranks(2, _train, 2, dtype, ns, 2)
    for n in MUON:
        err = (got[n].float() - want[n]).norm() / (want[n] - init[n]).norm()
        assert err < tol, f"{n}: {float(err):.2e} of its move"


def _state(engine) -> dict:
    """Every trainable param's full fp32 value and optimizer state (Muon's momentum buffer,
    the aux group's Adam moments)."""
    from zero_offload.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            keys = ("momentum_buffer",) if n in MUON else ("exp_avg", "exp_avg_sq")
            out[n] = safe_get_full_fp32_param(p).clone()
            for k in keys:
                out[f"{n}.{k}"] = safe_get_full_optimizer_state(p, k).clone()
    return out


def _save_and_resume(root: str, stage: int, offload: bool = False) -> tuple[dict, dict, dict]:
    """(state at the save, after one more step straight on, after a fresh engine loaded the
    save and took the same step); 2 ranks."""
    from zero_offload.core import dist

    world, rank = dist.world_size(), dist.rank()
    steps = batches(3, 2, GAS, MICRO)
    cfg = _config(stage, world=world, offload=offload)
    engine = zero_offload.initialize(model=_model(), config=cfg)[0]
    for x, y in steps[:2]:
        global_step(engine, x, y, world, rank)
    engine.save_checkpoint(root, tag="t")
    saved = _state(engine)
    global_step(engine, *steps[2], world, rank)
    straight = _state(engine)
    engine.destroy()
    fresh = zero_offload.initialize(model=_model(), config=cfg)[0]
    fresh.load_checkpoint(root, tag="t")
    global_step(fresh, *steps[2], world, rank)
    resumed = _state(fresh)
    fresh.destroy()
    return saved, straight, resumed


def _load_only(root: str, stage: int, offload: bool = False) -> dict:
    from zero_offload.core import dist

    cfg = _config(stage, world=dist.world_size(), offload=offload)
    engine = zero_offload.initialize(model=_model(), config=cfg)[0]
    engine.load_checkpoint(root, tag="t")
    out = _state(engine)
    engine.destroy()
    return out


def test_muon_checkpoint_resumes_bitwise_and_reshards(tmp_path) -> None:
    """Stage 2 on 2 ranks: the resumed step equals the uninterrupted one bit for bit (momentum
    buffer included); the same checkpoint loaded on 1 rank at stage 1 holds the same values."""
    saved, straight, resumed = run_ranks(2, _save_and_resume, str(tmp_path), 2)
    assert any(k.endswith("momentum_buffer") and v.abs().sum() > 0 for k, v in saved.items())
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    loaded = run_ranks(1, _load_only, str(tmp_path), 1)
    for k in saved:
        assert torch.equal(saved[k], loaded[k]), k


def test_muon_math_gram_equals_standard_and_reference() -> None:
    """Tall, wide, square and conv-shaped (4-d) updates: both Newton-Schulz forms equal the
    published quintic to fp32 rounding, scale included."""
    torch.manual_seed(0)
    for shape in [(24, 16), (16, 24), (12, 12), (6, 3, 2, 2)]:
        u = torch.randn(shape)
        want = orthogonalize(u.reshape(shape[0], -1)) if len(shape) == 4 else orthogonalize(u)
        if len(shape) == 4:  # the published scale reads the param's last two dimensions
            want = want / max(1.0, shape[0] / (u[0].numel())) ** 0.5 * max(1, 2 / 2) ** 0.5
        for ns in ("standard", "gram"):
            got = orthogonalized(u, ns).reshape(want.shape)
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (shape, ns)


def _initialize(model, cfg, deepspeed: bool = False):
    if deepspeed:
        from zero_offload import deepspeed_compat

        return deepspeed_compat.initialize(model=model, config=cfg)[0]
    return zero_offload.initialize(model=model, config=cfg)[0]


def test_use_muon_missing_is_deepspeeds_error() -> None:
    model = make_model(unused=False)
    with pytest.raises(ValueError, match="the use_muon attribute is NOT configured"):
        _initialize(model, _config(1, world=1))
    model = _model()
    model.norm.weight.use_muon = True  # 1-d
    with pytest.raises(ValueError, match=r"use_muon is true for a param of shape \[16\]"):
        _initialize(model, _config(1, world=1))


def test_deepspeed_initialize_marks_params_by_deepspeeds_rule() -> None:
    """``deepspeed.initialize`` marks the params that lack the flag as DeepSpeed's
    ``set_optimizer_flags`` does (2-d and no "embed"/"lm_head" in the name); one set by the
    user is kept."""
    model = make_model(unused=False)
    model.l2.weight.use_muon = False
    engine = _initialize(model, _config(0, world=1), deepspeed=True)
    muon = {n for n, p in model.named_parameters() if p.use_muon}
    assert muon == {"emb.weight", "frozen.weight", "l1.weight"}
    (group,) = [g for g in engine.opt_groups if g.flat.hyper["use_muon"]]
    assert {id(p) for p in group.flat.params} == {id(model.emb.weight), id(model.l1.weight)}
    engine.destroy()


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu", "ratio": 0.5},
                }
            },
            'offload_optimizer.ratio: 0.5 with optimizer "Muon": partial offload',
        ),
        (
            {
                "zero_optimization": {
                    "stage": 1,
                    "reduce_scatter": False,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent"},
                }
            },
            'offload_optimizer.device: "nvme" with optimizer "Muon": its state is offloaded to '
            "host memory only",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 2,
                    "reduce_scatter": False,
                    "offload_optimizer": {"device": "cpu", "delayed_update": True},
                }
            },
            'offload_optimizer.delayed_update: true with optimizer "Muon"',
        ),
        ({"optimizer": {"type": "muon", "params": {"ns_method": "svd"}}}, "ns_method: allowed"),
        ({"optimizer": {"type": "Muon", "params": {"momentum": 1.5}}}, "momentum: must be <"),
        ({"optimizer": {"type": "Muon", "params": {"nesterov": True}}}, 'unknown key "optimizer'),
    ],
)
def test_muon_config_errors_name_the_key(change: dict, message: str) -> None:
    from zero_offload.config import load_config

    cfg = {**_config(1, world=1), **change}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(cfg)


def test_muon_takes_deepspeeds_adam_keys() -> None:
    """The keys DeepSpeed 0.19.8 reads under Muon (for its aux Adam): torch_adam and foreach
    pick an implementation (the same update here), adam_w_mode false makes the aux group Adam
    with L2 decay, fp32_optimizer_states is accepted with the not-built warning."""
    from zero_offload.config import NotImplementedSettingWarning, load_config

    base = {"train_micro_batch_size_per_gpu": 1}
    params = {"torch_adam": True, "foreach": False, "adam_w_mode": False}
    opt = load_config({**base, "optimizer": {"type": "Muon", "params": params}}).optimizer
    assert (opt.params.torch_adam, opt.params.foreach, opt.adamw) == (True, False, False)
    assert load_config({**base, "optimizer": {"type": "Muon"}}).optimizer.adamw
    with pytest.warns(NotImplementedSettingWarning, match="fp32_optimizer_states"):
        load_config({**base, "optimizer": {"type": "Muon", "params": {"fp32_optimizer_states": 1}}})


@pytest.mark.parametrize("offload", [False, True])
def test_muon_adam_w_mode_false_is_l2_adam_for_the_aux_group(offload: bool) -> None:
    init, want = _reference(adamw=False)
    params = {"adam_w_mode": False, "torch_adam": True}
    got = run_ranks(2, _train, 2, "fp32", "standard", 2, offload, {"params": params})
    _assert_parity(got, init, want, 1e-4)
    _, adamw_want = _reference()
    assert (want["emb.weight"] - adamw_want["emb.weight"]).norm() > 1e-4  # the test can tell


def test_muon_config_splits_keys_as_deepspeed() -> None:
    """lr reaches both groups unless muon_lr / adam_lr overrides it; momentum and ns_method go
    to the Muon group only, betas and eps to the aux group; unset, DeepSpeed's defaults."""
    from zero_offload.config import load_config

    base = {"train_micro_batch_size_per_gpu": 1}
    p = load_config({**base, "optimizer": {"type": "Muon", "params": {"lr": 0.1}}}).optimizer
    assert p.params.muon_group()["lr"] == p.params.aux_group()["lr"] == 0.1
    p = load_config({**base, "optimizer": {"type": "Muon"}}).optimizer.params
    muon, aux = p.muon_group(), p.aux_group()
    assert (muon["lr"], muon["momentum"], muon["ns_method"]) == (0.02, 0.95, "gram")
    assert (aux["lr"], aux["betas"], aux["eps"]) == (3e-4, (0.9, 0.95), 1e-10)
    assert "momentum" not in aux and "betas" not in muon


def _memory(stage: int, dtype: str, offload: bool = False) -> dict:
    from zero_offload.core import dist

    cfg = _config(stage, dtype, world=dist.world_size(), offload=offload)
    engine = zero_offload.initialize(model=_model(), config=cfg)[0]
    global_step(engine, *batches(1, 2, GAS, MICRO)[0], dist.world_size(), dist.rank())
    have = {k: v for k, v in engine.memory_report().items() if not k.startswith("peak.")}
    # stage 3: the frozen Linear's param shard, which expected_memory() does not count (it
    # counts the trainable params); not Muon's question
    have.pop("device.frozen_param_shard", None)
    muon = [g for g in engine.opt_groups if g.flat.hyper["use_muon"]][0]
    out = {"have": have, "want": engine.expected_memory(), "muon": muon.state.nbytes()}
    out["shard"] = muon.flat.shard_numel(stage >= 1)
    engine.destroy()
    return out


@pytest.mark.parametrize("world,stage,dtype", [(1, 1, "bf16"), (2, 2, "fp32"), (2, 3, "fp32")])
def test_muon_state_is_the_momentum_only(world: int, stage: int, dtype: str) -> None:
    """The Muon group keeps one fp32 momentum per element of its shard (Adam keeps two), and the
    engine's memory formula says what it allocated."""
    r = run_ranks(world, _memory, stage, dtype)
    assert r["muon"]["device.optimizer_state"] == 4 * r["shard"]
    assert r["have"] == r["want"]
