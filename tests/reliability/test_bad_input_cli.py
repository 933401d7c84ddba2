"""Item: bad input to the command-line tools ends in one line that names the file, flag or key
and what was expected, never a traceback or a silently wrong result.

- ``convert-deepspeed`` on ``.pt`` files that are not pickles, or pickles of the wrong type or
  structure; a DeepSpeed ``latest`` that points outside its folder;
- ``export`` of a DeepSpeed folder (names ``convert-deepspeed``) or to a path under a file;
- ``estimate`` with non-positive or non-finite numbers;
- ``"auto"`` sizes past 64 bits from a huge ``hidden_size``.
"""

from __future__ import annotations

import copyreg
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import reliability_helpers as h
import torch

from zero_offload.checkpoint import CheckpointError
from zero_offload.checkpoint.deepspeed import load_deepspeed_file
from zero_offload.checkpoint.deepspeed.pickle_safe import _ALLOWLIST
from zero_offload.cli.main import main
from zero_offload.config import ConfigError, load_config, resolve_auto_sizes

FIXTURES = Path(__file__).parent.parent / "ds_fixtures"  # made by DeepSpeed 0.19.8 itself
TAG = "global_step2"


def _copy(case: str, tmp_path: Path) -> Path:
    src = tmp_path / case
    shutil.copytree(FIXTURES / case, src)
    return src


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"zero-offload {command}: error:"), err
    assert "Traceback" not in err
    return lines[0]


# ---- convert-deepspeed -------------------------------------------------------------------------

# What a damaged or foreign .pt file may hold instead of DeepSpeed's dict.
_NOT_PICKLES = {
    "text": b"hello world, not a checkpoint\n",
    "empty": b"",
    "json": b'{"module": {}}',
    "binary": bytes(range(256)) * 4,
    "pickle cut short": b"\x80\x02}q\x00(X\x06\x00\x00\x00module",
}
_WRONG_TYPES = {
    "list": [1, 2, 3],
    "tensor": torch.zeros(3),
    "int": 7,
    "string": "mp_rank_00_model_states",
}


def _files(case: str) -> list[str]:
    return sorted(p.name for p in (FIXTURES / case / TAG).iterdir())


_CASE_FILES = [(c, f) for c in ("stage0", "stage2", "stage3") for f in _files(c)]


@pytest.mark.parametrize("case,name", _CASE_FILES)
@pytest.mark.parametrize("content", [*_NOT_PICKLES, *_WRONG_TYPES])
def test_convert_refuses_a_pt_file_that_is_not_deepspeeds_dict(
    case, name, content, tmp_path, capsys
):
    src = _copy(case, tmp_path)
    path = src / TAG / name
    if content in _NOT_PICKLES:
        path.write_bytes(_NOT_PICKLES[content])
    else:
        torch.save(_WRONG_TYPES[content], path)
    assert main(["convert-deepspeed", str(src), str(tmp_path / "out")]) == 2
    line = _one_line_error(capsys, "convert-deepspeed")
    assert str(path) in line and "expected" in line
    assert not (tmp_path / "out" / "latest").exists()


