"""``aio`` section: DeepSpeed's asynchronous-I/O settings for NVMe offload (ZeRO-Infinity).

Key names and defaults are DeepSpeed's (``deepspeed/runtime/swap_tensor/constants.py``); DeepSpeed
reads them as given (``get_scalar_param``), so a quoted number is an error here. The section is
read only when ``offload_optimizer`` or ``offload_param`` has ``device: "nvme"``; otherwise it is
validated and ignored, with no warning.

``thread_count`` is the name DeepSpeed's documentation gives the I/O thread count, while its code
reads only ``intra_op_parallelism`` (and so ignores ``thread_count``). Both are accepted here as
spellings of one setting: ``thread_count`` alone is used; given both with different values,
``intra_op_parallelism`` is used, as DeepSpeed would, and ``load_config`` warns naming both.
After validation the setting is held in ``intra_op_parallelism`` only (``thread_count`` is
null), so ``to_dict()`` loads again to the same config.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from ..fields import Bool, Int, Section

# DeepSpeed's defaults (AIO_DEFAULT_DICT).
AIO_BLOCK_SIZE = 1_048_576
AIO_QUEUE_DEPTH = 8
AIO_INTRA_OP_PARALLELISM = 1


class AioConfig(Section):
    """``aio``: block size (bytes) and queue depth of each read/write submission, the number of
    I/O threads (:attr:`threads`), whether requests are submitted one at a time
    (``single_submit``) and whether completions overlap submissions (``overlap_events``).
    ``use_gds`` (GPUDirect Storage) is not built: true is an error."""

    block_size: Int = Field(
        AIO_BLOCK_SIZE,
        gt=0,
        description="Each NVMe read or write is split into pieces of this size (bytes), run "
        "in parallel by the I/O threads.",
    )
    queue_depth: Int = Field(
        AIO_QUEUE_DEPTH,
        gt=0,
        description="Requests each I/O thread keeps at the disk at once (DeepSpeed: libaio's "
        "submission queue depth): the pread/pwrite pool here runs threads x queue_depth "
        "workers, one blocking request each (1: one request per thread).",
    )
    intra_op_parallelism: Int = Field(
        AIO_INTRA_OP_PARALLELISM,
        ge=1,
        description="I/O threads serving each read or write (threads); the key DeepSpeed's "
        "code reads.",
    )
    # Another spelling of intra_op_parallelism (DeepSpeed's docs); null once validated.
    thread_count: Int | None = Field(
        None,
        ge=1,
        description="The I/O thread count under the name DeepSpeed's documentation gives it "
        "(threads): used when given alone; intra_op_parallelism wins when both differ (a "
        "warning). Null once loaded.",
    )
    single_submit: Bool = Field(
        False,
        description="DeepSpeed: submit a request's blocks one by one rather than as a batch. "
        "No effect with the thread-pool I/O here: kept so a config round-trips.",
    )
    overlap_events: Bool = Field(
        True,
        description="DeepSpeed: submit new requests without waiting for earlier ones to "
        "complete. No effect with the thread-pool I/O here: kept so a config round-trips.",
    )
    use_gds: Bool = Field(
        False,
        description="DeepSpeed: GPUDirect Storage (NVMe to GPU memory directly). Not built: "
        "true is an error.",
    )

    # (thread_count, intra_op_parallelism) as given when they differ; for load_config's warning.
    _conflict: tuple[int, int] | None = PrivateAttr(None)

    @field_validator("use_gds")
    @classmethod
    def _use_gds(cls, value: Any) -> Any:
        if value:
            raise ValueError(
                "GPUDirect Storage is not built; use false (the NVMe offload reads and writes "
                "through host memory)"
            )
        return value

    @model_validator(mode="after")
    def _thread_spellings(self) -> AioConfig:
        given = self.thread_count
        if given is not None:
            if (
                "intra_op_parallelism" in self.model_fields_set
                and self.intra_op_parallelism != given
            ):
                self._settle(_conflict=(given, self.intra_op_parallelism))
            else:
                self._settle(intra_op_parallelism=given)
            # Applied: to_dict() then holds one spelling, so it loads again.
            self._settle(thread_count=None)
        return self

    @property
    def threads(self) -> int:
        """The I/O thread count: ``intra_op_parallelism``, or ``thread_count`` given alone."""
        return self.intra_op_parallelism

    def spelling_conflict(self, prefix: str = "aio") -> str | None:
        """The warning text when ``thread_count`` and ``intra_op_parallelism`` were both given
        with different values, else None."""
        if self._conflict is None:
            return None
        thread_count, used = self._conflict
        return (
            f"{prefix}.thread_count={thread_count} and {prefix}.intra_op_parallelism={used} are "
            f"the same setting (the I/O thread count); {prefix}.intra_op_parallelism={used} is "
            "used, as DeepSpeed reads only that key (give one of them to silence this)"
        )
