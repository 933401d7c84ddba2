"""The peak of a training step per rank, predicted before the run, by category.

peak = states (what ``initialize`` keeps: ``memory.expected_bytes``, moved to NVMe where the
config says; at stage 3 also ``persistent_params``, the units within
``stage3_param_persistence_threshold``, gathered from the first step on) + the step's working
set, every term from the config and the model shape:

- ``reduce_buffers`` (stages 2/3): at most two, each at most ``min(reduce_bucket_size, bucket)``;
- ``grads``: full gradients not yet reduced: at stages 2/3 the largest param's (a bucket larger
  than ``reduce_bucket_size`` keeps its own until its pieces are reduced, two such in flight: a
  stage-3 unit), plus a tied embedding's, held from the head's backward to the embedding's;
- ``gathered_params`` (stage 3): at most ``stage3_max_live_parameters`` plus the running unit;
- ``activations``: what autograd saves for backward (every layer, or with activation
  checkpointing each layer's input plus one layer recomputed; with ``cpu_checkpointing`` the
  inputs wait in host memory, ``peak.host.activation_checkpoints``, and the device holds the
  one brought back), at the start of backward;
- ``logits``: the LM head's output and the fp32 loss's softmax and gradients (``LOGIT_COPIES``
  vocabulary-sized fp32 tensors at once), the largest transient of a small model;
- ``nvme_buffers`` (host state, NVMe optimizer): ``buffer_count`` records of a chunk's master
  and moments (three fp32 tensors with fp32 states; ``state_bytes.swap_record_bytes``, each
  region padded to whole 4096-byte blocks);
  ``swap_reads`` (host, NVMe params): reads ahead beside the buffers kept for reuse
  (``host.param_spares``, up to two per buffer size, within ``max_in_cpu``).

The activation constants are counted from the code path of each model kind (``ModelShape``):
per token and layer, the saved tensors in the training dtype (``ACT_WORDS``, in units of hidden
and ffn) and in fp32 (norm statistics, attention log-sum-exp). The benchmark
(``benchmarks/memory_model.py``) checks the prediction against measured peaks.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from ...core.layout import build_unit_layout
from ...core.pinned_bytes import reserved
from ...core.state.format import FP32, StateFormat
from ..reduce.reduce_buffers import ALIGN as REDUCE_ALIGN
from .memory import expected_bytes
from .model_shape import ModelShape
from .state_bytes import swap_record_bytes
from .zenflow_memory import ZenFlowPlan, plan_from_config, zenflow_bytes

# Per token per layer, saved for backward, in the training dtype: (x hidden, x ffn). Counted
# with saved-tensor hooks on both models (torch's CPU SDPA returns its output already in
# (batch, seq, heads, dim) order, so the projection's input is that output, not a copy):
# gpt2: residual in, ln out, qkv (3), attention out, residual mid, ln2 out; fc1 out, gelu out.
# llama: norm out and normalized (2 per norm), rotated q, k and v (3), attention out; gate, up,
#        act(gate), act*up.
ACT_WORDS = {"gpt2": (8, 2), "llama": (8, 4)}
# fp32 words per token per layer besides (norm statistics; per head: log-sum-exp); llama's
# RMSNorm computes in fp32 and saves its fp32 input (2 * hidden, in ACT_FP32_HIDDEN).
ACT_FP32 = {"gpt2": 4, "llama": 4}
ACT_FP32_HIDDEN = {"gpt2": 0, "llama": 2}
# fp32 vocabulary-sized tensors alive at the head's backward: the softmax output, its gradient
# and the logits' gradient; a Hugging Face model's output also keeps the logits.
LOGIT_COPIES = {"gpt2": 3, "llama": 4}


@dataclass(frozen=True)
class StepShape:
    micro_batch: int
    seq_length: int
    checkpointing: bool = False
    cpu_checkpointing: bool = False  # with checkpointing: the layer inputs in host memory

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length


@dataclass(frozen=True)
class ZeroPlan:
    """The config's memory-relevant choices (elements where DeepSpeed counts elements)."""

    stage: int
    dtype_bytes: int = 2
    accum_bytes: int = 0  # grad shards (data_types.grad_accum_dtype); 0: dtype_bytes
    world: int = 1
    optimizer: str = "device"  # device | host | nvme
    params: str = "device"  # device | host | nvme (stage 3)
    reduce_bucket_size: int = 500_000_000
    max_live: int = 1_000_000_000
    persistence: int = 100_000
    model_persistence: int = 2**63 - 1  # stage3_model_persistence_threshold
    gas: int = 1
    delayed: bool = False
    chunk: int = 1 << 22  # host-update chunk (sub_group_size, capped)
    optimizer_buffers: int = 4
    param_buffers: int = 5
    max_in_cpu: int = 1_000_000_000
    ratio: float = 1.0  # offload_optimizer.ratio: the host's share (optimizer "host", stage 3)
    # host buffers pinned (CUDA and each section's pin_memory): counted as the allocator holds
    # them (``core/pinned_bytes.py``); never on the CPU
    pin_optimizer: bool = False
    pin_params: bool = False
    # zero_optimization.zenflow where the engine builds it: its buffers (``zenflow_memory.py``)
    zenflow: ZenFlowPlan | None = None
    # the optimizer state's format (bf16 master, bf16 or 8-bit moments): its bytes per element
    state: StateFormat = FP32

    @classmethod
    def from_config(cls, config, world: int, device: torch.device | None = None) -> ZeroPlan:
        """From a validated ``ZeroOffloadConfig``; ``device``: the engine's (CUDA pins the
        host buffers its offload sections ask to pin)."""
        from ...config.runtime_keys import DTYPES
        from ..update.placement import _FROM_CONFIG, update_chunk

        zc = config.zero_optimization
        oc, pc = zc.offload_optimizer, zc.offload_param
        accum = config.data_types.grad_accum_dtype
        return cls(
            stage=zc.stage,
            dtype_bytes=config.dtype.itemsize,
            accum_bytes=DTYPES[accum].itemsize if accum is not None else 0,
            world=world,
            optimizer=_FROM_CONFIG[zc.offload_device],
            params=_FROM_CONFIG[zc.offload_param_device],
            reduce_bucket_size=int(zc.reduce_bucket_size),
            max_live=int(zc.stage3_max_live_parameters),
            persistence=int(zc.stage3_param_persistence_threshold),
            model_persistence=int(zc.stage3_model_persistence_threshold),
            gas=int(config.gradient_accumulation_steps),
            delayed=bool(oc is not None and oc.delayed_update),
            chunk=update_chunk(zc.sub_group_size),
            optimizer_buffers=max(2, int(oc.buffer_count)) if oc is not None else 4,
            param_buffers=int(pc.buffer_count) if pc is not None else 5,
            max_in_cpu=int(pc.max_in_cpu) if pc is not None else 1_000_000_000,
            ratio=float(oc.ratio) if oc is not None and zc.offload_device == "cpu" else 1.0,
            pin_optimizer=_pins(device, oc, zc.offload_device),
            pin_params=_pins(device, pc, zc.offload_param_device),
            zenflow=plan_from_config(config, world, device),
            state=StateFormat.from_config(config),
        )


