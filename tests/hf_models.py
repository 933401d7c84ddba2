"""Tiny Hugging Face causal LMs built from configs (no downloads), and the stages they run under.

Adding ZeRO stage 3 to every Hugging Face test is one edit: append its cases to STAGE_CASES.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from parity import global_step  # noqa: E402

# (stage, offload) pairs every Hugging Face model test runs under.
STAGE_CASES = [(1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
VOCAB = 256  # byte-level tokens fit without a tokenizer


def tiny_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,  # dropout would make the comparison with the reference random
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    raise ValueError(kind)


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind))
    return model.float()


def save_tiny(kind: str, path, seed: int = 0):
    model = tiny_model(kind, seed)
    model.save_pretrained(str(path))
    return model


LR, WD, BETAS, EPS, CLIP = 1e-2, 0.01, (0.9, 0.999), 1e-8, 1.0


def ds_config(stage: int, offload: bool, micro: int = 2, gas: int = 2, dtype: str = "fp32"):
    zero = {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:  # both offloads: params in host memory too
            zero["offload_param"] = {"device": "cpu"}
    if stage == 3:  # the tiny models' weights are all under the default threshold
        zero["stage3_param_persistence_threshold"] = 0
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD},
        },
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def token_batches(steps: int, n: int, seq: int = 12, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        block = torch.randint(0, VOCAB, (n, seq + 1), generator=gen)
        out.append((block[:, :-1], block[:, 1:]))
    return out


def reference_train(model, steps_data):
    """Plain PyTorch AdamW on the whole global batch per step."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for x, y in steps_data:
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def engine_train(engine, steps_data, world: int = 1, rank: int = 0):
    """This rank's share of each global batch, in micro-batches of the engine's size."""
    return [global_step(engine, x, y, world, rank) for x, y in steps_data]


def displacement_err(params: dict, ref: dict, init: dict) -> float:
    num = sum(float((params[n].float() - ref[n]).square().sum()) for n in ref)
    den = sum(float((ref[n] - init[n]).square().sum()) for n in ref)
    return (num / den) ** 0.5


def assert_partitioned(model: torch.nn.Module) -> None:
    """Stage 3 really partitioned every param (none kept whole as persistent)."""
    params = list(model.parameters())
    assert params and all(p.numel() == 0 < p.ds_numel for p in params)
