"""Params touched while a model is built under ``zero.Init``.

``zero.Init`` partitions a module's params when its own ``__init__`` returns, but code written
for one device goes on using them: a parent's ``__init__`` re-initializes its children
(``self.apply(init_weights)``, ``nn.init.normal_(self.proj.weight)``,
``self.head.weight.data.normal_()``), ties or reads them. On an emptied param such an op would do
nothing, silently (``normal_`` of an empty tensor), or see the wrong shape.

While a module is being constructed (and inside ``Module.apply`` within the context),
``TouchMode`` watches every torch call. The first call that reads a partitioned param (any op or
property but the pure metadata ones, ``SHAPE_FREE``) *touches* it: its full value is gathered and
bound to ``p.data`` (``ds_status`` AVAILABLE), so the op runs on the real tensor. Touched params are
re-partitioned (rank 0's values broadcast, each rank keeps its chunk):

- a param only used through itself (``nn.init.normal_(p)``, ``p.mul_(2)``, ``p @ x``): as soon
  as another param is touched, since any later use goes through the mode again (one param
  gathered at a time, as for Hugging Face's ``_init_weights``);
- a param whose storage *escaped* as a plain tensor (``p.data``, ``p.view(...)``, ``p[0]``,
  ``p.detach()``), which later writes may go through: when the constructor that touched it
  returns (a child built inside that constructor re-partitions only what it touched itself), or
  after each ``apply`` callback. Never earlier, whatever the budget: a constructor that holds
  six layers' ``.data`` and then writes them must not lose a write;
- everything when the context exits.

The budget (``stage3_max_live_parameters``) bounds the gathered elements by re-partitioning the
oldest touched params that did not escape; escaped ones are counted in it but kept, and a build
that held more than the budget that way is reported once (one warning with the peak) when the
context exits.

Invariants: every rank runs the same constructor code, so every rank touches the same params in
the same order (the gathers and broadcasts pair up); a tensor that escaped from a touched param
(``w = p.data``) stays valid until the constructor that touched the param returns, after which
writes to it are lost (as writes to any param's old ``.data``); our own partitioning code runs
with the mode suspended (``TouchMode.suspended``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..core import dist, partitioned
from ..core.status import ZeroParamStatus
from ..runtime.stage3.init_partition import full_value, partition_at_init, write_back

log = logging.getLogger("zero_offload")

# Ops and properties whose result does not depend on a param's values or shape: they do not
# gather (``register_parameter`` reads ``grad_fn``; ``requires_grad_`` marks frozen params).
SHAPE_FREE = frozenset(
    {
        "requires_grad",
        "requires_grad_",
        "grad_fn",
        "is_leaf",
        "grad",
        "dtype",
        "device",
        "layout",
        "is_cuda",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_floating_point",
        "is_complex",
        "is_nested",
        "retains_grad",
        "_is_view",
        "__hash__",
        "_backward_hooks",
        "_post_accumulate_grad_hooks",
    }
)

# Shape queries answered from the partition's record (``ds_shape``) without a gather: a
# constructor that counts its params (``sum(p.numel() ...)``) or reads a child's size sees the
# single-device answer.
SHAPE_QUERIES = frozenset({"numel", "nelement", "dim", "ndimension", "ndim", "shape", "size"})

_SPEC_ATTRS = ("ds_tensor", "ds_numel", "ds_shape", "ds_id", "ds_status")


def _op_name(func) -> str:
    owner = getattr(func, "__self__", None)  # a property's __get__ / __set__: the descriptor
    if getattr(func, "__name__", "") in ("__get__", "__set__") and owner is not None:
        return getattr(owner, "__name__", "")
    return getattr(func, "__name__", "")


def _is_partitioned(t: object) -> bool:
    return (
        isinstance(t, torch.nn.Parameter)
        and partitioned.init_shard(t) is not None
        and t.__dict__.get("ds_status") is ZeroParamStatus.NOT_AVAILABLE
    )


def _params_in(obj: object, out: list, depth: int = 0) -> None:
    if _is_partitioned(obj):
        if all(q is not obj for q in out):
            out.append(obj)
    elif depth < 2 and isinstance(obj, list | tuple):
        for x in obj:
            _params_in(x, out, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for x in obj.values():
            _params_in(x, out, depth + 1)


def _logical_shape(name: str, p: torch.nn.Parameter, rest: tuple, kwargs: dict):
    shape = torch.Size(p.ds_shape)
    if name in ("numel", "nelement"):
        return int(p.ds_numel)
    if name in ("dim", "ndimension", "ndim"):
        return len(shape)
    if name == "shape":
        return shape
    dim = rest[0] if rest else kwargs.get("dim")  # size(), size(d)
    return shape if dim is None else shape[dim]


def _touched_in(args: tuple, touched: OrderedDict) -> list:
    """Already touched params among the op's direct arguments (its result may alias them)."""
    return [a for a in args if isinstance(a, torch.nn.Parameter) and id(a) in touched]


