import sysconfig
from pathlib import Path

import pytest
import torch

from zero_offload.data import (
    TokenBlockDataset,
    builtin_corpus_files,
    load_corpus,
    split_heldout,
)


def test_builtin_corpus_is_the_standard_library_in_a_fixed_order() -> None:
    files = builtin_corpus_files()
    assert files == builtin_corpus_files()
    for before, after in zip(files, files[1:]):
        if before.parent == after.parent:
            assert before.name < after.name
    names = {p.name for p in files}
    assert "os.py" in names and "argparse.py" in names
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "test", "__pycache__"}
    assert not any(skipped & set(p.relative_to(root).parts) for p in files)
    assert all(p.suffix == ".py" for p in files)
    tokens = load_corpus(None, max_bytes=200_000)
    assert tokens.dtype == torch.uint8 and tokens.shape == (200_000,)
    assert torch.equal(tokens, load_corpus(None, max_bytes=200_000))
    text = bytes(tokens[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text


def test_user_paths_files_and_folders(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"second")
    (tmp_path / "b" / "blob.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / "a.txt").write_bytes(b"first")
    tokens = load_corpus([str(tmp_path)])
    assert bytes(tokens.tolist()) == b"first\nsecond\n"
    only = load_corpus([str(tmp_path / "b" / "two.txt"), str(tmp_path / "a.txt")], max_bytes=9)
    assert bytes(only.tolist()) == b"second\nfi"
    assert bytes(load_corpus(str(tmp_path / "a.txt")).tolist()) == b"first\n"


def test_missing_path_and_empty_data_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        load_corpus([str(tmp_path / "nope")])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no readable text"):
        load_corpus([str(tmp_path)])
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(None, max_bytes=0)


def test_blocks_are_consecutive_and_labels_shifted_by_one() -> None:
    tokens = torch.arange(23, dtype=torch.uint8)
    ds = TokenBlockDataset(tokens, seq_length=5)
    assert len(ds) == 4  # 22 // 5: the last block needs a token for its final label
    x, y = ds[1]
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist() == [5, 6, 7, 8, 9] and y.tolist() == [6, 7, 8, 9, 10]
    assert ds[-1][1].tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(IndexError):
        ds[4]


def test_dataset_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="seq_length"):
        TokenBlockDataset(torch.zeros(10, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match="too few"):
        TokenBlockDataset(torch.zeros(5, dtype=torch.uint8), 5)


def test_heldout_split_is_the_tail() -> None:
    tokens = torch.arange(100, dtype=torch.uint8)
    train, heldout = split_heldout(tokens, 0.1)
    assert train.tolist() == list(range(90)) and heldout.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_heldout(tokens, 1.0)
    with pytest.raises(ValueError, match="too few"):
        split_heldout(torch.arange(3, dtype=torch.uint8), 0.1)
