"""Hugging Face causal LMs in the main job: load a local ``save_pretrained`` folder, optionally
add LoRA adapters with peft, train it through the engine, export with ``save_pretrained``.

transformers and peft are optional (``pip install zero_offload[hf]``); importing this package
does not import them, and each entry point that needs one says so when it is missing.
"""

from .deps import require_peft, require_transformers
from .export import export_pretrained
from .lora import LoraSpec, apply_lora
from .model import CausalLMLoss, load_causal_lm
from .text import hf_token_stream

__all__ = [
    "CausalLMLoss",
    "LoraSpec",
    "apply_lora",
    "export_pretrained",
    "hf_token_stream",
    "load_causal_lm",
    "require_peft",
    "require_transformers",
]
