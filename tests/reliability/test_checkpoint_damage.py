"""Item: every file of a checkpoint, metadata included, is covered by a checksum; every
damage is refused with an error naming the file; ``latest`` stays inside the folder; a full
disk names the path and keeps the previous checkpoint."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import reliability_helpers as h
import torch

from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.format import sealed_meta_bytes

TAG = "global_step2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    eng = h.engine(stage=2, offload=True)
    for _ in range(2):
        eng.backward(eng(h.batch()))
        eng.step()
    eng.save_checkpoint(str(root))
    return root


def _damages(data: bytes) -> dict[str, bytes]:
    n = len(data)
    out = {
        "empty": b"",
        "half": data[: n // 2],
        "one byte short": data[:-1],
        "appended": data + b"\x00garbage",
        "not utf-8": b"\xff\xfe\x80" + data[3:],
    }
    for at in sorted({0, 1, 8, 9, n // 3, n // 2, n - 2, n - 1}):
        if 0 <= at < n:
            out[f"flip@{at}"] = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]
    return out


def _files(saved: Path) -> list[str]:
    return sorted(p.name for p in (saved / TAG).iterdir()) + ["../latest"]


def test_every_damage_to_every_file_is_refused_naming_the_file(saved, tmp_path):
    silent, unnamed = [], []
    for name in _files(saved):
        original = (saved / TAG / name).read_bytes()
        for kind, data in _damages(original).items():
            root = tmp_path / "ck"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(saved, root)
            (root / TAG / name).write_bytes(data)
            eng = h.engine(stage=2, offload=True)
            try:
                eng.load_checkpoint(str(root))
            except CheckpointError as e:
                if Path(name).name not in str(e):
                    unnamed.append(f"{name} {kind}: {e}")
            except Exception as e:  # noqa: BLE001 - anything else is a finding
                unnamed.append(f"{name} {kind}: {type(e).__name__}: {e}")
            else:
                silent.append(f"{name} {kind}")
            finally:
                eng.destroy()
    assert not silent, f"loaded a damaged checkpoint: {silent}"
    assert not unnamed, "\n".join(unnamed)


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["groups"][0]["hyper"].__setitem__("lr", 10.0),
        lambda m: m["groups"][0]["hyper"].__setitem__("betas", [0.0, 0.0]),
        lambda m: m["groups"][0].__setitem__("step_count", 1000),
        lambda m: m["counters"].__setitem__("global_steps", 7),
    ],
)
def test_edited_metadata_is_refused(saved, tmp_path, edit):
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    path = root / TAG / "meta.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta, indent=1))
    eng = h.engine(stage=2, offload=True)
    with pytest.raises(CheckpointError, match=r"meta\.json: checksum mismatch"):
        eng.load_checkpoint(str(root))


def test_resealed_metadata_still_loads(saved, tmp_path):
    """The digest is over the parsed content: re-serializing (as the test above edits) keeps it."""
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    path = root / TAG / "meta.json"
    path.write_bytes(sealed_meta_bytes(json.loads(path.read_text())))
    eng = h.engine(stage=2, offload=True)
    assert eng.load_checkpoint(str(root))[0] is not None


# Layout edits that keep every shard's size (numels [1, 8, 8, 64], align 16, one rank: 96
# elements either way), so only a check of the layout itself can see them.
_LAYOUT_EDITS = {
    "bucket reordered": ("bucket_params", [[2, 1, 0], [3]]),
    "bucket boundary moved": ("bucket_params", [[0, 1], [2, 3]]),
    "buckets merged": ("bucket_params", [[0, 1, 2, 3]]),
    "first param alone": ("bucket_params", [[0], [1, 2, 3]]),
    "param twice": ("bucket_params", [[0, 1, 1], [3]]),
    "empty bucket": ("bucket_params", [[0, 1, 2], [], [3]]),
    "align": ("align", 8),
}


@pytest.mark.parametrize("edit", sorted(_LAYOUT_EDITS))
@pytest.mark.parametrize("reader", ["load_checkpoint", "export"])
def test_resealed_layout_that_does_not_match_the_rank_files_is_refused(
    saved, tmp_path, edit, reader
):
    """meta.json edited and re-sealed (its digest recomputed): the layout it describes must still
    be the one the rank files were written under, or shards would be read at wrong offsets."""
    from zero_offload.checkpoint import get_fp32_state_dict_from_zero_checkpoint

    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    path = root / TAG / "meta.json"
    meta = json.loads(path.read_text())
    group = meta["groups"][0]
    assert group["numels"] == [1, 8, 8, 64] and group["bucket_params"] == [[0, 1, 2], [3]]
    key, value = _LAYOUT_EDITS[edit]
    group[key] = value
    path.write_bytes(sealed_meta_bytes(meta))
    with pytest.raises(CheckpointError) as info:
        if reader == "export":
            get_fp32_state_dict_from_zero_checkpoint(str(root))
        else:
            eng = h.engine(stage=2, offload=True)
            try:
                eng.load_checkpoint(str(root))
            finally:
                eng.destroy()
    message = str(info.value)
    assert str(path) in message and key in message and "groups[0]" in message, message


@pytest.mark.parametrize("target", ["..", "../saved", "/etc", "a/b", ".hidden", "x\\y"])
def test_latest_cannot_point_outside_the_folder(saved, tmp_path, target):
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    (root / "latest").write_text(target)
    eng = h.engine(stage=2, offload=True)
    with pytest.raises(CheckpointError, match=r"latest: tag .* is not allowed"):
        eng.load_checkpoint(str(root))


def test_full_disk_names_the_path_and_keeps_the_last_checkpoint(saved, tmp_path, monkeypatch):
    from zero_offload.checkpoint import tensor_file

    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    eng = h.engine(stage=2, offload=True)
    eng.load_checkpoint(str(root))
    eng.backward(eng(h.batch()))
    eng.step()
    real = tensor_file.write_file

    def full(path, *a, **k):
        if Path(path).name == "model.safetensors":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr("zero_offload.checkpoint.write.save.write_file", full)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no space left on device"):
        eng.save_checkpoint(str(root))
    assert (root / "latest").read_text() == TAG
    assert not (root / ".global_step3.partial").exists()
    fresh = h.engine(stage=2, offload=True)
    path, _ = fresh.load_checkpoint(str(root))
    assert Path(path).name == TAG
    assert torch.isfinite(next(fresh.module.parameters())).all()