def _shares_storage(out: torch.Tensor, p: torch.Tensor) -> bool:
    try:
        return out.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() != 0
    except RuntimeError:  # no storage (a meta or sparse result)
        return False


class TouchMode(TorchFunctionMode):
    """Gathers a partitioned param on first use during construction; see the module docstring."""

    def __init__(self, budget: int, depth: Callable[[], int] = lambda: 0) -> None:
        """``depth()``: how many constructors (or ``apply`` callbacks) are running now; a param
        is kept gathered until the one running when it was touched ends."""
        super().__init__()
        self.budget = max(1, int(budget))
        self.depth = depth
        self.touched: OrderedDict[int, torch.nn.Parameter] = OrderedDict()
        self.escaped: set[int] = set()  # touched params whose storage is held as a plain tensor
        self.level: dict[int, int] = {}  # touched param -> depth() when it was touched
        self.live = 0
        self.peak_over_budget = 0  # most elements held at once past the budget (escaped ones)
        self.suspended = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        if self.suspended or name in SHAPE_FREE:
            return func(*args, **kwargs)
        if name in SHAPE_QUERIES and args and _is_partitioned(args[0]):
            return _logical_shape(name, args[0], args[1:], kwargs)
        found: list = []
        _params_in(args, found)
        _params_in(kwargs, found)
        used = {id(p) for p in found} | {id(p) for p in _touched_in(args, self.touched)}
        if found:
            self._settle(keep=used)
        replaced = name == "data" and getattr(func, "__name__", "") == "__set__"
        for p in found:
            self.touch(p, gather=not (replaced and p is args[0]), keep=used)
        out = func(*args, **kwargs)
        if used and isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter):
            for i in used:
                if _shares_storage(out, self.touched[i]):
                    self.escaped.add(i)
        return out

    def _settle(self, keep: set[int]) -> None:
        """Re-partition the touched params that nothing can write through any more."""
        done = [i for i in self.touched if i not in keep and i not in self.escaped]
        if done:
            with self.quiet(), torch.no_grad():
                for i in done:
                    self._pop(i)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Our own partitioning code: no touches while it runs."""
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1

    def touch(
        self, p: torch.nn.Parameter, gather: bool = True, keep: set[int] | frozenset = frozenset()
    ) -> None:
        """Bind ``p``'s full value (``gather``), or only mark it touched when the op is
        ``p.data = new`` (the old value is replaced anyway). Room under the budget is made by
        re-partitioning the oldest touched params that neither escaped nor are in ``keep``
        (the running op's)."""
        with self.quiet(), torch.no_grad():
            for i in [i for i in self.touched if i not in self.escaped and i not in keep]:
                if self.live + p.ds_numel <= self.budget:
                    break
                self._pop(i)
            if gather:
                p.data = full_value(p).clone()
            p.ds_status = ZeroParamStatus.AVAILABLE
            self.touched[id(p)] = p
            self.level[id(p)] = self.depth()
            self.live += p.ds_numel
            if self.live > self.budget:
                self.peak_over_budget = max(self.peak_over_budget, self.live)

    def flush(self) -> None:
        """Re-partition (rank 0's values win) every param touched since the constructor or
        ``apply`` callback running now began; all of them once none runs (the context exits)."""
        depth = self.depth()
        with self.quiet(), torch.no_grad():
            for i in [i for i in self.touched if self.level[i] >= depth]:
                self._pop(i)
        if depth == 0 and self.peak_over_budget:
            log.warning(
                "zero.Init: constructors held up to %d param elements gathered at once, past "
                "zero_optimization.stage3_max_live_parameters (%d): params whose storage they "
                "kept as plain tensors (p.data, views) stay gathered until the constructor ends, "
                "so that no write through them is lost",
                self.peak_over_budget,
                self.budget,
            )
            self.peak_over_budget = 0

    def _pop(self, i: int) -> None:
        p = self.touched.pop(i)
        self.escaped.discard(i)
        self.level.pop(i, None)
        self._repartition(p)

    def _repartition(self, p: torch.nn.Parameter) -> None:
        self.live -= p.ds_numel
        if p.ds_status is not ZeroParamStatus.AVAILABLE:  # re-partitioned by its owner
            return
        spec = partitioned.init_shard(p)
        if tuple(p.data.shape) == spec.shape:
            dist.broadcast(p.data, src=0)
            write_back(p, p.data)
            p.data = torch.empty(0, dtype=p.data.dtype, device=p.data.device)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            return
        # A new shape (``p.data = torch.empty(n, m)``): partition the new value from scratch,
        # keeping the param's identity.
        ds_id = p.ds_id
        shard_device, pin = p.ds_tensor.device, p.ds_tensor.is_pinned()
        dtype = p.ds_tensor.dtype if p.data.is_floating_point() else None
        partitioned.clear_init_shard(p)
        for attr in _SPEC_ATTRS:
            p.__dict__.pop(attr, None)
        partition_at_init(p, shard_device, dtype, pin)
        p.ds_id = ds_id
