"""DeepSpeed's ``data_types.keep_in_fp32_modules``: buffers a model names for fp32 stay fp32 while
the model trains in fp16 or bf16 (a MoE router's correction bias, whose values differ by less
than bf16's spacing). Only buffers: parameters follow the training dtype.

``"auto"`` takes the names from the model's Hugging Face lists (``_keep_in_fp32_modules_strict``,
and under fp16 also ``_keep_in_fp32_modules``) on every submodule, scoped to that submodule; a
list gives the patterns itself (``*`` is any characters; a pattern matches anywhere in the
buffer's full name); ``[]`` keeps nothing. Under fp32 training nothing needs keeping.
"""

from __future__ import annotations

import re

import torch

AUTO = "auto"


def _auto_patterns(module: torch.nn.Module, dtype: torch.dtype) -> set[str]:
    patterns = set()
    for prefix, child in module.named_modules():
        names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
        for name in names:
            pattern = name.replace("*", ".*")
            patterns.add(rf"^{re.escape(prefix)}\..*{pattern}" if prefix else pattern)
    return patterns


def keep_pattern(
    module: torch.nn.Module, setting: str | list[str], dtype: torch.dtype
) -> re.Pattern[str] | None:
    """The names of ``module``'s buffers to keep in fp32, as one pattern; None when none."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting == AUTO:
        patterns = _auto_patterns(module, dtype)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def kept_buffers(module: torch.nn.Module, pattern: re.Pattern[str] | None) -> set[int]:
    """Upcast ``module``'s floating buffers whose full names match ``pattern`` to fp32 in place;
    their ids (so a buffer dtype cast leaves them alone)."""
    kept: set[int] = set()
    if pattern is None:
        return kept
    for prefix, owner in module.named_modules():
        for name, buf in list(owner._buffers.items()):
            full = f"{prefix}.{name}" if prefix else name
            if buf is not None and buf.is_floating_point() and pattern.search(full):
                if buf.dtype != torch.float32:
                    buf = owner._buffers[name] = buf.float()
                kept.add(id(buf))
    return kept