_WRONG: list[object] = [None, "x", [], [[1]], {"q": 1}, -3, torch.zeros(2, 2)]
_ANY = tuple(_WRONG)
_DICT_OR_NONE = (None, {"q": 1})
# The mutations the converter may accept: entries DeepSpeed writes that it has no use for (or
# only records, like the config), and values DeepSpeed itself writes (None: nothing frozen).
# Those must convert to the same weights and optimizer state as the unmutated file (or be refused
# by name); every other listed mutation must be refused with one line naming the file.
_MODEL_UNREAD = {
    "buffer_names": _ANY,
    "shared_params": _ANY,
    "data_sampler": _ANY,
    "random_ltd": _ANY,
    "dp_world_size": _ANY,  # the world size is the number of rank files
    "mp_world_size": _ANY,
    "checkpoint_parallel_dimensions": _ANY,
    "ds_version": _ANY,
    "ds_config": _DICT_OR_NONE,  # recorded; the stage is read from the files themselves
    "lr_scheduler": _DICT_OR_NONE,  # recorded for the resume
}
_OPTIM_UNREAD = {  # fp32 at world size 1: no loss scale, padding or partition count to apply
    "ds_config": _ANY,
    "ds_version": _ANY,
    **{
        ("optimizer_state_dict", k): _ANY
        for k in ("clip_grad", "ds_version", "dynamic_loss_scale", "overflow", "loss_scaler")
    },
}
_UNREAD = {
    ("stage0", "model"): {
        **_MODEL_UNREAD,
        "param_shapes": (None,),  # names and shapes come from 'module'
        "frozen_param_shapes": (None,),
        "frozen_param_fragments": (None,),
    },
    ("stage2", "model"): {
        **_MODEL_UNREAD,
        "optimizer": _ANY,  # the state is in the optim files
        "frozen_param_shapes": (None,),
        "frozen_param_fragments": (None,),
    },
    ("stage2", "optim"): {
        **_OPTIM_UNREAD,
        ("optimizer_state_dict", "zero_stage"): (-3,),  # only 3 changes the layout
        ("optimizer_state_dict", "partition_count"): _ANY,
        ("optimizer_state_dict", "group_paddings"): _ANY,
        ("optimizer_state_dict", "param_alignment_paddings"): _ANY,
    },
    ("stage3", "model"): {
        **_MODEL_UNREAD,
        "optimizer": _ANY,
        "module": (None, {"q": 1}),  # the weights are in the flat partitions
    },
    ("stage3", "optim"): {
        **_OPTIM_UNREAD,
        ("optimizer_state_dict", "zero_stage"): _ANY,  # ds_config says 3
        ("optimizer_state_dict", "partition_count"): _ANY,
    },
}


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def _accepted(case: str, name: str, keys: tuple, value: object) -> bool:
    table = _UNREAD[(case, "optim" if "optim" in name else "model")]
    key = keys[0] if len(keys) == 1 else keys
    return any(_same_value(value, v) for v in table.get(key, ()))


def _wrong_structures(case: str, name: str) -> list[tuple[tuple, object]]:
    """(key path, value): each top-level entry, and each entry of the optimizer state dict,
    replaced by values of the wrong type."""
    data = load_deepspeed_file(FIXTURES / case / TAG / name)
    paths = [(k,) for k in data]
    osd = data.get("optimizer_state_dict")
    if isinstance(osd, dict):
        paths += [("optimizer_state_dict", k) for k in osd]
    return [(path, value) for path in paths for value in _WRONG]


class _DeepSpeedPickler(pickle._Pickler):
    """Writes the loader's stand-ins for DeepSpeed's objects (its loss scaler) back under
    DeepSpeed's own class names, so a mutated file differs from DeepSpeed's in the mutation
    only (saved as they load, they would be refused as unknown classes, whatever the mutation)."""

    def reducer_override(self, obj):
        if type(obj) in _DS_CLASSES:
            return copyreg.__newobj__, (type(obj),), obj.state
        return NotImplemented

    def save_global(self, obj, name=None):
        if obj not in _DS_CLASSES:
            return super().save_global(obj, name)
        module, _, qual = _DS_CLASSES[obj].rpartition(".")
        self.write(pickle.GLOBAL + f"{module}\n{qual}\n".encode())
        self.memoize(obj)


_DS_CLASSES = {c: name for c, name in _ALLOWLIST if isinstance(c, type)}


def _save_as_deepspeed(data: dict, path: Path) -> None:
    torch.save(
        data, path, pickle_module=SimpleNamespace(Pickler=_DeepSpeedPickler, __name__="pickle")
    )


