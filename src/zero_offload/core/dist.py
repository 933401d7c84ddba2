"""Process-group set-up and the few collectives the engine uses, with a world of one needing no
process group at all.

Every collective here is wrapped: when one fails (a timeout on a frozen or dead rank, a peer
that closed its connection), the error names the collective, this rank and the engine step the
engine last reported through :func:`set_step`, instead of a bare transport message.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist

# torch renamed the tensor-form collectives; use whichever this torch has.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# DeepSpeed's default since 0.19.6 (``deepspeed.constants.default_pg_timeout``), for every
# backend. It bounds how far one rank may lag behind the others inside a collective, not how
# long a step takes: every rank runs its own shard's host (or NVMe) optimizer step, so an
# offloaded step delays all ranks alike and needs no longer default.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
TIMEOUT_ENV = "ZERO_OFFLOAD_TIMEOUT"  # seconds; set by `zero-offload launch --timeout`
DEEPSPEED_TIMEOUT_ENV = "DEEPSPEED_TIMEOUT"  # minutes, DeepSpeed's variable
DEVICE_ENV = "ZERO_OFFLOAD_DEVICE"  # "cpu" or "cuda": where the engine runs (default: CUDA if any)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it, the rank and the engine step."""


def current_timeout() -> datetime.timedelta:
    """The default process group's collective timeout now (it can be changed after start-up,
    ``torch.distributed.distributed_c10d._set_pg_timeout``); the default when none is readable."""
    try:
        group = dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if uses_cuda() else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except (RuntimeError, AttributeError, ValueError):
        return default_timeout()


def default_timeout() -> datetime.timedelta:
    """The collective timeout when the caller names none, read when a group is made:
    ``$ZERO_OFFLOAD_TIMEOUT`` seconds (``zero-offload launch --timeout``), else
    ``$DEEPSPEED_TIMEOUT`` minutes (DeepSpeed's variable), else DeepSpeed's 10 minutes.

    ``DEEPSPEED_TIMEOUT`` takes every whole number of minutes DeepSpeed takes, and also
    fractional minutes (``0.5``: 30 s), which DeepSpeed refuses."""
    seconds = os.environ.get(TIMEOUT_ENV)
    if seconds:
        try:
            return as_timeout(seconds)
        except ValueError as err:
            raise ValueError(f"${TIMEOUT_ENV} (seconds): {err}") from None
    minutes = os.environ.get(DEEPSPEED_TIMEOUT_ENV)
    if minutes:
        try:
            value = float(minutes)
        except ValueError:
            value = float("nan")
        if not (0 < value < float("inf")):
            raise ValueError(
                f"${DEEPSPEED_TIMEOUT_ENV} must be a positive number of minutes, got {minutes!r}"
            )
        return datetime.timedelta(minutes=value)
    return DEFAULT_TIMEOUT


def as_timeout(value: datetime.timedelta | float | int | str | None) -> datetime.timedelta:
    """A collective timeout from a timedelta or a number of seconds (> 0, finite); None is
    :func:`default_timeout`."""
    if value is None:
        return default_timeout()
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(
            f"timeout must be a datetime.timedelta or a number of seconds, got {value!r}"
        )
    else:
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"timeout must be a number of seconds, got {value!r}") from None
    if not (seconds > 0 and seconds < float("inf")):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {value!r}")
    return datetime.timedelta(seconds=seconds)


