"""The streaming safetensors writer and its block digests: files the official reader accepts,
digests anyone can recompute, and verification that reads (and blames) only the touched blocks."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zero_offload.checkpoint.format import CheckpointError, check_tag, json_value
from zero_offload.checkpoint.tensor_file import (
    Entry,
    read_header,
    touched_blocks,
    verify,
    write_file,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(7, 9, generator=g)
    return {
        "f32": torch.randn(1000, generator=g),
        "bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(17, generator=g).half(),
        "i64": torch.arange(-5, 6),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": base.t(),  # non-contiguous: written in logical order
        "u8": torch.arange(250, dtype=torch.uint8),
    }


def test_roundtrip_through_the_official_reader(tmp_path):
    tensors = _tensors()
    path = tmp_path / "t.safetensors"
    digest = write_file(
        path,
        [Entry.of(k, v) for k, v in tensors.items()],
        {"k": "v"},
        block_size=64,
        chunk_bytes=16,
    )
    back = load_file(str(path))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v), k
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
        assert torch.equal(f.get_slice("f32")[10:20], tensors["f32"][10:20])
    raw = path.read_bytes()
    assert digest["size"] == len(raw)
    blocks = [hashlib.sha256(raw[i : i + 64]).hexdigest() for i in range(0, len(raw), 64)]
    assert digest["block_sha256"] == blocks
    assert (
        digest["sha256"] == hashlib.sha256(b"".join(bytes.fromhex(b) for b in blocks)).hexdigest()
    )
    verify(path, digest, None)


def test_lazy_entries_and_wrong_announcements(tmp_path):
    t = torch.arange(6.0)
    write_file(tmp_path / "a.safetensors", [Entry("x", torch.float32, (6,), lambda: t)])
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["x"], t)
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'x' is torch.float32 \(6,\), announced as torch.float32 \(2, 3\)",
    ):
        write_file(tmp_path / "b.safetensors", [Entry("x", torch.float32, (2, 3), lambda: t)])
    with pytest.raises(CheckpointError, match="appears twice"):
        write_file(tmp_path / "c.safetensors", [Entry.of("x", t), Entry.of("x", t)])


def test_verify_reads_and_blames_only_touched_blocks(tmp_path):
    a, b = torch.arange(64, dtype=torch.float32), torch.arange(64, 128, dtype=torch.float32)
    path = tmp_path / "t.safetensors"
    digest = write_file(path, [Entry.of("a", a), Entry.of("b", b)], block_size=128, chunk_bytes=64)
    header = read_header(path)
    raw = bytearray(path.read_bytes())
    pos = header.data_start + header.tensors["b"].begin + 200  # inside b, > one block past a's end
    raw[pos] ^= 0xFF
    path.write_bytes(bytes(raw))
    a_range = (
        header.data_start + header.tensors["a"].begin,
        header.data_start + header.tensors["a"].end,
    )
    assert pos // 128 not in touched_blocks([a_range], 128)
    verify(path, digest, [a_range], header)  # a's blocks are intact: no error
    with pytest.raises(
        CheckpointError, match=r"checksum mismatch in bytes \[\d+, \d+\) \(tensor\(s\) .*b"
    ):
        verify(path, digest, None, header)


def test_truncation_is_reported_with_sizes(tmp_path):
    path = tmp_path / "t.safetensors"
    digest = write_file(path, [Entry.of("a", torch.zeros(100))])
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(
        CheckpointError, match=r"\d+ bytes, the checkpoint recorded \d+ \(truncated"
    ):
        verify(path, digest, None)
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        read_header(path)


def test_touched_blocks():
    assert touched_blocks([(0, 1), (127, 129), (300, 300)], 128) == {0, 1}


def test_json_value_names_the_bad_entry():
    assert json_value({"a": (1, 2.5, None), "b": {"c": True}}, "x") == {
        "a": [1, 2.5, None],
        "b": {"c": True},
    }
    with pytest.raises(CheckpointError, match=r"x\['a'\]\[1\]: value of type set"):
        json_value({"a": [1, {2}]}, "x")
    with pytest.raises(CheckpointError, match="key 3 of type int is not a string"):
        json_value({3: 1}, "x")


def test_check_tag():
    assert check_tag("global_step7") == "global_step7"
    for bad in ("a/b", ".x", "latest", ""):
        with pytest.raises(CheckpointError, match="tag"):
            check_tag(bad)
