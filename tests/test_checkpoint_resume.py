"""Exact and elastic resume, in fresh spawned processes.

Exact: 10 uninterrupted steps against 5 steps, save, a fresh process that loads and runs 5 more:
losses and parameters bitwise equal. The matrix covers fp32, bf16 and fp16 (dynamic loss scale),
offload on and off, stages 0/1/2, 1 and 2 ranks, one and two micro-steps per step, and a warmup
LR schedule that is still moving at the split.

Elastic: the world-2 stage-2 + offload checkpoint, loaded at world 1 and 4 with stage 1 and no
offload (same global batch), continues like the uninterrupted run within the design notes'
displacement measure. The export of that sharded checkpoint equals the gathered fp32 masters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import (
    CLIENT_STATE,
    SPLIT,
    resume_phase,
    resume_world2,
    save_phase,
    save_world2,
)
from distributed import run_ranks
from parity import displacement_err, make_model

W1 = [
    {
        "id": "w1-s2-offload-fp32",
        "stage": 2,
        "offload": True,
        "dtype": "fp32",
        "micro": 2,
        "gas": 1,
    },
    {"id": "w1-s0-bf16-gas2", "stage": 0, "offload": False, "dtype": "bf16", "micro": 2, "gas": 2},
    {"id": "w1-s1-fp16", "stage": 1, "offload": False, "dtype": "fp16", "micro": 2, "gas": 1},
    {
        "id": "w1-s3-params-bf16-gas2",
        "stage": 3,
        "offload": True,
        "offload_param": True,
        "dtype": "bf16",
        "micro": 2,
        "gas": 2,
    },
]
W2 = [
    {
        "id": "w2-s2-offload-fp32",
        "stage": 2,
        "offload": True,
        "dtype": "fp32",
        "micro": 2,
        "gas": 1,
    },
    {
        "id": "w2-s1-bf16-gas2",
        "stage": 1,
        "offload": False,
        "dtype": "bf16",
        "micro": 2,
        "gas": 2,
        "overlap": True,
    },
    {
        "id": "w2-s2-offload-bf16",
        "stage": 2,
        "offload": True,
        "dtype": "bf16",
        "micro": 2,
        "gas": 1,
    },
    {"id": "w2-s3-fp32", "stage": 3, "offload": False, "dtype": "fp32", "micro": 2, "gas": 1},
    {
        "id": "w2-s3-params-fp16",
        "stage": 3,
        "offload": True,
        "offload_param": True,
        "dtype": "fp16",
        "micro": 2,
        "gas": 1,
    },
]
# Same global batch (4 samples) as the world-2 source; stage 1, no offload, other bucket size.
ELASTIC_W1 = [
    {
        "id": "elastic-w1",
        "from": "w2-s2-offload-fp32",
        "stage": 1,
        "offload": False,
        "dtype": "fp32",
        "micro": 4,
        "gas": 1,
        "bucket": 64,
    },
    {  # stage 2 -> stage 3 (params on the host)
        "id": "elastic-s2-to-s3-w1",
        "from": "w2-s2-offload-fp32",
        "stage": 3,
        "offload": True,
        "offload_param": True,
        "dtype": "fp32",
        "micro": 4,
        "gas": 1,
    },
    {  # stage 3 -> stage 2
        "id": "elastic-s3-to-s2-w1",
        "from": "w2-s3-fp32",
        "stage": 2,
        "offload": False,
        "dtype": "fp32",
        "micro": 4,
        "gas": 1,
    },
]
ELASTIC_W4 = [
    {
        "id": "elastic-w4",
        "from": "w2-s2-offload-fp32",
        "stage": 1,
        "offload": False,
        "dtype": "fp32",
        "micro": 1,
        "gas": 1,
        "bucket": 300,
    },
    {
        "id": "elastic-s3-w4",
        "from": "w2-s3-fp32",
        "stage": 3,
        "offload": False,
        "dtype": "fp32",
        "micro": 1,
        "gas": 1,
    },
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def saved(root):
    out = run_ranks(2, save_world2, W2, root)
    out.update(save_phase(W1, root))  # world 1 saves in this process; the loads are all fresh
    return out


@pytest.fixture(scope="module")
def resumed_w1(saved, root):
    return run_ranks(1, resume_phase, W1 + ELASTIC_W1, root)


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _check_exact(cases, saved, resumed) -> None:
    for case in cases:
        s, r = saved[case["id"]], resumed[case["id"]]
        cid = case["id"]
        # Saving changes nothing: the run that saved continues exactly like the straight one.
        assert s["first"] + s["continued"] == s["straight"], cid
        _assert_bitwise(
            s["continued_state"]["master"], s["full"]["master"], f"{cid} save side effect"
        )
        # The fresh process starts where the save was and ends where the straight run ended.
        _assert_bitwise(r["loaded"]["master"], s["at_save"]["master"], f"{cid} loaded master")
        _assert_bitwise(r["loaded"]["module"], s["at_save"]["module"], f"{cid} loaded module")
        assert r["loaded"]["counters"] == s["at_save"]["counters"], cid
        assert (
            r["loaded"]["lr"] == s["at_save"]["lr"]
            and r["loaded"]["loss_scale"] == s["at_save"]["loss_scale"]
        ), cid
        assert r["rest"] == s["straight"][SPLIT:], cid
        _assert_bitwise(r["final"]["master"], s["full"]["master"], f"{cid} final master")
        _assert_bitwise(r["final"]["module"], s["full"]["module"], f"{cid} final module")
        assert r["final"]["counters"] == s["full"]["counters"], cid
        assert r["draws"] == s["draws"], f"{cid}: RNG states not restored"
        assert r["client"] == CLIENT_STATE and r["path"].endswith(f"{cid}/global_step{SPLIT}"), cid


def test_exact_resume_world1(saved, resumed_w1):
    _check_exact(W1, saved, resumed_w1)


@pytest.fixture(scope="module")
def resumed_w2(saved, root):
    return run_ranks(2, resume_world2, W2, root)


def test_exact_resume_world2(saved, resumed_w2):
    _check_exact(W2, saved, resumed_w2)


def test_save_refused_by_one_rank_is_refused_by_all(saved, root):
    prep, tags, warned = saved["refused_saves"]
    assert prep == "checkpoint preparation failed on rank(s) [1]; nothing was published", prep
    assert tags.startswith("tag: ranks passed different tags"), tags
    assert list(Path(root, "refused").iterdir()) == []  # no tag, no latest, no staging left
    assert (
        warned == "latest,rank0,zero_to_fp32.py,zero_to_torch.py"
    )  # tag_validation "warn": rank 0's tag, one checkpoint


def test_load_refused_by_one_rank_changes_no_rank(resumed_w2):
    r = resumed_w2["refused_load"]
    assert r["msg"] == "checkpoint validation failed on rank(s) [1]; nothing was loaded", r["msg"]
    assert r["unchanged"]


def _check_elastic(case, saved, resumed) -> None:
    src, r = saved[case["from"]], resumed[case["id"]]
    init = {
        n: p.detach().float().clone() for n, p in make_model().named_parameters() if p.requires_grad
    }
    # Loading re-slices the same numbers into another layout: equal at once, bitwise.
    _assert_bitwise(r["loaded"]["master"], src["at_save"]["master"], f"{case['id']} loaded master")
    err = displacement_err(r["final"]["master"], src["full"]["master"], init)
    assert err < 1e-3, (case["id"], err)
    assert max(abs(a - b) for a, b in zip(r["rest"], src["straight"][SPLIT:])) < 1e-4, case["id"]


@pytest.mark.parametrize("case", ELASTIC_W1, ids=lambda c: c["id"])
def test_elastic_world2_to_world1(case, saved, resumed_w1):
    _check_elastic(case, saved, resumed_w1)


def test_elastic_world2_to_world4(saved, root):
    resumed = run_ranks(4, resume_phase, ELASTIC_W4, root)
    for case in ELASTIC_W4:
        _check_elastic(case, saved, resumed)


def test_export_of_sharded_checkpoint_equals_gathered_masters(saved, root):
    from safetensors.torch import load_file

    from zero_offload.checkpoint import export_safetensors, get_fp32_state_dict_from_zero_checkpoint

    for cid in ("w2-s2-offload-fp32", "w2-s2-offload-bf16", "w2-s3-fp32", "w2-s3-params-fp16"):
        at_save = saved[cid]["at_save"]
        sd = get_fp32_state_dict_from_zero_checkpoint(f"{root}/{cid}")
        assert list(sd) == list(at_save["module"])
        for k, v in sd.items():
            want = at_save["master"].get(k, at_save["module"][k].float())
            assert v.dtype == torch.float32 and torch.equal(v, want), (cid, k)
        out = export_safetensors(f"{root}/{cid}", f"{root}/export-{cid}/model.safetensors")
        model = make_model()
        model.load_state_dict(load_file(str(out)), strict=True)
        for k, v in model.state_dict().items():
            assert torch.equal(v, sd[k]), (cid, k)
