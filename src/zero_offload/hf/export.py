"""The run folder's model export: a ``save_pretrained`` folder ``from_pretrained`` loads.

``save_pretrained_streamed`` writes it from a live engine, at any ZeRO stage, as a stream: the
model's tensors in Hugging Face's (sharded) safetensors layout (``checkpoint/export/sharded.py``), one
tensor at a time, in the training dtype, with ``config.json`` and ``generation_config.json``; at
stage 3 one module's params gathered at a time (every rank takes part, rank 0 writes), so no
rank ever holds the whole model. A peft LoRA model is merged layer by layer: each LoRA layer's
base weight and adapters are gathered together and merged by peft's own ``merge`` on a copy of
the base weight (the live model is left as it was), exactly the values ``merge_and_unload``
gives. ``export_pretrained`` is the whole-model path (``save_pretrained`` of a model whose
params are all whole), kept for callers that already hold the whole model and as the fallback
for models the stream does not handle (see ``streamable``).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import torch

from ..checkpoint import atomic
from ..checkpoint.collective import agree
from ..checkpoint.export.sharded import (
    DEFAULT_MAX_SHARD_SIZE,
    ExportResult,
    Item,
    export_items,
    full_shape,
    gathered,
)
from ..checkpoint.module_state import tied_patterns
from ..core.status import require_whole

log = logging.getLogger("zero_offload")


def export_pretrained(hf_model: torch.nn.Module, out_dir: str | os.PathLike[str]) -> list[str]:
    """Write ``hf_model`` with ``save_pretrained`` (safetensors) as trained: weights in the
    training dtype, as DeepSpeed's ``save_16bit_model`` does. A peft model is written twice:
    its adapter alone to ``<out_dir>_adapter`` (``PeftModel.from_pretrained``), then merged into
    the base weights to ``out_dir`` (``AutoModelForCausalLM.from_pretrained``); merging changes
    ``hf_model`` in place, so call this last. Returns the folders written.

    At ZeRO stage 3 every rank must call it inside ``with engine.params_on_host():`` (rank 0
    writes); a partitioned param outside that raises rather than being written empty. With an
    engine, ``save_pretrained_streamed`` does the same without holding the whole model."""
    require_whole(hf_model, f"export to {out_dir}")
    out = Path(out_dir)
    written = []
    if hasattr(hf_model, "merge_and_unload"):  # a peft model
        adapter = out.with_name(out.name + "_adapter")
        hf_model.save_pretrained(str(adapter))
        written.append(str(adapter))
        hf_model = hf_model.merge_and_unload()
    hf_model.save_pretrained(str(out), safe_serialization=True)
    written.append(str(out))
    return written


# ---- the streamed export -----------------------------------------------------------------------
def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "get_base_model")


def _tuner_layer_types():
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no peft: no tuner layers
        return ()
    return (BaseTunerLayer,)


def streamable(hf_model: torch.nn.Module) -> str | None:
    """None when ``save_pretrained_streamed`` can write ``hf_model``, else why not: peft
    modules other than mergeable tuner layers (``modules_to_save`` copies, layers with their own
    unloading), or transformers weight conversions (the saved names differ from the model's)."""
    base = hf_model.get_base_model() if _is_peft(hf_model) else hf_model
    tuners = _tuner_layer_types()
    inside: set[int] = set()
    for name, m in base.named_modules():
        if id(m) in inside:
            continue
        if tuners and isinstance(m, tuners):
            if hasattr(m, "unload_and_optionally_merge_module") or not (
                hasattr(m, "get_base_layer") and hasattr(m, "merge")
            ):
                return f"{name}: {type(m).__name__} has its own unloading"
            inside.update(id(x) for x in m.modules() if x is not m)
            continue
        if type(m).__module__.startswith("peft."):
            return f"{name}: peft module {type(m).__name__} (e.g. modules_to_save) is not streamed"
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return None
    convs = getattr(base, "_weight_conversions", None)
    if convs is None:
        try:
            convs = [
                c
                for c in get_model_conversion_mapping(base, add_legacy=False)
                if not isinstance(c, PrefixChange)
            ]
        except Exception:  # an unknown model type: no mapping
            convs = []
    if convs:
        return f"{type(base).__name__} saves through transformers weight conversions"
    return None


class _LayerMerge:
    """The merged base params of one tuner layer, computed once (by peft's ``merge`` on copies of
    the base params; the live params, the adapters and the layer's merge state are restored)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer
        self.values: dict[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor:
        if self.values is None:
            self.values = self._merge()
        return self.values.pop(name)

    def _merge(self) -> dict[str, torch.Tensor]:
        layer = self.layer
        base = layer.get_base_layer()
        own = dict(base.named_parameters(recurse=False))
        everything = [p for _, p in layer.named_parameters()]
        saved = [(p, p.data) for p in everything]
        merged_before = list(getattr(layer, "merged_adapters", []))
        try:
            with torch.no_grad():
                for p in own.values():
                    p.data = p.data.clone()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "already merged" notes
                    layer.merge()
                return {n: p.data for n, p in own.items()}
        finally:
            for p, d in saved:
                p.data = d
            if hasattr(layer, "merged_adapters"):
                layer.merged_adapters[:] = merged_before


def pretrained_items(hf_model: torch.nn.Module) -> list[Item]:
    """The tensors ``save_pretrained`` writes for ``hf_model`` (merged, for a peft model), in
    state-dict order: a tied param once (under the name transformers keeps), persistent buffers,
    ``_keys_to_ignore_on_save`` left out. Each item needs the params it reads."""
    base = hf_model.get_base_model() if _is_peft(hf_model) else hf_model
    tuners = _tuner_layer_types()
    entries: list[tuple[str, torch.Tensor, _LayerMerge | None, tuple]] = []

    def own(mod: torch.nn.Module, prefix: str, merge: _LayerMerge | None, extra: tuple) -> None:
        for name, p in mod._parameters.items():
            if p is not None:
                entries.append((prefix + name, p, merge, extra))
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                entries.append((prefix + name, b, None, ()))

    def walk(mod: torch.nn.Module, prefix: str) -> None:
        if tuners and isinstance(mod, tuners):
            base_layer = mod.get_base_layer()
            # the merge reads the adapters and clones every base param: all gathered together
            reads = tuple(p for _, p in mod.named_parameters())
            own(base_layer, prefix, _LayerMerge(mod), reads)
            for name, child in base_layer._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{name}.")
            return
        own(mod, prefix, None, ())
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, f"{prefix}{name}.")

    walk(base, "")
    ignore = set(getattr(base, "_keys_to_ignore_on_save", None) or [])
    patterns = tied_patterns(base)
    names_of: dict[int, list[str]] = {}
    for key, t, _, _ in entries:
        names_of.setdefault(id(t), []).append(key)
    keep: dict[int, str] = {}
    for tid, names in names_of.items():  # save_pretrained: drop the declared tied targets
        if len(names) == 1:
            keep[tid] = names[0]
            continue
        untied = [n for n in names if not any(re.search(pat, n) for pat in patterns)]
        keep[tid] = untied[0] if untied else names[0]
    items = []
    for key, t, merge, extra in entries:
        if keep[id(t)] != key or key in ignore:
            continue
        is_param = isinstance(t, torch.nn.Parameter)
        needs = ((t,) if is_param else ()) + tuple(p for p in extra if p is not t)
        if merge is not None:
            leaf = key.rpartition(".")[2]
            value = lambda m=merge, n=leaf: m.get(n)  # noqa: E731
        else:
            value = lambda t=t: t.detach()  # noqa: E731
        items.append(Item(key, t.dtype, full_shape(t), needs, value))
    return items


def _config_writer(model: torch.nn.Module):
    """Write ``config.json`` (and ``generation_config.json``) as save_pretrained does: the
    model's dtype and class name recorded in the config."""

    def write(stage_dir: Path) -> None:
        config = getattr(model, "config", None)
        if config is None:
            return
        config = copy.deepcopy(config)
        dtype = getattr(model, "dtype", None)
        if isinstance(dtype, torch.dtype):
            config.dtype = str(dtype).split(".")[1]
        config.architectures = [type(model).__name__]
        config.save_pretrained(str(stage_dir))
        gen = getattr(model, "generation_config", None)
        can = getattr(model, "can_generate", None)
        if gen is not None and callable(can) and can():
            gen.save_pretrained(str(stage_dir))

    return write


def save_pretrained_streamed(
    engine,
    hf_model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
) -> list[str]:
    """Write ``hf_model`` (trained by ``engine``, any stage) as a ``from_pretrained`` folder,
    streamed: the weights as trained in the sharded layout, ``config.json``, and for a peft model
    first its adapter alone in ``<out_dir>_adapter`` (the adapters gathered whole: they are
    small), then the merged model in ``out_dir``. A collective: every rank calls it; rank 0
    writes and gets the folders written, the other ranks an empty list. The live model is not
    changed (no ``merge_and_unload``), so training may continue afterwards.

    A model ``streamable`` refuses goes through the whole-model path (``params_on_host`` and
    ``save_pretrained``) with a warning."""
    engine.flush_delayed_update()
    rank = engine.global_rank
    why = streamable(hf_model)
    if why is not None:
        log.warning("export to %s: not streamed (%s); gathering the whole model", out_dir, why)
        with engine.params_on_host():
            return export_pretrained(hf_model, out_dir) if rank == 0 else []
    out = Path(out_dir)
    written: list[str] = []
    if _is_peft(hf_model):
        written += _save_adapter(engine, hf_model, out.with_name(out.name + "_adapter"))
    base = hf_model.get_base_model() if _is_peft(hf_model) else hf_model
    items = pretrained_items(hf_model)
    total = sum(_numel(it.shape) for it in items if it.needs)
    result: ExportResult | None = export_items(
        engine,
        items,
        out,
        max_shard_size,
        index_metadata={"total_parameters": total},
        before_publish=_config_writer(base),
    )
    if rank == 0 and result is not None:
        written.append(str(out))
    return written


def _save_adapter(engine, peft_model: torch.nn.Module, folder: Path) -> list[str]:
    """``PeftModel.save_pretrained`` of the adapter alone, its params gathered (a collective at
    stage 3), into a staging folder renamed into place."""
    adapters = tuple(p for p in peft_model.parameters() if p.requires_grad)
    rank = engine.global_rank
    err: BaseException | None = None
    for _ in gathered(engine, [Item("adapter", torch.float32, (), adapters)]):
        if rank == 0:
            try:
                root, name = folder.parent, folder.name
                stage = atomic.prepare_staging(root, name)
                peft_model.save_pretrained(str(stage))
                atomic.publish(root, name)
            except Exception as e:
                shutil.rmtree(atomic.staging_dir(folder.parent, folder.name), ignore_errors=True)
                err = e
    agree(getattr(engine, "device", torch.device("cpu")), err, f"adapter export to {folder}")
    return [str(folder)] if rank == 0 else []


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
