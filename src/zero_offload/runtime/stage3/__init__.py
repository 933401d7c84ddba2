"""Stage 3: param shards, gather and release per module, partitioning by ``zero.Init``."""