def _pins(device: torch.device | None, section, where: str) -> bool:
    """Whether an offload section's host buffers are pinned (CUDA, offloaded, ``pin_memory``)."""
    cuda = device is not None and device.type == "cuda"
    return cuda and section is not None and where in ("cpu", "nvme") and bool(section.pin_memory)


def _aliased(plan: ZeroPlan) -> bool:
    """Params of the master's dtype (fp32, or bf16 with a bf16 master) are their own master
    where the optimizer state sits beside them in memory (``state_build.alias_state``): both on
    the device, or at stage 3 both in host memory."""
    if (
        plan.dtype_bytes != plan.state.master_bytes
        or plan.optimizer != plan.params
        or plan.zenflow is not None
    ):
        return False  # ZenFlow keeps a master of its own (``assembly.build_updates``)
    return plan.optimizer == "device" or (
        plan.optimizer == "host" and plan.stage == 3 and plan.ratio >= 1.0 and not plan.delayed
    )


def states(numel: int, plan: ZeroPlan, shape: ModelShape | None = None) -> dict[str, int]:
    """What ``initialize`` keeps per rank (``device.*``, ``host.*``, ``nvme.*``) for ``numel``
    params (an engine's padded total, or the model's count)."""
    import torch

    by_size = {2: torch.bfloat16, 4: torch.float32}
    dtype, accum = by_size[plan.dtype_bytes], by_size[plan.accum_bytes or plan.dtype_bytes]
    out = expected_bytes(numel, dtype, plan.stage, plan.world, plan.optimizer != "device",
                         plan.gas, plan.delayed, offload_param=plan.params != "device",
                         ratio=plan.ratio if plan.optimizer == "host" else 1.0,
                         accum_dtype=accum, alias_master=_aliased(plan),
                         state=plan.state)  # fmt: skip
    shard = numel // plan.world if plan.stage else numel
    if plan.optimizer == "nvme":
        nvme_optimizer_terms(out, [shard], plan)
    if plan.params == "nvme":
        out["nvme.param_shard"] = out.pop("host.param_shard")
        if shape is not None:
            out["host.param_spares"] = param_spares(shape, plan)
    if plan.zenflow is not None and shape is not None and _zenflow_runs(plan):
        grad_bytes = plan.accum_bytes or plan.dtype_bytes
        world = plan.world if plan.stage else 1
        out.update(zenflow_bytes(shape.param_shapes(), shard, plan.zenflow, world, grad_bytes))
    persistent = persistent_numel(shape, plan) if plan.stage == 3 and shape is not None else 0
    if persistent:
        out["device.persistent_params"] = persistent * plan.dtype_bytes
    _reserve_pinned(out, plan)
    return out