def _converted(folder: Path) -> dict:
    """A converted checkpoint's tensors: the weights and the optimizer state."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted((folder / TAG).glob("*.safetensors")):
        out |= {(f.name, k): v for k, v in load_file(str(f)).items()}
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case,name", _CASE_FILES)
def test_convert_refuses_a_dict_of_the_wrong_structure_naming_the_file(
    case, name, tmp_path, capsys
):
    clean_src = tmp_path / "clean_src"
    shutil.copytree(FIXTURES / case, clean_src)  # re-saved unchanged: converts as the original
    _save_as_deepspeed(load_deepspeed_file(clean_src / TAG / name), clean_src / TAG / name)
    assert main(["convert-deepspeed", str(clean_src), str(tmp_path / "clean")]) == 0
    clean = _converted(tmp_path / "clean")
    capsys.readouterr()
    unclear = []
    for i, (keys, value) in enumerate(_wrong_structures(case, name)):
        src = tmp_path / f"src{i}"
        shutil.copytree(FIXTURES / case, src)
        path = src / TAG / name
        data = load_deepspeed_file(path)
        node = data
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
        _save_as_deepspeed(data, path)
        what = f"{keys}={value!r}"
        try:
            rc = main(["convert-deepspeed", str(src), str(tmp_path / f"out{i}")])
        except Exception as e:  # noqa: BLE001 - a traceback is the finding
            unclear.append(f"{what}: {type(e).__name__}: {e}")
            continue
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        refused = rc == 2 and len(lines) == 1 and str(path) in lines[0]
        if _accepted(case, name, keys, value):
            if not refused and (rc != 0 or not _same(_converted(tmp_path / f"out{i}"), clean)):
                unclear.append(f"{what}: not converted to the same state (rc {rc}) {err}")
            continue
        if not refused:
            unclear.append(f"{what}: not refused by name: rc {rc}: {err.strip()}")
    assert not unclear, "\n".join(unclear[:200])


@pytest.mark.parametrize("form", ["relative", "absolute", "dotdot"])
def test_convert_refuses_a_latest_that_points_outside_its_folder(form, tmp_path, capsys):
    src = _copy("stage2", tmp_path)
    outside = tmp_path / "elsewhere"  # a real DeepSpeed tag folder, outside src
    shutil.copytree(FIXTURES / "stage2" / TAG, outside)
    target = {"relative": "../elsewhere", "absolute": str(outside), "dotdot": ".."}[form]
    (src / "latest").write_text(target)
    assert main(["convert-deepspeed", str(src), str(tmp_path / "out")]) == 2
    line = _one_line_error(capsys, "convert-deepspeed")
    assert str(src / "latest") in line and "not allowed" in line and "inside" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---- export ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag_dir", [False, True])
def test_export_of_a_deepspeed_folder_names_convert_deepspeed(tag_dir, tmp_path, capsys):
    src = FIXTURES / "stage2" / (TAG if tag_dir else "")
    assert main(["export", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "is a DeepSpeed checkpoint" in err
    assert f"zero-offload convert-deepspeed {src}" in err
    assert "meta.json" not in err


@pytest.fixture
def converted(tmp_path) -> Path:
    assert main(["convert-deepspeed", str(FIXTURES / "stage2"), str(tmp_path / "ck")]) == 0
    return tmp_path / "ck"


@pytest.mark.parametrize("under", ["file.txt/out", "file.txt", "file.txt/a/b"])
def test_export_to_a_path_under_a_file_names_the_path(converted, under, tmp_path, capsys):
    capsys.readouterr()
    (tmp_path / "file.txt").write_text("a file, not a folder")
    assert main(["export", str(converted), str(tmp_path / under)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(tmp_path / under / "model.safetensors") in err
    assert f"{tmp_path / 'file.txt'} is a file, not a folder" in err
    assert (tmp_path / "file.txt").read_text() == "a file, not a folder"


def test_export_onto_a_folder_names_the_path(converted, tmp_path, capsys):
    capsys.readouterr()
    (tmp_path / "out" / "model.safetensors").mkdir(parents=True)
    assert main(["export", str(converted), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "out" / "model.safetensors") in err


# ---- estimate ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--params", "-5"], "--params"),
        (["--params", "0"], "--params"),
        (["--params", "0.5"], "--params"),
        (["--params", "nan"], "--params"),
        (["--params", "inf"], "--params"),
        (["--params", "1e400"], "--params"),
        (["--params", "1e9", "--gpus", "0"], "--gpus"),
        (["--params", "1e9", "--gpus", "-2"], "--gpus"),
        (["--model", "gpt2", "--hidden-size", "-1"], "--hidden-size"),
        (["--model", "gpt2", "--num-layers", "0"], "--num-layers"),
        (["--model", "gpt2", "--num-attention-heads", "0"], "--num-attention-heads"),
        (["--model", "gpt2", "--seq-length", "-3"], "--seq-length"),
        (["--model", "gpt2", "--vocab-size", "0"], "--vocab-size"),
    ],
)
def test_estimate_refuses_numbers_that_make_no_sense(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        main(["estimate", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no table of negative or meaningless sizes
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("zero-offload estimate: error: argument " + flag + ":")
    assert "expected" in last and ">= 1" in last


def test_estimate_names_both_flags_when_heads_do_not_divide_hidden(capsys):
    assert main(["estimate", "--model", "gpt2", "--hidden-size", "100"]) == 2
    line = _one_line_error(capsys, "estimate")
    assert "--hidden-size 100" in line and "--num-attention-heads 16" in line


# ---- "auto" sizes past 64 bits -----------------------------------------------------------------

_AUTO = {
    "stage": 3,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
}


def _model_with_hidden(hidden: int) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = SimpleNamespace(hidden_size=hidden)  # type: ignore[assignment]
    return model


@pytest.mark.parametrize(
    "hidden,keys",
    [
        (2**32, ["reduce_bucket_size", "stage3_prefetch_bucket_size"]),  # h*h = 2**64
        (
            10**200,
            [
                "reduce_bucket_size",
                "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold",
            ],
        ),
    ],
)
def test_auto_sizes_past_int64_name_the_key(hidden, keys):
    cfg = load_config({"train_batch_size": 1, "zero_optimization": _AUTO}, 1)
    before = cfg.zero_optimization.reduce_bucket_size
    with pytest.raises(ConfigError) as info:
        resolve_auto_sizes(cfg, _model_with_hidden(hidden))
    problems = info.value.problems
    assert [p.split(":")[0] for p in problems] == [f"zero_optimization.{k}" for k in keys]
    for p in problems:
        assert '"auto"' in p and f"hidden_size h={hidden}" in p and "2**63 - 1" in p
    assert cfg.zero_optimization.reduce_bucket_size == before  # nothing half-filled


def test_auto_sizes_at_the_int64_edge_still_resolve():
    cfg = load_config(
        {"train_batch_size": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, 1
    )
    hidden = 3037000499  # the largest h with h*h <= 2**63 - 1
    _, chosen = resolve_auto_sizes(cfg, _model_with_hidden(hidden))
    assert chosen == {"reduce_bucket_size": hidden**2}


def test_initialize_with_auto_sizes_past_int64_names_the_key():
    import zero_offload

    model = h.net()
    model.config = SimpleNamespace(hidden_size=2**40)  # type: ignore[assignment]
    cfg = h.config(stage=2)
    cfg["zero_optimization"]["reduce_bucket_size"] = "auto"
    with pytest.raises(ConfigError, match=r"zero_optimization\.reduce_bucket_size: \"auto\""):
        zero_offload.initialize(model=model, config=cfg)


def test_checkpoint_error_is_what_convert_raises_for_bad_files(tmp_path):
    """The API (not only the CLI) raises CheckpointError naming the file."""
    from zero_offload.checkpoint.deepspeed import convert_deepspeed_checkpoint

    src = _copy("stage2", tmp_path)
    path = src / TAG / "mp_rank_00_model_states.pt"
    path.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=str(path)):
        convert_deepspeed_checkpoint(src, tmp_path / "out")
