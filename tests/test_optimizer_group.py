"""The engine's optimizer groups: one OptimizerGroup per param group, each with its flat group,
grad shard, param home and the update path of the engine's one placement."""

import pytest
from parity import engine_config, make_model

import zero_offload


@pytest.mark.parametrize("offload, where", [(False, "device"), (True, "host")])
def test_one_object_per_param_group(offload, where):
    model = make_model()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in trained if n.endswith("weight")]
    rest = [p for n, p in trained if not n.endswith("weight")]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    cfg = engine_config(stage=2, offload=offload, gas=1, micro=2, clip=0.0, overlap=False)
    engine, opt, _, _ = zero_offload.initialize(model=model, model_parameters=groups, config=cfg)
    try:
        assert len(engine.opt_groups) == 2
        for i, og in enumerate(engine.opt_groups):
            assert og.index == i and og.placement is engine.placement
            assert og.state.where == where and og.state is og.optimizer.state
            assert og.optimizer.grads is og.grads and og.optimizer.home is og.home
            assert og.flat.hyper is opt.param_groups[i]
            assert {id(p) for p in og.flat.params} == {id(p) for p in groups[i]["params"]}
        for view in ("groups", "grad_shards", "shard_opts"):  # the groups, nothing in parallel
            assert not hasattr(engine, view)
    finally:
        engine.destroy()
