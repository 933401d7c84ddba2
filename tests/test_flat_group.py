"""FlatGroup: params become views of one flat buffer in flat (reverse registration) order; the
segments and shard size follow the layout."""

import torch
from components import flat_group, tiny_params


def test_params_are_views_of_the_flat_buffer_in_flat_order():
    params = tiny_params()
    values = [p.detach().clone() for p in params]
    g = flat_group(params)
    assert g.params == list(reversed(params)) and g.names == ["p2", "p1", "p0"]
    for p, off, v in zip(g.params, g.layout.offsets, reversed(values)):
        assert p.data.data_ptr() == g.flat[off:].data_ptr() and torch.equal(p.detach(), v)
    g.flat.zero_()  # writing the buffer writes the params
    assert all(not p.detach().any() for p in params)


def test_segments_cover_the_shard_at_world_one():
    g = flat_group(tiny_params())
    whole = g.segments(False)
    assert sum(s.numel for s in whole) == g.shard_numel(False) == g.layout.total
    assert g.shard_numel(True) == g.layout.shard_numel
    views = g.param_views(torch.arange(g.layout.total, dtype=torch.float32))
    assert [v.shape for v in views] == [p.shape for p in g.params]
