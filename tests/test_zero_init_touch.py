"""zero.Init with models written for one device: a parent's ``__init__`` that re-initializes
its children (``self.apply``, ``nn.init``, ``.data`` writes, a replaced ``.data``, a tied
weight), ``skip_init`` and meta params, a param returned from ``forward`` at stage 3, and
``ds_status`` inside ``GatheredParameters`` before any engine. Each compared with the same model
built without the library."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
from distributed import run_ranks
from torch import nn
from torch.nn.utils import skip_init

import zero_offload
from zero_offload.zero import GatheredParameters, ZeroParamStatus


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)


class SingleDeviceNet(nn.Module):
    """Initialized the way nanoGPT/timm models are: after the children exist."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, std=0.5)
        nn.init.xavier_uniform_(self.blocks[0].fc.weight)  # reads the shape
        self.blocks[1].fc.bias.data[3:5].fill_(7.0)
        self.blocks[1].proj.bias.data = torch.full((8,), 2.0)  # .data replaced

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(0, 0.02)
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)


def _build(config: dict | None = None) -> tuple[dict, list[bool]]:
    torch.manual_seed(0)
    with zero_offload.zero.Init(config_dict_or_path=config):
        model = SingleDeviceNet()
    empty = [
        p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()
    ]
    assert model.head.weight is model.emb.weight
    params = list(model.named_parameters())
    with GatheredParameters([p for _, p in params]):
        status = [p.ds_status is ZeroParamStatus.AVAILABLE for _, p in params]
        values = {n: p.detach().clone() for n, p in params}
    return values, empty + status


def _plain() -> dict:
    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in SingleDeviceNet().named_parameters()}


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_parent_init_of_children_kept() -> None:
    values, flags = _build()
    assert all(flags)  # partitioned after the build, AVAILABLE inside GatheredParameters
    _assert_same(values, _plain())


def test_parent_init_kept_with_a_small_live_budget() -> None:
    """stage3_max_live_parameters bounds the touched params held at once (oldest re-partitioned
    first); the values are the same."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    cfg["zero_optimization"]["stage3_max_live_parameters"] = 300
    values, flags = _build(cfg)
    assert all(flags)
    _assert_same(values, _plain())


def _two_ranks() -> list:
    # Each rank draws different random numbers: rank 0's values are everyone's.
    torch.manual_seed(0 if tdist.get_rank() == 0 else 123)
    with zero_offload.zero.Init():
        model = SingleDeviceNet()
    torch.manual_seed(0)
    shards = [p.ds_tensor.numel() < p.ds_numel for p in model.parameters() if p.ds_numel > 1]
    with GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    out: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, (values, all(shards)))
    return out


def test_parent_init_kept_on_two_ranks() -> None:
    want = _plain()
    for values, sharded in run_ranks(2, _two_ranks):
        assert sharded
        _assert_same(values, want)


H = 10


class SubModel(nn.Module):
    def __init__(self, i: int, o: int, device=None) -> None:
        super().__init__()
        self.linear = nn.Linear(i, o, device=device)
        self.module_list = nn.ModuleList([nn.Linear(i, o, device=device)])

    def forward(self, x):
        return self.module_list[0](self.linear(x))


class SkipInitModel(nn.Module):
    """DeepSpeed's skip_init test model, with the init a skip_init user writes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = skip_init(nn.Linear, H, H)
        self.l2 = skip_init(SubModel, H, H)
        self.l3 = nn.Linear(H, H)
        nn.init.eye_(self.l1.weight)
        nn.init.zeros_(self.l1.bias)
        for p in self.l2.parameters():
            nn.init.constant_(p, 0.01)

    def forward(self, x):
        return self.l3(self.l2(self.l1(x))).pow(2).mean()


STAGE3 = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _train_against_plain(net: nn.Module, ref: nn.Module, steps: int = 3) -> None:
    engine, *_ = zero_offload.initialize(model=net, config=copy.deepcopy(STAGE3))
    assert all(p.numel() == 0 for p in net.parameters())  # really partitioned
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, net_width(ref))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        want = ref(x)
        opt.zero_grad()
        want.backward()
        opt.step()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-9)
    engine.destroy()


def net_width(m: nn.Module) -> int:
    return next(x for x in m.modules() if isinstance(x, nn.Linear)).in_features


def test_skip_init_inside_zero_init_partitions_and_trains() -> None:
    torch.manual_seed(0)
    ref = SkipInitModel()
    torch.manual_seed(0)
    with zero_offload.zero.Init(config_dict_or_path=STAGE3):
        model = SkipInitModel()
    for p in (model.l1.weight, model.l2.linear.weight, model.l2.module_list[0].weight):
        assert p.ds_tensor.numel() == H * H and p.numel() == 0
    with GatheredParameters(list(model.parameters())):
        assert torch.equal(model.l1.weight, torch.eye(H))
        # skip_init leaves l3 as built; l1/l2 are what the parent wrote
        ref.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    _train_against_plain(model, ref)


