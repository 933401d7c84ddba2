"""The shape of a GPT-2 or Llama-style transformer, as the memory model needs it: every fetch
unit's param sizes (the params one module owns directly, stage 3's unit of gathering) and the
sizes the activations scale with. Built from this library's ``GPT2Config``, a Hugging Face config
(``LlamaConfig``, ``GPT2Config``, a folder's config.json) or plain numbers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """``kind``: "gpt2" (learned positions, LayerNorm, fused qkv, GELU MLP: the Megatron
    GPT-2 of ``zero_offload.models.gpt2``) or "llama" (RMSNorm, separate q/k/v, gated MLP)."""

    kind: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    positions: int = 0  # learned position embeddings (gpt2)
    kv_heads: int = 0  # llama: key/value heads (0: as many as heads)
    tied: bool = True  # the LM head is the token embedding

    def __post_init__(self) -> None:
        if self.kind not in ("gpt2", "llama"):
            raise ValueError(f"model kind must be 'gpt2' or 'llama', got {self.kind!r}")
        for name in ("layers", "hidden", "heads", "vocab", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not divisible by {self.heads} heads")

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def gpt2(cls, layers: int, hidden: int, heads: int, vocab: int, positions: int) -> ModelShape:
        return cls("gpt2", layers, hidden, heads, vocab, 4 * hidden, positions, 0, True)

    @classmethod
    def llama(
        cls, layers: int, hidden: int, heads: int, vocab: int, ffn: int, kv_heads: int = 0,
        tied: bool = False,
    ) -> ModelShape:  # fmt: skip
        return cls("llama", layers, hidden, heads, vocab, ffn, 0, kv_heads, tied)

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """This library's ``GPT2Config``, or a Hugging Face config object or dict."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        if get("num_layers") is not None and get("ffn_hidden_size") is not None:  # ours
            return cls("gpt2", get("num_layers"), get("hidden_size"),
                       get("num_attention_heads"), get("vocab_size"), get("ffn_hidden_size"),
                       get("seq_length"), 0, bool(get("tie_word_embeddings", True)))  # fmt: skip
        if get("n_embd") is not None:  # Hugging Face GPT-2
            h = get("n_embd")
            return cls("gpt2", get("n_layer"), h, get("n_head"), get("vocab_size"),
                       get("n_inner") or 4 * h, get("n_positions"), 0,
                       bool(get("tie_word_embeddings", True)))  # fmt: skip
        if get("hidden_size") is None or get("intermediate_size") is None:
            raise ValueError(
                "model config: expected a GPT-2 (n_embd, n_layer, n_head) or a Llama-style "
                "config (hidden_size, intermediate_size, num_hidden_layers, "
                f"num_attention_heads), got keys {sorted(dict(cfg) if isinstance(cfg, dict) else vars(cfg))[:12]}"
            )
        return cls("llama", get("num_hidden_layers"), get("hidden_size"),
                   get("num_attention_heads"), get("vocab_size"), get("intermediate_size"), 0,
                   get("num_key_value_heads") or 0, bool(get("tie_word_embeddings", False)))  # fmt: skip

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        """A Hugging Face model folder (its config.json) or a config.json file."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"no config.json at {str(path)!r}")
        return cls.from_config(json.loads(f.read_text()))

    # ---- sizes ---------------------------------------------------------------------------------
    def layer_units(self) -> list[list[int]]:
        h, f = self.hidden, self.ffn
        if self.kind == "gpt2":
            return [[h, h], [3 * h * h, 3 * h], [h * h, h], [h, h], [f * h, f], [h * f, h]]
        kv = (self.kv_heads or self.heads) * (h // self.heads)
        return [[h * h], [kv * h], [kv * h], [h * h], [f * h], [f * h], [h * f], [h], [h]]

    def units(self) -> list[list[int]]:
        """Every fetch unit's param sizes (elements), in module order."""
        h, v = self.hidden, self.vocab
        out = [[v * h]] + ([[self.positions * h]] if self.positions else [])
        out += self.layer_units() * self.layers
        out.append([h, h] if self.kind == "gpt2" else [h])  # final norm
        if not self.tied:
            out.append([v * h])
        return out

    def numel(self) -> int:
        h, v = self.hidden, self.vocab
        per_layer = sum(sum(u) for u in self.layer_units())
        emb = v * h + self.positions * h + (0 if self.tied else v * h)
        return emb + self.layers * per_layer + (2 * h if self.kind == "gpt2" else h)

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every param's shape (torch's: a Linear's weight is (out, in), an Embedding's
        (vocab, hidden)), in the order of ``units()``; ZenFlow selects columns of the 2-D ones."""
        h, f, v = self.hidden, self.ffn, self.vocab
        if self.kind == "gpt2":
            layer = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (f, h), (f,),
                     (h, f), (h,)]  # fmt: skip
        else:
            kv = (self.kv_heads or self.heads) * (h // self.heads)
            layer = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
        out = [(v, h)] + ([(self.positions, h)] if self.positions else [])
        out += layer * self.layers
        out += [(h,), (h,)] if self.kind == "gpt2" else [(h,)]
        return out + ([] if self.tied else [(v, h)])

    def param_sizes(self) -> list[int]:
        """Every param's size in module order."""
        return [n for u in self.units() for n in u]

    def largest_param(self) -> int:
        return max(n for u in self.units() for n in u)

    def largest_unit(self) -> int:
        return max(sum(u) for u in self.units())
