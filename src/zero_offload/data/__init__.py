"""Training data: the built-in byte-level corpus and fixed-length token blocks."""

from zero_offload.data.corpus import (
    DEFAULT_MAX_BYTES,
    TokenBlockDataset,
    builtin_corpus_files,
    load_corpus,
    split_heldout,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TokenBlockDataset",
    "builtin_corpus_files",
    "load_corpus",
    "split_heldout",
]
