"""``zero_optimization.leaf_module`` (stage 3): which modules are fetched whole, DeepSpeed's
keys and defaults (the Mixture-of-Experts blocks of Mixtral, Qwen2-MoE and Qwen3-MoE)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from ..fields import Section, Str

DEFAULT_LEAF_CLASSES = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]


class LeafModuleConfig(Section):
    """Modules matched by class (name or fully qualified name), by module name, or by name
    suffix become leaves: their whole subtree is one fetch unit (see zero_offload.utils'
    ``set_z3_leaf_modules``). A single string is a list of one."""

    classes: list[Str] = Field(
        default_factory=lambda: list(DEFAULT_LEAF_CLASSES),
        description="Module classes made leaves, by class name or fully qualified name. The "
        "default: the Mixture-of-Experts blocks of Mixtral, Qwen2-MoE and Qwen3-MoE.",
    )
    names: list[Str] = Field(
        default_factory=list,
        description='Modules made leaves by their name in the model ("model.layers.0.mlp").',
    )
    name_suffixes: list[Str] = Field(
        default_factory=list,
        description='Modules made leaves by the end of their name ("mlp", "block_sparse_moe").',
    )

    @field_validator("classes", "names", "name_suffixes", mode="before")
    @classmethod
    def _listed(cls, value: Any) -> Any:
        value = [value] if isinstance(value, str) else value
        return list(dict.fromkeys(value)) if isinstance(value, list) else value