def nvme_optimizer_terms(out: dict[str, int], shards: list[int], plan: ZeroPlan) -> None:
    """``offload_optimizer`` "nvme": the master and moments ``expected_bytes`` counted in host
    memory live in the swap files instead (in the format's bytes), with their second version,
    and each group's state (``shards``: its elements) keeps ``optimizer_buffers`` padded
    records in host memory (``nvme/record_layout.py``)."""
    out["nvme.master_shard"] = out.pop("host.master_shard")
    out["nvme.optimizer_state"] = out.pop("host.optimizer_state")
    out["nvme.second_version"] = out["nvme.master_shard"] + out["nvme.optimizer_state"]
    records = (swap_record_bytes(_swap_chunk(n, plan.chunk), plan.state) for n in shards)
    out["host.nvme_buffers"] = plan.optimizer_buffers * sum(records)


def _zenflow_runs(plan: ZeroPlan) -> bool:
    """Where ZenFlow is built: stages 1-3, the optimizer in host memory."""
    return plan.stage in (1, 2, 3) and plan.optimizer == "host"


def _reserve_pinned(out: dict[str, int], plan: ZeroPlan) -> None:
    """Pinned host terms as the allocator holds them, buffer by buffer (a buffer under 64 MiB
    is a power of two): the grad shard's (two with the delayed update), the staging, the NVMe
    optimizer records, one param shard (one group assumed); pinned NVMe param buffers are not
    kept for reuse (no spares)."""
    terms = {"host.param_shard": (1, plan.pin_params)}
    for key, n in (("host.grad_shard", 2 if plan.delayed else 1), ("host.param_staging", 1),
                   ("host.nvme_buffers", plan.optimizer_buffers)):  # fmt: skip
        terms[key] = (n, plan.pin_optimizer)
    for key, (n, pinned) in terms.items():
        if pinned and out.get(key):
            out[key] = n * reserved(out[key] // n, True)
    if plan.pin_params:
        out.pop("host.param_spares", None)


def param_spares(shape: ModelShape, plan: ZeroPlan) -> int:
    """NVMe params: buffers kept for reuse, up to two per buffer size (one where only one
    buffer of that size is ever used), within ``max_in_cpu``. A read buffer covers its slice's
    whole 4096-byte blocks, so its size depends on where the slice starts: the unit layout is
    walked to find the sizes. The update's writes add theirs (update chunks of the shard)."""
    b, pad, start = plan.dtype_bytes, plan.world * 16, 0
    count: collections.Counter = collections.Counter()
    for u in reversed(shape.units()):  # flat order: reverse registration
        n = max(-(-sum(u) // pad) * pad, pad) // plan.world
        count[-(-(start + n) * b // 4096) * 4096 - start * b // 4096 * 4096] += 1
        start += n
    chunk = min(plan.chunk, start)
    count[-(-chunk * b // 4096) * 4096] += start // chunk
    if start % chunk:
        count[-(-(start % chunk) * b // 4096) * 4096] += 1
    return min(sum(size * min(2, k) for size, k in count.items()), plan.max_in_cpu * b)


def _swap_chunk(numel: int, chunk: int, align: int = 2048) -> int:
    """The optimizer swap record's chunk: a shard smaller than one chunk gets its own (rounded)."""
    return min(chunk, max(align, -(-numel // align) * align))


def host_working_set(shape: ModelShape, plan: ZeroPlan) -> dict[str, int]:
    """The step's transient host bytes: NVMe param reads ahead of the gathers beside the buffers
    kept for reuse (``host.param_spares``): ``offload_param.buffer_count`` slots of a layer's
    largest unit, within ``max_in_cpu``."""
    if plan.params != "nvme":
        return {}
    unit = -(-max(sum(u) for u in shape.layer_units()) // plan.world)
    b = plan.dtype_bytes
    if plan.pin_params:  # each read's buffer as the allocator holds it
        return {
            "swap_reads": min(plan.max_in_cpu * b, plan.param_buffers * reserved(unit * b, True))
        }
    return {"swap_reads": min(plan.max_in_cpu, plan.param_buffers * unit) * b}


def working_set(shape: ModelShape, step: StepShape, plan: ZeroPlan) -> dict[str, int]:
    """The step's transient bytes on the device per rank, by category."""
    b = plan.dtype_bytes
    out = {"activations": activation_bytes(shape, step, b), "logits": logit_bytes(shape, step, b)}
    if plan.stage >= 2:
        cap = plan.reduce_bucket_size
        # stage 3 reduces a bucket per unit, stage 2 greedy buckets of params (full at the cap)
        sizes = [sum(u) for u in shape.units()] if plan.stage == 3 else shape.param_sizes()
        # Stage 3: a unit's bucket, or a piece (at most the cap) of a larger one; stage 2:
        # greedy buckets of the params within the cap (the rest: pieces of their own gradient).
        small = [n for n in sizes if n <= cap]
        # The reducer's two pooled buffers both take the largest request: a bucket padded to
        # ranks x alignment (never above the cap, which is rounded the same way).
        unit = plan.world * REDUCE_ALIGN
        pad = lambda n: -(-n // unit) * unit  # noqa: E731
        if plan.stage == 3:
            bucket, count = pad(min(cap, max(sizes))), 2
        else:
            bucket = pad(min(cap, max(sum(small), max(sizes))))
            count = min(2, -(-shape.numel() // bucket))  # one bucket: one buffer
        # A tied embedding's bucket stays open from the head's backward to the embedding's:
        # one more buffer within the cap, or its full gradient held above it.
        tied = shape.vocab * shape.hidden if shape.tied else 0
        extra = (tied if plan.stage == 3 else bucket) if 0 < tied <= cap else 0
        out["reduce_buffers"] = (count * bucket + extra) * b
        out["grads"] = (held_grads(sizes, cap) + (tied if tied > cap else 0)) * b
    if plan.stage == 3:
        live = min(shape.numel(), plan.max_live + shape.largest_unit())
        out["gathered_params"] = live * b
    return out


def persistent_numel(shape: ModelShape, plan: ZeroPlan) -> int:
    """Stage 3: elements of the fetch units kept gathered from the first step on (at most
    ``stage3_param_persistence_threshold`` each, ``stage3_model_persistence_threshold`` in all),
    each padded as the layout pads its bucket. A unit is taken as one bucket (one optimizer
    group); the engine's ``expected_memory()`` counts its actual slots."""
    left, total = plan.model_persistence, 0
    for sizes in shape.units():
        n = sum(sizes)
        if n <= plan.persistence and n <= left:
            left -= n
            total += build_unit_layout([n], [0], plan.world).total
    return total


def held_grads(sizes: list[int], cap: int) -> int:
    """Full gradients alive at once: buckets above the cap keep theirs until their last piece
    is reduced, two neighbours (in backward order) in flight; below it, one param's gradient
    before the hook copies it."""
    big = [a + b for a, b in zip(sizes, sizes[1:]) if a > cap and b > cap]
    big += [n for n in sizes if n > cap]
    return max(big) if big else max(sizes, default=0)


def activation_bytes(shape: ModelShape, step: StepShape, b: int) -> int:
    words, ffn_words = ACT_WORDS[shape.kind]
    h, f = shape.hidden, shape.ffn
    fp32 = ACT_FP32[shape.kind] + shape.heads + ACT_FP32_HIDDEN[shape.kind] * h
    layer = step.tokens * ((words * h + ffn_words * f) * b + fp32 * 4)
    if step.checkpointing:  # every layer's input (one on the device), one layer recomputed
        return (1 if step.cpu_checkpointing else shape.layers) * step.tokens * h * b + layer
    return shape.layers * layer + step.tokens * h * b * 2  # + the final norm's in and out


def checkpoint_bytes(shape: ModelShape, step: StepShape, b: int) -> int:
    """The checkpointed layer inputs of a step: every layer's, in the training dtype."""
    return shape.layers * step.tokens * shape.hidden * b


def logit_bytes(shape: ModelShape, step: StepShape, b: int) -> int:
    per_token = shape.vocab * (LOGIT_COPIES[shape.kind] * 4 + (b if b < 4 else 0))
    return step.tokens * per_token


def predict(
    shape: ModelShape, step: StepShape, plan: ZeroPlan, numel: int | None = None
) -> dict[str, int]:
    """States (``device.*``, ``host.*``, ``nvme.*``), the working set's terms
    (``peak.device.*``) and the step's peaks (``peak.device.total``, ``peak.host.total``).

    The terms do not all peak at once: the device peak is the states plus the larger of the
    head's moment (every activation saved, the logits' fp32 softmax and its gradients, the
    gathered params) and the backward's (activations still saved, full gradients not yet reduced,
    reduce buffers, gathered params), an upper bound on the latter. With ``offload_param`` the
    gathered params are on the device; on a CPU-only run "device" and "host" are the same memory
    (add them). ``numel``: the params the states hold when known exactly (an engine's padded
    total), else the shape's count."""
    out = states(shape.numel() if numel is None else numel, plan, shape)
    work = working_set(shape, step, plan)
    for k, v in work.items():
        out[f"peak.device.{k}"] = v
    host = host_working_set(shape, plan)
    if step.checkpointing and step.cpu_checkpointing:
        host["activation_checkpoints"] = checkpoint_bytes(shape, step, plan.dtype_bytes)
    for k, v in host.items():
        out[f"peak.host.{k}"] = v
    gathered = work.get("gathered_params", 0)
    # the head's backward: its logits' gradients beside its own weight's gradient
    head = (
        work["activations"]
        + work["logits"]
        + gathered
        + shape.vocab * shape.hidden * plan.dtype_bytes
    )
    backward = work["activations"] + gathered + work.get("grads", 0)
    backward += work.get("reduce_buffers", 0)
    for where, extra in (("device", max(head, backward)), ("host", sum(host.values()))):
        held = sum(v for k, v in out.items() if k.startswith(f"{where}."))
        out[f"peak.{where}.total"] = held + extra
    return out
