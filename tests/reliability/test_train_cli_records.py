"""Item: the train command keeps its records and reports bad input without a traceback."""

from __future__ import annotations

import csv
import errno
import json
from pathlib import Path

import pytest

from zero_offload.checkpoint.format import sealed_meta_bytes
from zero_offload.cli.main import main

SMALL = ["train", "--preset", "tiny", "--max-bytes", "200000", "--eval-batches", "1"]
SMALL += ["--log-every", "0"]


def steps_in(folder: Path) -> list[int]:
    with open(folder / "metrics.csv", newline="") as handle:
        return [int(r["step"]) for r in csv.DictReader(handle)]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    assert main([*SMALL, "--steps", "3", "--save-every", "3", "--out", str(out)]) == 0
    return out


def test_resume_into_the_same_folder_appends_metrics(three_steps, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(three_steps, out)
    ckpt = str(out / "checkpoints")
    assert main([*SMALL, "--steps", "5", "--resume", ckpt, "--out", str(out)]) == 0
    assert steps_in(out) == [1, 2, 3, 4, 5]


def test_resume_a_finished_run_says_so(three_steps, tmp_path, capsys):
    ckpt = str(three_steps / "checkpoints")
    assert main([*SMALL, "--steps", "3", "--resume", ckpt, "--out", str(tmp_path / "r")]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_resume_from_an_engine_checkpoint_without_client_state(three_steps, tmp_path):
    import shutil

    ckpt = tmp_path / "ck"
    shutil.copytree(three_steps / "checkpoints", ckpt)
    meta_path = ckpt / "global_step3" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["client_state"] = None  # as engine.save_checkpoint(save_dir) writes it
    meta_path.write_bytes(sealed_meta_bytes(meta))
    out = tmp_path / "r"
    assert main([*SMALL, "--steps", "4", "--resume", str(ckpt), "--out", str(out)]) == 0
    assert steps_in(out) == [4]


def test_mismatched_checkpoint_is_an_error_not_a_traceback(three_steps, tmp_path, capsys):
    argv = [*SMALL, "--num-layers", "3", "--steps", "4", "--out", str(tmp_path / "r")]
    assert main([*argv, "--resume", str(three_steps / "checkpoints")]) == 2
    captured = capsys.readouterr()  # errors go to stderr, one line, no traceback
    assert "error: cannot resume from" in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_invalid_config_is_an_error_naming_the_key(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}))
    assert main([*SMALL, "--config", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.reduce_bucket_size" in err and str(cfg) in err


def test_full_disk_during_periodic_saves(tmp_path, monkeypatch, capsys):
    from zero_offload.checkpoint.write import save

    real = save.write_file

    def fill_up(path, *a, **k):
        if "global_step4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *a, **k)

    monkeypatch.setattr(save, "write_file", fill_up)
    out = tmp_path / "r"
    argv = [*SMALL, "--steps", "5", "--save-every", "1", "--keep-last", "2", "--out", str(out)]
    assert main(argv) == 1  # finished, but says a save failed
    err = capsys.readouterr().err
    assert "checkpoint at step 4 not saved" in err and "no space left on device" in err
    assert ".global_step4.partial" in err  # the path that failed
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "global_step5"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == [
        "global_step3",
        "global_step5",
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    assert steps_in(out) == [1, 2, 3, 4, 5]
