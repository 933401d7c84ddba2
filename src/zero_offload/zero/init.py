"""``zero.Init``: partition params as modules are constructed, so a model larger than one rank's
device (with ``remote_device="cpu"``, or a config whose ``offload_param`` puts the param shard on
the host: larger than the device altogether) can be built.

Inside the context every ``torch.nn.Module`` subclass's ``__init__`` is wrapped: when the
outermost ``__init__`` of a module returns (its own params created and initialized), each of its
direct params is broadcast from rank 0 and cut into ``world_size`` chunks, of which this rank
keeps one (``p.ds_tensor``) and ``p.data`` is emptied. Peak memory while building is therefore
the shards plus one module's full params. Leaving the context restores the classes.

A constructor that goes on using already partitioned params (a parent's
``self.apply(init_weights)``, ``nn.init.*_`` or ``.data`` writes on its children's weights, as
most single-device models do) sees their full values: ``init_touch.TouchMode`` gathers each on
first use and re-partitions it afterwards, so the values it writes are kept. ``Module.apply``
inside the context does the same for each module it visits, one module at a time. Params created
on the meta device (``torch.nn.utils.skip_init``) are partitioned when ``to_empty`` gives them
storage.

A stage-3 engine takes such params as they are (gathering one param at a time to re-lay them out
in its own buckets); stages 0-2 gather them back to full params.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator

import torch

from ..core import dist, host_heap, partitioned
from ..runtime.stage3.init_partition import partition_at_init
from .init_placement import REMOTE_DEVICES, resolve
from .init_touch import TouchMode

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

# The constructors and ``apply`` functions any ``Init`` wrapped (nested contexts included): a
# wrapper is never wrapped again.
_CONSTRUCTORS: weakref.WeakSet = weakref.WeakSet()
_TOUCHING: weakref.WeakSet = weakref.WeakSet()


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for sub in c.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return out


class Init:
    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
        **_: object,
    ) -> None:
        # "nvme": the chunks stay in host memory until initialize() moves the param shard to
        # its swap file (offload_param "nvme"), one param at a time.
        if remote_device not in REMOTE_DEVICES:
            raise ValueError(
                'zero.Init: remote_device must be None, "cpu", "cuda" or "nvme", got '
                f"{remote_device!r}"
            )
        if mpu is not None:
            raise ValueError("zero.Init: 'mpu' (model parallelism) is not supported")
        self.enabled = enabled
        dist.init_distributed()
        cfg = config_dict_or_path if config_dict_or_path is not None else config
        loaded = self._load_config(cfg) if cfg is not None else None
        if dtype is None and loaded is not None:
            dtype = loaded.dtype
        zc = loaded.zero_optimization if loaded is not None else None
        self.sanity_checks = bool(zc is not None and zc.enable_sanity_checks)
        self.dtype = dtype
        # Params gathered at once while constructors touch them (DeepSpeed's live bound).
        live = zc.stage3_max_live_parameters if zc is not None else 0
        self.touch_budget = live or 1_000_000_000
        self._touch: TouchMode | None = None
        self._building = 0  # constructors running (any module), outermost first
        # Without remote_device, the config's offload_param decides (init_placement.py).
        where = resolve(
            remote_device, pin_memory, zc.offload_param if zc else None, dist.default_device()
        )
        self.remote_device, self.shard_device, self.pin = (
            where.remote_device,
            where.shard_device,
            where.pin,
        )
        self.pin_memory = self.pin  # DeepSpeed's name
        nvme = where.remote_device == "nvme" or (zc is not None and zc.uses_nvme)
        if enabled and nvme:  # before the model's first allocation (core/host_heap.py)
            host_heap.fix_mmap_threshold()
        self._patched: list[tuple[type, object]] = []
        self._orig_init_subclass = None
        if enabled and module is not None:
            self._partition_tree(module)

    @staticmethod
    def _load_config(cfg):
        """The config, validated (a bad key is the same ConfigError
        initialize() would raise). zero.Init needs no batch size: a config without a numeric
        one (Hugging Face's "auto") is checked as if the micro batch were 1. Warnings are left
        to initialize(), which reads the same config."""
        import warnings

        from ..config import load_config

        if isinstance(cfg, str | os.PathLike):
            from ..config.loading.json_text import read_json_file

            cfg = read_json_file(cfg)
        if isinstance(cfg, dict):
            batch = ("train_batch_size", "train_micro_batch_size_per_gpu")
            if not any(isinstance(cfg.get(k), int) for k in batch):
                cfg = {**cfg, "train_micro_batch_size_per_gpu": 1}
                cfg.pop("train_batch_size", None)
                cfg.pop("gradient_accumulation_steps", None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_config(cfg, world_size=dist.world_size())

    # ---- partitioning --------------------------------------------------------------------------
    def _partition_module(self, m: torch.nn.Module) -> None:
        """Partition ``m``'s own params; meta params (``skip_init``) wait for ``to_empty``."""
        with self._quiet(), torch.no_grad():
            for p in m._parameters.values():
                if p is None or p.is_meta:
                    continue
                if p.is_floating_point() or partitioned.init_shard(p) is not None:
                    partition_at_init(p, self.shard_device, self.dtype, self.pin)
                    p.ds_enable_sanity_checks = self.sanity_checks

    def _quiet(self):
        return self._touch.quiet() if self._touch is not None else contextlib.nullcontext()

    def _flush(self) -> None:
        if self._touch is not None:
            self._touch.flush()

    def _partition_tree(self, module: torch.nn.Module) -> None:
        for m in module.modules():
            self._partition_module(m)

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or orig in _CONSTRUCTORS:
            return
        building, flush, partition = self._constructing, self._flush, self._partition_module

        @functools.wraps(orig)
        def init(module, *args, **kwargs):
            depth = module.__dict__.get("_z3_init_depth", 0)
            module.__dict__["_z3_init_depth"] = depth + 1
            with building():
                try:
                    orig(module, *args, **kwargs)
                    if depth == 0:
                        # Touched params first: their constructor's writes are complete.
                        flush()
                        partition(module)
                finally:
                    if depth:
                        module.__dict__["_z3_init_depth"] = depth
                    else:
                        module.__dict__.pop("_z3_init_depth", None)

        _CONSTRUCTORS.add(init)
        cls.__init__ = init
        self._patched.append((cls, orig))

    @contextlib.contextmanager
    def _constructing(self) -> Iterator[None]:
        """A constructor (or an ``apply`` fn) runs: the TouchMode is active while any does."""
        if self._building == 0 and self._touch is not None:
            self._touch.__enter__()
        self._building += 1
        try:
            yield
        finally:
            self._building -= 1
            if self._building == 0 and self._touch is not None:
                self._touch.__exit__(None, None, None)

    def _patch_apply_and_to_empty(self) -> None:
        """``Module.apply(fn)``: each visited module's params gathered for ``fn`` (touched) and
        re-partitioned right after it, one module at a time. ``Module.to_empty``: params that
        were on the meta device are partitioned once they have storage."""
        building, flush, partition_tree = self._constructing, self._flush, self._partition_tree
        orig_apply, orig_to_empty = torch.nn.Module.apply, torch.nn.Module.to_empty

        def wrap_fn(fn):
            if fn in _TOUCHING:
                return fn

            @functools.wraps(fn)
            def touching(m):
                with building():
                    fn(m)
                    flush()

            _TOUCHING.add(touching)
            return touching

        @functools.wraps(orig_apply)
        def apply(module, fn):
            return orig_apply(module, wrap_fn(fn))

        @functools.wraps(orig_to_empty)
        def to_empty(module, *args, **kwargs):
            out = orig_to_empty(module, *args, **kwargs)
            partition_tree(module)
            return out

        torch.nn.Module.apply, torch.nn.Module.to_empty = apply, to_empty
        self._patched.append((torch.nn.Module, ("apply", orig_apply)))
        self._patched.append((torch.nn.Module, ("to_empty", orig_to_empty)))

    # ---- context -------------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._touch = TouchMode(self.touch_budget, lambda: self._building)
        self._patch_apply_and_to_empty()
        for cls in [torch.nn.Module, *_all_subclasses(torch.nn.Module)]:
            self._wrap(cls)
        wrap = self._wrap
        self._orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        @classmethod
        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            wrap(cls)

        torch.nn.Module.__init_subclass__ = init_subclass
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        try:
            self._flush()
        finally:
            self._touch = None
            for cls, orig in reversed(self._patched):
                if isinstance(orig, tuple):  # (name, function): apply, to_empty
                    setattr(cls, *orig)
                else:
                    cls.__init__ = orig
            self._patched.clear()
        if self._orig_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._orig_init_subclass