def init_distributed(
    dist_backend: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    **_: object,
) -> None:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, ...).

    nccl on CUDA, gloo on CPU. Without a launcher (no WORLD_SIZE) this does nothing: the engine
    then runs as a world of one. Calling it twice is harmless.

    ``timeout`` (a timedelta or seconds; default :func:`default_timeout`: the launcher's
    ``--timeout``, else ``$DEEPSPEED_TIMEOUT`` minutes, else 10 minutes as in DeepSpeed) bounds how long a collective waits for the other ranks: on gloo a frozen or dead
    rank makes the others fail after it with a :class:`CollectiveError` naming the collective
    and the step. On NCCL a collective only enqueues: the same fault ends each waiting rank by
    torch's NCCL watchdog after the timeout (the process aborts, its log naming the collective),
    unless ``TORCH_NCCL_BLOCKING_WAIT=1`` makes every wait block the host, which turns it into
    the named error at the price of overlap (docs/reliability.md).

    The process group made here is destroyed at interpreter exit (before the interpreter tears
    down, while torch's objects are still alive): gloo's worker threads that outlive
    interpreter finalization otherwise abort the process with "terminate called without an
    active exception" after a successful run.
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ:
        return
    td = as_timeout(timeout)
    backend = dist_backend or ("nccl" if uses_cuda() else "gloo")
    bound = {}
    if backend == "nccl":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        # Bound to the device: the communicator is made now, on this GPU, and barrier and the
        # object collectives use it instead of guessing one (a guess of GPU 0 would make a
        # context there on rank k > 0).
        bound["device_id"] = device
    dist.init_process_group(backend=backend, timeout=td, **bound)
    atexit.register(shutdown)


# Why the pause: gloo's worker threads ("pt_gloo_runloop") drop their reference to a finished
# collective's tensors a moment *after* wait() has returned in the main thread. When that
# reference is the last one to a tensor that Python created (a view such as flat[a:b]), the
# worker must take the GIL to free its Python object. If the interpreter is already finalizing
# by then, the worker is killed inside a destructor and the process aborts with "terminate
# called without an active exception" (SIGABRT) after a successful run. torch's
# destroy_process_group does not join those threads, so before finalization starts we release
# the GIL long enough for them to finish (microseconds of work; the pause covers a descheduled
# thread on an oversubscribed machine).
_GLOO_DRAIN_SECONDS = 0.25


def shutdown() -> None:
    """Destroy the default process group if it is still up (idempotent); registered at exit by
    :func:`init_distributed`. Call it yourself at the end of a script that made its own group."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        time.sleep(_GLOO_DRAIN_SECONDS)  # releases the GIL to gloo's worker threads
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


_step: int | None = None
_notes: list = []  # callables: what other ranks were doing, for a failed collective's message


def add_failure_note(fn) -> object:
    """``fn(collective) -> str | None`` adds to the message of every collective that fails here
    (stage 3: what the other ranks wait to gather); ``collective`` names the one that failed.
    Returns a function that removes it."""
    _notes.append(fn)
    return lambda: _notes.remove(fn) if fn in _notes else None


def _failure_notes(collective: str) -> str:
    out = []
    for fn in list(_notes):
        try:
            note = fn(collective)
        except Exception:  # noqa: BLE001 - a note must never hide the error it explains
            note = None
        if note:
            out.append(note)
    return "".join(f"; {n}" for n in out)


def set_step(step: int | None) -> None:
    """The engine step to name when a collective fails (the engine reports it as it goes)."""
    global _step
    _step = step


@contextlib.contextmanager
def _named(name: str, what: str | None = None):
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # torch's DistBackendError and gloo's timeouts are RuntimeErrors
        at = f"engine step {_step}" if _step is not None else "start-up (before the first step)"
        doing = f" ({what})" if what else ""
        notes = _failure_notes(f"{name}{doing} at {at}")
        raise CollectiveError(
            f"collective {name}{doing} failed on rank {rank()} of {world_size()} at {at}: {e} "
            "(a rank that died, froze or was started differently; the collective timeout is "
            f"init_distributed(timeout=...) or the launcher's --timeout){notes}"
        ) from e


class _Work:
    """An async collective's handle whose ``wait`` names the collective when it fails."""

    def __init__(self, work, name: str, what: str | None = None) -> None:
        self._work, self._name, self._what = work, name, what

    def wait(self, *args, **kwargs):
        with _named(self._name, self._what):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._work, attr)


def _run(name: str, fn, *args, async_op: bool = False, what: str | None = None, **kwargs):
    """``what``: what the collective is for, named in its error (e.g. the params a stage-3
    gather fetches)."""
    with _named(name, what):
        work = fn(*args, async_op=async_op, **kwargs)
    return _Work(work, name, what) if work is not None else None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def uses_cuda() -> bool:
    """CUDA is available and ``ZERO_OFFLOAD_DEVICE`` does not ask for the CPU: the default
    backend is nccl and the launcher counts GPUs only then."""
    return torch.cuda.is_available() and os.environ.get(DEVICE_ENV, "").lower() != "cpu"


def default_device() -> torch.device:
    """CUDA when available, unless the process group is gloo (CPU collectives) or
    ZERO_OFFLOAD_DEVICE=cpu asks for the CPU."""
    forced = os.environ.get(DEVICE_ENV, "").lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZERO_OFFLOAD_DEVICE must be 'cpu' or 'cuda', got {forced!r}")
    if forced == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("ZERO_OFFLOAD_DEVICE=cuda, but torch sees no CUDA device")
    gloo = is_distributed() and dist.get_backend() == "gloo"
    if forced == "cuda" or (not forced and not gloo and torch.cuda.is_available()):
        return torch.device("cuda", local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
    """Sum-reduce ``inp`` across ranks; rank r receives the r-th slice into ``out``."""
    if world_size() == 1:
        if inp.data_ptr() != out.data_ptr():  # the input may already be the result
            out.copy_(inp)
        return None
    return _run("reduce_scatter", _reduce_scatter, out, inp, async_op=async_op)


def all_gather(
    out: torch.Tensor, inp: torch.Tensor, async_op: bool = False, what: str | None = None
):
    """Gather every rank's ``inp`` into ``out``; ``inp`` may be this rank's own slice of ``out``."""
    if world_size() == 1:
        if inp.data_ptr() != out.data_ptr():
            out.copy_(inp)
        return None
    return _run("all_gather", _all_gather, out, inp, async_op=async_op, what=what)


def all_reduce(t: torch.Tensor, async_op: bool = False, op: str = "sum"):
    """``op``: "sum", "min" or "max"."""
    if world_size() == 1:
        return None
    reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
    return _run("all_reduce", dist.all_reduce, t, async_op=async_op, op=reduce_op)


def broadcast(t: torch.Tensor, src: int = 0) -> None:
    if world_size() > 1:
        _run("broadcast", dist.broadcast, t, src=src)


def all_gather_object(out: list, obj: object) -> None:
    """Every rank's ``obj`` into ``out`` (small picklable values only: fingerprints, flags)."""
    if world_size() == 1:
        out[0] = obj
        return
    with _named("all_gather_object"):
        dist.all_gather_object(out, obj)


def barrier() -> None:
    if world_size() > 1:
        _run("barrier", dist.barrier)
