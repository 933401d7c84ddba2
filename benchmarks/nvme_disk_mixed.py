"""The disk under the NVMe step's own load: reads and writes of whole optimizer-state records
(``chunk x 12`` bytes each) at once, as the update reads the next records while it writes the
previous ones back, with ``in_flight`` requests outstanding (the record pool,
``offload_optimizer.buffer_count``) on the step's aio settings.

Returns the combined rate (bytes read plus written per second, GB/s): the floor of a step that
mixes its reads and writes is its bytes at that rate; a disk that serves both directions at
once does better than one direction at a time, one that mixes badly does worse.
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from pathlib import Path

from zero_offload.nvme.io.aio import AioEngine, AioPolicy, SwapFile, aligned_empty


def measure_mixed(
    path: Path, record: int, records: int, in_flight: int, policy: AioPolicy, reps: int = 3
) -> dict[str, float]:
    """Median of ``reps`` passes, each reading ``records`` records from one half of a scratch
    file while writing ``records`` to the other half, ``in_flight`` at a time, alternating."""
    path = Path(path)
    if path.is_dir():
        path = path / f".zero_offload_mixed_bench.{os.getpid()}"
    engine = AioEngine(policy)
    f = SwapFile.create(path, 2 * records * record)
    bufs = [aligned_empty(record) for _ in range(max(2, in_flight))]
    for b in bufs:
        b.fill_(1)
    try:
        for i in range(2 * records):  # untimed: the extents are written, as a swap file's are
            engine.write(f, i * record, bufs[0]).wait()
        rates = [_one_pass(engine, f, bufs, record, records) for _ in range(reps)]
    finally:
        engine.close()
        f.unlink()
    return {"mixed_gbps": statistics.median(rates), "record": record, "in_flight": len(bufs)}


def _one_pass(engine: AioEngine, f: SwapFile, bufs: list, record: int, records: int) -> float:
    pending: collections.deque = collections.deque()
    free = collections.deque(bufs)
    t0 = time.perf_counter()
    for i in range(2 * records):
        if not free:
            buf, req = pending.popleft()
            req.wait()
            free.append(buf)
        buf = free.popleft()
        k = i // 2
        if i % 2 == 0:  # read record k of the first half
            pending.append((buf, engine.read(f, k * record, buf)))
        else:  # write record k of the second half
            pending.append((buf, engine.write(f, (records + k) * record, buf)))
    for _, req in pending:
        req.wait()
    os.fdatasync(f.fd)
    return 2 * records * record / 1e9 / (time.perf_counter() - t0)
