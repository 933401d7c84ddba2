"""Stage 3 at world 1: ParamStore partitions the params into its shard (each param emptied,
DeepSpeed's ds_* attributes set) and gathers a slot back; FetchSchedule gathers each module's
slots around its forward and releases them after."""

import torch
from components import CPU

from zero_offload.core import partitioned
from zero_offload.core.flat_group import FlatGroup
from zero_offload.core.status import ZeroParamStatus
from zero_offload.core.streams import Streams
from zero_offload.runtime.backward_scope import BackwardScope
from zero_offload.runtime.stage3.fetch_schedule import FetchSchedule
from zero_offload.runtime.stage3.param_store import ParamStore, Stage3Policy
from zero_offload.runtime.stage3.partition_units import unit_ids, unit_layout

POLICY = Stage3Policy(param_persistence_threshold=0, prefetch_bucket_size=0)


def _store(module: torch.nn.Module) -> ParamStore:
    params = list(module.parameters())
    layout = unit_layout(params, unit_ids(module), 1)
    names = [n for n, _ in module.named_parameters()]
    g = FlatGroup(0, params, names, {}, torch.float32, CPU, 1, 0, 1 << 20, layout=layout,
                  materialize=False)  # fmt: skip
    return ParamStore([g], [True], POLICY, Streams(CPU), CPU)


def test_store_partitions_and_gathers_a_slot():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    values = {n: p.detach().clone() for n, p in module.named_parameters()}
    store = _store(module)
    assert all(p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE
               for p in module.parameters())  # fmt: skip
    assert [tuple(p.ds_shape) for p in module.parameters()] == [
        tuple(v.shape) for v in values.values()
    ]
    slot = partitioned.slot_of(module[0].weight)
    store.fetch([slot])
    assert torch.equal(module[0].weight.detach(), values["0.weight"])
    store.release(slot)
    assert module[0].weight.numel() == 0


def test_schedule_gathers_around_each_forward():
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    x = torch.randn(5, 4)
    with torch.no_grad():
        want = module(x)
    store = _store(module)
    schedule = FetchSchedule(store, module, POLICY, BackwardScope(lambda driver: None))
    with torch.no_grad():
        got = module(x)
    assert torch.equal(got, want)
    assert all(p.numel() == 0 for p in module.parameters())  # released after the forward
    schedule.remove()
