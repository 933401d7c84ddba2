import math

import pytest
import torch
import torch.nn.functional as F

from zero_offload.models import (
    PRESETS,
    GPT2Config,
    GPT2Model,
    flops_per_token,
    num_parameters,
    param_groups,
)


def unique_numel(model: torch.nn.Module) -> int:
    seen = {id(p): p.numel() for p in model.parameters()}
    return sum(seen.values())


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config.preset("tiny"),
        GPT2Config(num_layers=3, hidden_size=48, num_attention_heads=3, seq_length=17),
        GPT2Config(3, 48, 3, 17, vocab_size=101, ffn_hidden_size=80, tie_word_embeddings=False),
    ],
)
def test_num_parameters_matches_the_module(config: GPT2Config) -> None:
    assert num_parameters(config) == unique_numel(GPT2Model(config))


def test_presets_have_the_tutorial_sizes() -> None:
    # Megatron's 12 L h^2 rule of thumb for the transformer layers, plus embeddings.
    assert math.isclose(num_parameters(GPT2Config.preset("gpt2-124m")), 124.4e6, rel_tol=1e-2)
    assert math.isclose(num_parameters(GPT2Config.preset("gpt2-1.5b")), 1.56e9, rel_tol=1e-2)
    big = GPT2Config.preset("gpt2-10b")
    assert (big.num_layers, big.hidden_size, big.num_attention_heads) == (50, 4096, 32)
    assert math.isclose(num_parameters(big), 10.3e9, rel_tol=1e-2)
    assert set(PRESETS) >= {"tiny", "small", "gpt2-124m", "gpt2-1.5b", "gpt2-10b"}
    assert GPT2Config.preset("tiny", seq_length=8).seq_length == 8


def test_lm_head_is_the_token_embedding() -> None:
    model = GPT2Model(GPT2Config.preset("tiny"))
    assert model.lm_head.weight is model.word_embeddings.weight
    assert sum(1 for p in model.parameters() if p is model.lm_head.weight) == 1
    model.to(torch.bfloat16)  # what an engine does for 16-bit training: the tie must survive
    assert model.lm_head.weight is model.word_embeddings.weight
    assert model.lm_head.weight.dtype == torch.bfloat16
    untied = GPT2Model(GPT2Config.preset("tiny", tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.word_embeddings.weight


def test_megatron_init_scales_residual_outputs() -> None:
    torch.manual_seed(0)
    config = GPT2Config(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=8)
    model = GPT2Model(config)
    layer = model.layers[0]
    scaled = 0.02 / math.sqrt(2 * 8)
    assert layer.attention.query_key_value.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.attention.dense.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert layer.mlp.dense_4h_to_h.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.all(layer.attention.query_key_value.bias == 0)
    assert torch.all(layer.input_layernorm.weight == 1)


def test_loss_is_the_cross_entropy_of_the_logits() -> None:
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config.preset("tiny"))
    ids = torch.randint(0, 256, (3, 20))
    labels = torch.randint(0, 256, (3, 20))
    logits = model(ids)
    assert logits.shape == (3, 20, 256)
    expected = F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1))
    torch.testing.assert_close(model(ids, labels), expected)
    # Fresh init predicts nearly uniformly over the 256 bytes.
    assert model(ids, labels).item() == pytest.approx(math.log(256), abs=0.1)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT2Model(GPT2Config.preset("tiny")).eval()
    ids = torch.randint(0, 256, (2, 16))
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    plain = GPT2Model(GPT2Config.preset("tiny"))
    ckpt = GPT2Model(GPT2Config.preset("tiny", checkpoint_activations=True))
    ckpt.load_state_dict(plain.state_dict())
    ids, labels = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    plain(ids, labels).backward()
    ckpt(ids, labels).backward()
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_too_long_input_names_seq_length() -> None:
    model = GPT2Model(GPT2Config.preset("tiny"))
    with pytest.raises(ValueError, match="seq_length"):
        model(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_layers=0), "num_layers"),
        (dict(hidden_size=-4), "hidden_size"),
        (dict(num_attention_heads=3), "num_attention_heads"),
        (dict(seq_length=0), "seq_length"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(ffn_hidden_size=0), "ffn_hidden_size"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict, field: str) -> None:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=8)
    with pytest.raises(ValueError, match=field):
        GPT2Config(**{**base, **kwargs})


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError, match="gpt2-124m"):
        GPT2Config.preset("gpt2-huge")


def test_param_groups_split_matrices_from_biases_and_norms() -> None:
    model = GPT2Model(GPT2Config.preset("tiny"))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert any(p is model.final_layernorm.weight for p in no_decay["params"])
    # Without a value the decay group defers to the optimizer's configured weight decay.
    assert "weight_decay" not in param_groups(model)[0]


def test_flops_per_token_is_six_n_plus_attention() -> None:
    # tiny: 120,576 params of which 64 * 64 are the position table (no matmul); attention
    # 12 * layers * seq * hidden = 12 * 2 * 64 * 64.
    assert flops_per_token(GPT2Config.preset("tiny")) == 6 * (120_576 - 4096) + 98_304
    assert flops_per_token(GPT2Config.preset("gpt2-1.5b")) > 6 * 1.5e9


def test_built_under_zero_init_has_the_same_weights() -> None:
    """The block init re-draws its submodules' weights after they are partitioned: under
    zero.Init each module is gathered, set and re-partitioned, so the weights equal a plain build
    (without the gathering the token embedding kept nn.Embedding's N(0, 1) and the loss was ~40)."""
    import zero_offload
    from zero_offload.zero import GatheredParameters

    config = GPT2Config(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8)
    torch.manual_seed(0)
    plain = GPT2Model(config)
    torch.manual_seed(0)
    with zero_offload.zero.Init():
        parted = GPT2Model(config)
    assert all(p.numel() == 0 for p in parted.parameters())
    with GatheredParameters(list(parted.parameters())):
        for (name, a), b in zip(plain.named_parameters(), parted.parameters()):
            assert torch.equal(a, b), name


def test_init_refuses_params_partitioned_elsewhere() -> None:
    config = GPT2Config(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=4)
    model = GPT2Model(config)
    model.final_layernorm.weight.ds_tensor = torch.empty(0)  # as another library's Init leaves it
    with pytest.raises(RuntimeError, match="another library's zero.Init"):
        model.reset_parameters()
