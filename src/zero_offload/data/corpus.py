"""Byte-level text corpus: the Python standard library's own sources, or the user's files.

Every Python installation carries its standard library, so the built-in corpus needs no
download and is the same on every machine with the same Python version. Tokens are bytes
(vocabulary 256), so no tokenizer is needed either.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset

DEFAULT_MAX_BYTES = 8 * 1024 * 1024

# Third-party packages differ between machines and test suites between distributions (Debian
# ships them separately), so both stay out to keep the built-in corpus the same everywhere.
_SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
_BINARY_SNIFF_BYTES = 8192


def builtin_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files in a fixed (sorted, depth-first) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in _walk_sorted(root) if p.suffix == ".py"]


def _walk_sorted(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning and sorting in place fixes os.walk's visiting order, which is otherwise the
        # file system's and differs between machines.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and d[0] != ".")
        for name in sorted(filenames):
            yield Path(dirpath) / name


def _read_text_bytes(path: Path) -> bytes | None:
    """The file's bytes, or None when it cannot be read or looks binary (a NUL byte early on)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return None if b"\x00" in data[:_BINARY_SNIFF_BYTES] else data


def _expand(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files.extend(_walk_sorted(path))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"data path {entry!r} is neither a file nor a folder")
    return files


def load_corpus(paths: list[str] | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Concatenated bytes of text files as a 1-D uint8 tensor, at most ``max_bytes`` long.

    ``paths=None`` reads the built-in corpus (standard library sources). Otherwise each entry is
    a text file or a folder read recursively in sorted order; files that cannot be read or look
    binary are skipped. Files are joined by a newline.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if isinstance(paths, str | os.PathLike):
        paths = [os.fspath(paths)]  # one path given bare, not a list of its characters
    files = builtin_corpus_files() if paths is None else _expand(list(paths))
    chunks: list[bytes] = []
    total = 0
    for path in files:
        data = _read_text_bytes(path)
        if not data:
            continue
        chunk = data + b"\n"
        chunks.append(chunk[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        where = "the standard library" if paths is None else f"data paths {list(paths)!r}"
        raise ValueError(f"no readable text found in {where}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_heldout(
    tokens: torch.Tensor, heldout_fraction: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, heldout): the last ``heldout_fraction`` of the tokens is held out.

    A contiguous tail rather than random blocks, so no held-out text also occurs in training
    by sharing a file with a training block.
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction!r}")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    cut = len(tokens) - int(len(tokens) * heldout_fraction)
    if cut <= 0 or cut >= len(tokens):
        raise ValueError(
            f"{len(tokens)} tokens are too few to hold out a fraction of {heldout_fraction}"
        )
    return tokens[:cut], tokens[cut:]


class TokenBlockDataset(Dataset):
    """Consecutive, non-overlapping blocks of ``seq_length`` tokens.

    Item ``i`` is ``(input_ids, labels)``, both int64 of length ``seq_length``, with
    ``labels[t] == input_ids[t + 1]``: the labels are shifted here so the model does not shift.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if isinstance(seq_length, bool) or not isinstance(seq_length, int) or seq_length <= 0:
            raise ValueError(f"seq_length must be a positive integer, got {seq_length!r}")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if len(tokens) < seq_length + 1:
            raise ValueError(
                f"{len(tokens)} tokens are too few for one block of seq_length {seq_length} "
                f"(need {seq_length + 1})"
            )
        self.tokens = tokens
        self.seq_length = seq_length

    def __len__(self) -> int:
        # Each block needs one more token for its last label.
        return (len(self.tokens) - 1) // self.seq_length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block index {index} out of range for {len(self)} blocks")
        start = (index % len(self)) * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].long()
        return window[:-1], window[1:]
