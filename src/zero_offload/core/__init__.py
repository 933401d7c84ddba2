"""Shared pieces below runtime/, nvme/, checkpoint/ and utils/: the flat layout and flat group,
process-group wrappers, streams and pinned memory, the shard state protocol, DeepSpeed's
``ds_status`` values, profiler labels, start-up agreement, the repeating loader.

Nothing here imports runtime/, nvme/, checkpoint/, utils/ or hf/ (tests/test_import_rules.py).
"""