def test_meta_params_refused_by_name_at_initialize() -> None:
    with zero_offload.zero.Init(config_dict_or_path=STAGE3):
        model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"meta device.*0\.weight, 0\.bias"):
        zero_offload.initialize(model=model, config=copy.deepcopy(STAGE3))


class DanglingBias(nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias


class Wrapped:
    def __init__(self, out, bias) -> None:
        self.out, self.bias = out, bias


class DanglingObject(DanglingBias):
    def forward(self, x):
        return Wrapped(*super().forward(x))


class Attention(nn.Linear):
    def __init__(self, as_object: bool) -> None:
        super().__init__(16, 16)
        self.as_object = as_object
        self.d = DanglingObject(16, 16) if as_object else DanglingBias(16, 16)

    def forward(self, x):
        out = super().forward(x)
        if self.as_object:
            o = self.d(out)
            out, bias = o.out, o.bias
        else:
            out, bias = self.d(out)
        if hasattr(bias, "ds_status"):  # the engine's run: still gathered here
            assert bias.ds_status is ZeroParamStatus.AVAILABLE and bias.numel() == 16
        return out, bias


class Container(nn.Module):
    def __init__(self, as_object: bool) -> None:
        super().__init__()
        self.l1 = nn.Linear(16, 16)
        self.att = Attention(as_object)

    def forward(self, x):
        a, b = self.att(self.l1(x))
        return (a * b).pow(2).mean()


@pytest.mark.parametrize("as_object", [False, True])
def test_param_returned_from_forward_stays_gathered(as_object: bool) -> None:
    """DeepSpeed's TestReturnParam: a submodule returns its bias, the caller's forward uses it
    (on stage 3 it used to be released when the submodule returned: an empty tensor)."""
    torch.manual_seed(0)
    net = Container(as_object)
    _train_against_plain(net, copy.deepcopy(net))


class InitOneByOne(nn.Module):
    """Hugging Face style: the parent initializes each child's params through the params
    themselves; the gathered params seen after each init are recorded (by ``ds_status``: a
    ``numel()`` here would itself gather)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.seen = []
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=0.1)
            nn.init.zeros_(layer.bias)
            self.seen.append(
                sum(
                    p.__dict__.get("ds_status") is ZeroParamStatus.AVAILABLE
                    for p in self.parameters()
                )
            )


def test_params_used_through_themselves_are_gathered_one_at_a_time() -> None:
    with zero_offload.zero.Init():
        model = InitOneByOne()
    assert model.seen == [1, 1, 1, 1]
    with GatheredParameters(list(model.parameters())):
        assert all(torch.equal(layer.bias, torch.zeros(8)) for layer in model.layers)
        assert all(layer.weight.std() < 0.2 for layer in model.layers)  # kaiming's would be ~0.2


class CountsItsParams(nn.Module):
    """nanoGPT's habit: the constructor counts its params (after the children are partitioned)
    and reads a child's shape; neither needs a gather."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.n = sum(p.numel() for p in self.fc.parameters())
        self.shape = (tuple(self.fc.weight.shape), self.fc.weight.size(1), self.fc.weight.dim())
        self.gathered = [p.__dict__.get("ds_status") for p in self.fc.parameters()]


def test_shape_queries_in_a_constructor_answer_without_a_gather() -> None:
    with zero_offload.zero.Init():
        model = CountsItsParams()
    assert model.n == 8 * 16 + 16
    assert model.shape == ((16, 8), 8, 2)
    assert model.gathered == [ZeroParamStatus.NOT_AVAILABLE] * 2


def test_hugging_face_from_config_under_zero_init_equals_plain() -> None:
    """A Hugging Face model built by ``from_config`` initializes its children from the parent
    (``post_init`` -> ``_init_weights``): under zero.Init the same values as without this
    library (before, the embedding kept nn.Embedding's N(0, 1))."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(cfg)
    torch.manual_seed(0)
    with zero_offload.zero.Init(dtype=torch.float32):
        parted = transformers.AutoModelForCausalLM.from_config(cfg)
    assert all(p.numel() == 0 for p in parted.parameters())
    params = list(parted.named_parameters())
    with GatheredParameters([p for _, p in params]):
        got = {n: p.detach().clone() for n, p in params}
    _assert_same(got, dict(plain.named_parameters()))
    assert float(got["model.embed_tokens.weight"].std()) < 0.05  # initializer_range 0.02
