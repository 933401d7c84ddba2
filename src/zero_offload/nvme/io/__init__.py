"""The swap-file layer under both NVMe states: the I/O engine and its swap files (``aio.py``),
block checksums of what the run wrote (``checksum.py``), a swap file still the run's own and held
while open (``file_guard.py``), swap files removed with their owner (``scratch.py``) and the
opt-in I/O timeline (``trace.py``, read by ``trace_report.py``). Nothing here knows what a file
holds: that is the optimizer state's and the param shard's business, one folder up."""
