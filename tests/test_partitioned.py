"""``core/partitioned.py`` answers where a param's shard is through a model's whole life: built
under ``zero.Init`` (init form), wrapped by a stage-3 engine (store form, linked to the engine),
and released by ``destroy`` (init form again, no link)."""

from __future__ import annotations

import copy

from torch import nn

import zero_offload
from zero_offload.core import partitioned
from zero_offload.utils import set_z3_leaf_module

STAGE3 = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def test_a_param_moves_between_the_forms_and_the_answers_follow() -> None:
    with zero_offload.zero.Init(config_dict_or_path=STAGE3):
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    params = list(net.parameters())
    for p in params:  # init form: the split is this rank's whole param on one rank
        spec = partitioned.init_shard(p)
        assert spec is not None and (spec.lo, spec.hi) == (0, p.ds_numel)
        assert partitioned.is_partitioned(p) and partitioned.slot_of(p) is None
        assert partitioned.store_of(p) is None and partitioned.engine_link(p) is None

    engine, *_ = zero_offload.initialize(model=net, config=copy.deepcopy(STAGE3))
    for p in params:  # store form, linked to the engine
        assert partitioned.init_shard(p) is None and partitioned.is_partitioned(p)
        assert partitioned.store_of(p) is engine.param_store
        assert any(q is p for q in engine.param_store.slots[partitioned.slot_of(p)].params)
        link = partitioned.engine_link(p)
        assert link.engine() is engine
        assert engine.opt_groups[link.group].flat.params[link.index] is p
    assert engine.optimizer.needs_scaler() is False  # asked of the engine it was given

    engine.destroy()
    for p in params:  # back to the init form: the model stays partitioned without the engine
        assert partitioned.init_shard(p) is not None
        assert partitioned.slot_of(p) is None and partitioned.store_of(p) is None
        assert partitioned.engine_link(p) is None


def test_leaf_flag_and_external_params_are_recorded_once() -> None:
    outer, inner = nn.Linear(2, 2), nn.Linear(2, 2)
    assert not partitioned.is_leaf_module(outer)
    set_z3_leaf_module(outer, True)
    assert partitioned.is_leaf_module(outer)
    set_z3_leaf_module(outer, False)
    assert not partitioned.is_leaf_module(outer)
    for _ in range(2):
        zero_offload.zero.register_external_parameter(outer, inner.weight)
    assert list(partitioned.external_params(outer)) == [inner.weight]
    assert list(partitioned.external_params(inner)) == []
